"""The memory reporter's output: pytorch_memlab's text layout, HTML for Jupyter, pandas."""

from __future__ import annotations

import functools
import html as markup
from collections.abc import Mapping, Sequence
from typing import Any

from torchmem.errors import require
from torchmem.records.tensors import TensorRecord
from torchmem.render.text import table
from torchmem.units import readable_size

WIDTHS = (40, 20, 10)
"""pytorch_memlab's fixed columns: the name left-aligned in 40, the size and the bytes
right-aligned in 20 and 10; a longer cell overflows."""
RULE = "-" * 79
HEADER = ("Element type", "Size", "Used MEM")
DIFFERS = "Memory differs due to the matrix alignment or invisible gradient buffer tensors"

# A report repeats the same few shapes and sizes: format each once.
_readable = functools.lru_cache(maxsize=4096)(readable_size)


def rows(cells: Sequence[tuple[str, str, str]]) -> list[str]:
    """(name, size, bytes) cells as lines in pytorch_memlab's fixed columns."""
    return table(cells, left=(0,), gap="", widths=WIDTHS)


def text(
    records: Sequence[TensorRecord], allocated: Mapping[str, int], verbose: bool = False
) -> str:
    """pytorch_memlab's layout: a header, then per device (first seen first) its rows,
    ``Total Tensors`` (sum of element counts, shared tensors included) and ``Used
    Memory``, and on CUDA the allocator's count. Without `verbose`, tensors that share a
    storage listed before them are not shown (they add no bytes)."""
    lines = rows([HEADER])
    for device, group in _by_device(records).items():
        lines += [RULE, f"Storage on {device}"]
        lines += rows(
            [(_name(r), size_text(r.shape), _used(r)) for r in group if r.owner is None or verbose]
        )
        used = sum(r.nbytes for r in group)
        lines += [
            RULE,
            f"Total Tensors: {sum(r.numel for r in group)} \tUsed Memory: {readable_size(used)}",
        ]
        lines += [f"{r.name}: not counted, {r.note}" for r in group if r.note is not None]
        if device in allocated:
            lines.append(f"The allocated memory on {device}: {readable_size(allocated[device])}")
            if allocated[device] != used:
                lines.append(DIFFERS)
        lines.append(RULE)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=4096)
def size_text(shape: tuple[int | str, ...] | None) -> str:
    """The Size column: ``str(tuple(size))``, ``()`` for a 0-d tensor (pytorch_memlab
    showed ``(1,)``), ``?`` where there is no single size."""
    if shape is None:
        return "?"
    if not shape:
        return "()"
    inner = ", ".join(str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _name(record: TensorRecord) -> str:
    return record.name if record.owner is None else f"{record.name}(->{record.owner})"


def _used(record: TensorRecord) -> str:
    return "?" if record.note is not None else _readable(record.nbytes)


def _by_device(records: Sequence[TensorRecord]) -> dict[str, list[TensorRecord]]:
    groups: dict[str, list[TensorRecord]] = {}
    for record in records:
        groups.setdefault(record.device, []).append(record)
    return groups


def html(
    records: Sequence[TensorRecord], allocated: Mapping[str, int], verbose: bool = False
) -> str:
    """A table per device with the text's rows and totals, for Jupyter."""
    if not records:
        return "<p>No tensors</p>"
    blocks = []
    for device, group in _by_device(records).items():
        used = sum(r.nbytes for r in group)
        body = "".join(
            f'<tr><td style="text-align: left">{markup.escape(_name(r))}</td>'
            f"<td>{markup.escape(size_text(r.shape))}</td><td>{markup.escape(r.dtype)}</td>"
            f"<td>{_used(r)}</td></tr>"
            for r in group
            if r.owner is None or verbose
        )
        foot = f"Total Tensors: {sum(r.numel for r in group)}, Used Memory: {readable_size(used)}"
        if device in allocated:
            foot += f"; allocated on {device}: {readable_size(allocated[device])}"
        blocks.append(
            f"<h4>Storage on {markup.escape(device)}</h4>"
            '<table style="border-collapse: collapse"><thead><tr>'
            "<th>Element type</th><th>Size</th><th>dtype</th><th>Used MEM</th></tr></thead>"
            f"<tbody>{body}</tbody></table><p>{markup.escape(foot)}</p>"
        )
    return "\n".join(blocks)


def dataframe(records: Sequence[TensorRecord]) -> Any:
    """One row per tensor: ``name``, ``device``, ``shape``, ``dtype``, ``layout``,
    ``kind``, ``numel``, ``nbytes`` (bytes), ``owner``, ``note``."""
    pd = require("pandas", "to_dataframe()")
    columns = [
        "name",
        "device",
        "shape",
        "dtype",
        "layout",
        "kind",
        "numel",
        "nbytes",
        "owner",
        "note",
    ]
    data = [{c: getattr(r, c) for c in columns} for r in records]
    return pd.DataFrame(data, columns=columns)


def diff_text(appeared: Sequence[TensorRecord], disappeared: Sequence[TensorRecord]) -> str:
    """The tensors that `appeared` (``+``) and `disappeared` (``-``) between two snapshots,
    in the report's columns, then their counts and bytes."""
    lines = [*rows([HEADER]), RULE]
    lines += rows(
        [
            (f"{sign} {_name(r)} [{r.device}]", size_text(r.shape), _used(r))
            for sign, group in (("+", appeared), ("-", disappeared))
            for r in group
        ]
    )
    added = sum(r.nbytes for r in appeared)
    removed = sum(r.nbytes for r in disappeared)
    lines += [
        RULE,
        f"Appeared: {len(appeared)} ({readable_size(added)}) \t"
        f"Disappeared: {len(disappeared)} ({readable_size(removed)})",
        RULE,
    ]
    return "\n".join(lines) + "\n"
