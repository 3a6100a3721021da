"""The memory reporter's output: pytorch_memlab's text layout, HTML for Jupyter, pandas."""

from __future__ import annotations

import functools
import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchmem.units import readable_size

if TYPE_CHECKING:
    from torchmem.tensors import TensorDiff, TensorRecord

ROW = "{:<40s}{:>20s}{:>10s}"
RULE = "-" * 79
DIFFERS = "Memory differs due to the matrix alignment or invisible gradient buffer tensors"

# A report repeats the same few shapes and sizes: format each once.
_readable = functools.lru_cache(maxsize=4096)(readable_size)


def tensors_text(
    records: Sequence[TensorRecord], allocated: Mapping[str, int], verbose: bool = False
) -> str:
    """pytorch_memlab's layout: a header, then per device (first seen first) its rows,
    ``Total Tensors`` (sum of element counts, shared tensors included) and ``Used
    Memory``, and on CUDA the allocator's count. Without `verbose`, tensors that share a
    storage listed before them are not shown (they add no bytes)."""
    lines = [ROW.format("Element type", "Size", "Used MEM")]
    for device, rows in _by_device(records).items():
        lines += [RULE, f"Storage on {device}"]
        for r in rows:
            if r.owner is not None and not verbose:
                continue
            lines.append(ROW.format(_name(r), size_text(r.shape), _used(r)))
        used = sum(r.nbytes for r in rows)
        lines += [
            RULE,
            f"Total Tensors: {sum(r.numel for r in rows)} \tUsed Memory: {readable_size(used)}",
        ]
        lines += [f"{r.name}: not counted, {r.note}" for r in rows if r.note is not None]
        if device in allocated:
            lines.append(f"The allocated memory on {device}: {readable_size(allocated[device])}")
            if allocated[device] != used:
                lines.append(DIFFERS)
        lines.append(RULE)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=4096)
def size_text(shape: tuple[int | str, ...] | None) -> str:
    """The Size column: ``str(tuple(size))``, ``(1,)`` for a 0-d tensor as pytorch_memlab
    shows it, ``?`` where there is no single size."""
    if shape is None:
        return "?"
    if not shape:
        return "(1,)"
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


def tensors_html(
    records: Sequence[TensorRecord], allocated: Mapping[str, int], verbose: bool = False
) -> str:
    """A table per device with the text's rows and totals, for Jupyter."""
    if not records:
        return "<p>No tensors</p>"
    blocks = []
    for device, rows in _by_device(records).items():
        used = sum(r.nbytes for r in rows)
        body = "".join(
            f'<tr><td style="text-align: left">{html.escape(_name(r))}</td>'
            f"<td>{html.escape(size_text(r.shape))}</td><td>{html.escape(r.dtype)}</td>"
            f"<td>{_used(r)}</td></tr>"
            for r in rows
            if r.owner is None or verbose
        )
        foot = f"Total Tensors: {sum(r.numel for r in rows)}, Used Memory: {readable_size(used)}"
        if device in allocated:
            foot += f"; allocated on {device}: {readable_size(allocated[device])}"
        blocks.append(
            f"<h4>Storage on {html.escape(device)}</h4>"
            '<table style="border-collapse: collapse"><thead><tr>'
            "<th>Element type</th><th>Size</th><th>dtype</th><th>Used MEM</th></tr></thead>"
            f"<tbody>{body}</tbody></table><p>{html.escape(foot)}</p>"
        )
    return "\n".join(blocks)


def tensors_dataframe(records: Sequence[TensorRecord]) -> Any:
    """One row per tensor: ``name``, ``device``, ``shape``, ``dtype``, ``layout``,
    ``kind``, ``numel``, ``nbytes`` (bytes), ``owner``, ``note``."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("to_dataframe() needs pandas: pip install pandas") from None
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
    rows = [{c: getattr(r, c) for c in columns} for r in records]
    return pd.DataFrame(rows, columns=columns)


def diff_text(difference: TensorDiff) -> str:
    """The tensors that appeared (``+``) and disappeared (``-``), in the report's columns,
    then their counts and bytes."""
    lines = [ROW.format("Element type", "Size", "Used MEM"), RULE]
    for sign, records in (("+", difference.appeared), ("-", difference.disappeared)):
        for r in records:
            lines.append(
                ROW.format(f"{sign} {_name(r)} [{r.device}]", size_text(r.shape), _used(r))
            )
    added = sum(r.nbytes for r in difference.appeared)
    removed = sum(r.nbytes for r in difference.disappeared)
    lines += [
        RULE,
        f"Appeared: {len(difference.appeared)} ({readable_size(added)}) \t"
        f"Disappeared: {len(difference.disappeared)} ({readable_size(removed)})",
        RULE,
    ]
    return "\n".join(lines) + "\n"
