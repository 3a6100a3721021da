"""The cell logger's report: the seed's text rows, a pandas DataFrame, a matplotlib figure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

from torchmem.errors import require
from torchmem.records.cells import CellRecord
from torchmem.render.run import growth_lines
from torchmem.units import MB, b2mb

GEN_LABEL = "Gen:"


def gpu_label(record: CellRecord) -> str:
    """The second row's label: ``GPU:`` for a GPU, ``CPU tensors:`` where there is none."""
    return "CPU tensors:" if record.gpu_device == "cpu" else "GPU:"


def _rows(record: CellRecord) -> list[tuple[str, int, int, int]]:
    return [
        (GEN_LABEL, record.gen_used_delta, record.gen_peaked, record.gen_used),
        (gpu_label(record), record.gpu_used_delta, record.gpu_peaked, record.gpu_used),
    ]


def text(record: CellRecord) -> str:
    """ipygpulogger's report, in whole MB (``b2mb``), one line per row::

        RAM: Consumed Peaked  Used Total  in 0.000s (In [4])
        Gen:       45      0    170 MB
        GPU:     2467      0   1465 MB

    Where there is no GPU the second row is ``CPU tensors:`` and the first column widens
    to fit it. ``(In [n])`` is left out for a cell IPython gave no number. A cell whose
    memory grew at each training step (:attr:`CellRecord.growth`) has the growth in words
    below.
    """
    rows = _rows(record)
    width = max(len(label) for label, *_ in rows)
    where = "" if record.execution_count is None else f" (In [{record.execution_count}])"
    lines = [f"{'RAM:':<{width}} Consumed Peaked  Used Total  in {record.time_delta:0.3f}s{where}"]
    for label, used_delta, peaked, used in rows:
        lines.append(
            f"{label:<{width}}    {b2mb(used_delta):5d}  {b2mb(peaked):5d}  {b2mb(used):5d} MB"
        )
    return "\n".join(lines + _growth(record))


def _growth(record: CellRecord) -> list[str]:
    """The cell's growth per training step, in words, where it has one."""
    return [] if record.growth is None else growth_lines(record.growth)


def compact(record: CellRecord) -> str:
    """ipygpulogger's one-line report, in whole MB::

    Gen: 45/0/170 MB | GPU: 2467/0/1465 MB | Time 0.000s | (Consumed/Peaked/Used Total)
    """
    parts = [
        f"{label} {b2mb(used_delta)}/{b2mb(peaked)}/{b2mb(used)} MB"
        for label, used_delta, peaked, used in _rows(record)
    ]
    parts.append(f"Time {record.time_delta:0.3f}s")
    parts.append("(Consumed/Peaked/Used Total)")
    return "\n".join([" | ".join(parts), *_growth(record)])


def dataframe(records: Sequence[CellRecord]) -> Any:
    """One row per cell, every field of :class:`~torchmem.records.cells.CellRecord` a
    column (bytes and seconds; ``growth`` a dictionary of its fields, or None). Needs
    pandas."""
    pd = require("pandas", "to_dataframe()")
    columns = [field.name for field in fields(CellRecord)]
    return pd.DataFrame([asdict(r) for r in records], columns=columns)


def figure(records: Sequence[CellRecord]) -> Any:
    """A matplotlib figure: for each row (general RAM, then GPU or CPU tensors), the memory
    used after each cell and the peak during it, in MiB, over the cells. Needs matplotlib;
    uses no pyplot state, so it works under any backend."""
    figures = require("matplotlib.figure", "plot()", "plot")
    figure = figures.Figure(figsize=(8, 5), layout="constrained")
    axes = figure.subplots(2, 1, sharex=True)
    ticks = list(range(len(records)))
    names = ["" if r.execution_count is None else f"[{r.execution_count}]" for r in records]
    series = (
        ("General RAM (process RSS)", "gen"),
        (_gpu_title(records), "gpu"),
    )
    for ax, (title, prefix) in zip(axes, series, strict=True):
        used = [getattr(r, f"{prefix}_used") for r in records]
        delta = [getattr(r, f"{prefix}_used_delta") for r in records]
        peaked = [getattr(r, f"{prefix}_peaked") for r in records]
        peak = [p + max(u - d, u) for u, d, p in zip(used, delta, peaked, strict=True)]
        ax.plot(ticks, [u / MB for u in used], marker="o", label="used after the cell")
        ax.plot(ticks, [p / MB for p in peak], marker="^", linestyle="--", label="peak")
        ax.set_title(title)
        ax.set_ylabel("MiB")
        ax.legend(loc="best")
    axes[-1].set_xticks(ticks, names)
    axes[-1].set_xlabel("cell")
    return figure


def _gpu_title(records: Sequence[CellRecord]) -> str:
    devices = sorted({r.gpu_device for r in records})
    if devices == ["cpu"]:
        return "CPU tensors"
    return "GPU " + ", ".join(devices) if devices else "GPU"
