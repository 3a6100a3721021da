"""Plain-text tables for terminals: the one table helper every renderer uses; and
:func:`encodable`, for what a renderer writes."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

_SURROGATE = re.compile("[\ud800-\udfff]")


def table(
    rows: Sequence[Sequence[str]],
    *,
    left: Collection[int] = (),
    gap: str = "  ",
    widths: Sequence[int] | None = None,
) -> list[str]:
    """`rows` of cells as lines of text, one column per position, `gap` between columns.

    Cells are right-aligned, so numbers and sizes line up, except in the columns whose
    positions are in `left`. Each column is as wide as its widest cell (header rows are
    just the first rows), or as given in `widths`, a fixed layout where a longer cell
    overflows and pushes the rest of its own row only. Lines carry no trailing spaces.
    """
    if widths is None:
        widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    return [
        gap.join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def encodable(text: str) -> str:
    """`text` with each lone surrogate, which UTF-8 cannot encode, written as an escape:
    ``\\xff`` for a byte of a file name that is not UTF-8 (:func:`os.fsdecode` makes it
    U+DCFF, and a file name from a snapshot keeps it), ``\\ud800`` for any other."""
    return _SURROGATE.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"
