"""The line profiler's records: one per profiled function, one per source line."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LineRecord:
    """One source line of a profiled function."""

    lineno: int
    """Line number in its file."""
    code: str
    """The source text of the line, without its newline; empty where the source is unknown."""
    hits: int
    """How many times the line ran (a loop header runs once more than its body)."""
    stats: dict[str, int] = field(default_factory=dict)
    """Column -> value, bytes for stats named ``*bytes*`` (counts otherwise): peaks and
    ``current`` are the maximum over the line's runs, ``allocated``, ``freed`` and ``delta``
    their sum. Empty for a line that never ran."""


@dataclass(frozen=True)
class FunctionRecord:
    """The lines of one profiled function."""

    qualname: str
    """The function's qualified name, e.g. ``Net.forward``."""
    filename: str
    """The file the function was defined in (``<ipython-input-...>`` for a notebook cell)."""
    lines: tuple[LineRecord, ...]
    """Every source line from the first decorator or ``def`` to the last line, in order."""

    @property
    def ran(self) -> bool:
        """True if any line of it ran while profiled."""
        return any(line.hits for line in self.lines)
