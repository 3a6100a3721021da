"""The shape every report shares, as memray's reporters share theirs: it prints as text,
shows as HTML in Jupyter, gives a pandas DataFrame, writes a self-contained HTML page and
its JSON. A report is a record (:mod:`torchmem.records`) with this mixed in; its renderer
module (:mod:`torchmem.render`) provides ``text``, ``html``, ``page`` and ``dataframe``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from torchmem.records import TOP


class Report:
    """Text, HTML, DataFrame, page and JSON of a record, by its renderer."""

    renderer: ClassVar[str]
    """The name of its module in :mod:`torchmem.render` (``"run"``, ``"ranks"``, ...)."""
    top: int = TOP
    """How many lines each list of the text and HTML shows (the JSON keeps them all)."""

    def _render(self) -> ModuleType:
        # Imported when a report is shown, not when it is made: collectors never need it.
        return importlib.import_module(f"torchmem.render.{self.renderer}")

    def __str__(self) -> str:
        return str(self._render().text(self, self.top))

    def _repr_html_(self) -> str:
        return str(self._render().html(self, self.top))

    def to_dataframe(self) -> Any:
        """The report as a pandas DataFrame (its columns are its renderer's); needs pandas."""
        return self._render().dataframe(self)

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError  # each record says its JSON

    def save_json(self, path: str | Path) -> None:
        """Write :meth:`to_json` to `path` (the contract is in docs/json.md)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def save_html(self, path: str | Path) -> None:
        """Write a self-contained HTML page to `path` (no scripts, no network)."""
        Path(path).write_text(self._render().page(self, self.top), encoding="utf-8")
