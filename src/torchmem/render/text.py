"""Plain-text tables for terminals."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()) -> str:
    """A table with one space-padded column per header, two spaces between columns.

    Columns are right-aligned (numbers and sizes line up), except those whose positions
    are in `left`. No trailing spaces; no final newline.
    """
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = [
            str(cell).ljust(width) if i in left else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
