"""The IPython extension: ``%load_ext torchmem`` registers torchmem's magics.

IPython is imported only when the extension loads, never at ``import torchmem``.
"""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%mlrun`` / ``%%mlrun`` in `ipython` (what ``%load_ext torchmem`` calls)."""
    from torchmem.notebook import magics

    magics.register(ipython)
