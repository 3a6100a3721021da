"""Plain-text tables for terminals: the one table helper every renderer uses."""

from __future__ import annotations

from collections.abc import Collection, Sequence


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
