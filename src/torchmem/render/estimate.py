"""An estimate as a terminal table, HTML for Jupyter, a self-contained page, and pandas."""

from __future__ import annotations

import html as markup
from typing import Any

from torchmem.errors import require
from torchmem.records.estimate import EstimateRecord
from torchmem.records.run import CATEGORIES
from torchmem.render import chart
from torchmem.render.kit import page as page_of
from torchmem.render.run import details_html, details_text, terminal_width
from torchmem.render.text import table
from torchmem.units import readable_size

RANKS = "Each rank at its peak (*: the highest, shown below):"


def _headline(record: EstimateRecord) -> str:
    name = record.function or "the function"
    which = f", rank {record.rank} of {record.world_size}" if record.ranks else ""
    return f"torchmem estimate: {name} on {record.device}{which} ({record.seconds:.2f}s)"


def _ranks(record: EstimateRecord) -> list[tuple[str, ...]]:
    """A row per rank: its peak (and reserve, on CUDA), and what its memory was at its
    peak, for the categories any rank had; the rank shown (the highest peak) starred."""
    cuda = record.device == "cuda"
    shown = [name for name in CATEGORIES if any(e.categories.get(name) for e in record.ranks)]
    rows = [("rank", "peak", *(("reserved",) if cuda else ()), *shown)]
    for each in record.ranks:
        sizes = [each.peak_bytes, *((each.reserved_bytes,) if cuda else ())]
        sizes += [each.categories.get(name, 0) for name in shown]
        star = " *" if each.rank == record.rank else ""
        rows.append((f"{each.rank}{star}", *map(readable_size, sizes)))
    return rows


def _totals(record: EstimateRecord) -> list[tuple[str, ...]]:
    if record.device == "cpu":
        return [("peak",), (readable_size(record.peak_bytes),)]
    needs = record.reserved_bytes + record.context_bytes
    return [
        ("peak allocated", "peak reserved", "+ CUDA context", "= total"),
        (
            readable_size(record.peak_bytes),
            readable_size(record.reserved_bytes),
            readable_size(record.context_bytes),
            readable_size(needs),
        ),
    ]


def _lists(record: EstimateRecord) -> list[tuple[str, tuple[str, ...]]]:
    found = [("Modelled:", record.modelled), ("Not modelled:", record.not_modelled)]
    if record.device == "cuda":
        settings = (
            f"cuBLAS workspace {readable_size(record.workspace_bytes)} per thread",
            f"expandable segments {'on' if record.expandable_segments else 'off'}",
        )
        found.append(("Settings:", settings))
    found.append(("Notes:", record.notes))
    return [(title, items) for title, items in found if items]


def text(record: EstimateRecord, top: int = 10) -> str:
    """The terminal summary: the totals, then what the memory was at the peak, the lines
    and largest allocations alive then, each module's peaks, and what was modelled."""
    blocks = [_headline(record), "\n".join(table(_totals(record)))]
    if record.ranks:
        blocks.append("\n".join([RANKS, *table(_ranks(record))]))
    blocks += details_text(record.run, record.modules, top, terminal_width())
    for title, items in _lists(record):
        blocks.append("\n".join([title] + [f"  - {item}" for item in items]))
    return "\n\n".join(blocks)


def html(record: EstimateRecord, top: int = 10) -> str:
    """:func:`text` as an HTML fragment (Jupyter), with the step's timeline as SVG."""
    header, values = _totals(record)
    cells = "".join(f"<th>{markup.escape(h)}</th>" for h in header)
    row = "".join(f"<td>{markup.escape(v)}</td>" for v in values)
    parts = [
        f"<h3>{markup.escape(_headline(record))}</h3>",
        f"<table><thead><tr>{cells}</tr></thead><tbody><tr>{row}</tr></tbody></table>",
        _ranks_html(record),
        chart.timeline(record.run),
        details_html(record.run, record.modules, top),
    ]
    for title, items in _lists(record):
        entries = "".join(f"<li>{markup.escape(item)}</li>" for item in items)
        parts.append(f"<h4>{markup.escape(title)}</h4><ul>{entries}</ul>")
    parts.append(f"<script>\n{chart.SCRIPT}</script>")
    return '<div class="torchmem-estimate">' + "\n".join(parts) + "</div>"


def _ranks_html(record: EstimateRecord) -> str:
    if not record.ranks:
        return ""
    header, *rows = _ranks(record)
    head = "".join(f"<th>{markup.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{markup.escape(v)}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<h4>{RANKS}</h4><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(record: EstimateRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html` that opens offline (one inline script, the
    chart's hover; no fonts or links to fetch)."""
    return page_of(_headline(record), html(record, top))


def dataframe(record: EstimateRecord) -> Any:
    """Columns ``what`` and ``bytes``: ``peak``, ``reserved``, then each of
    :data:`~torchmem.records.run.CATEGORIES` at the peak. Needs pandas."""
    pd = require("pandas", "an estimate's DataFrame")
    names = ["peak", "reserved", *CATEGORIES]
    sizes = [record.peak_bytes, record.reserved_bytes]
    sizes += [record.categories.get(name, 0) for name in CATEGORIES]
    return pd.DataFrame({"what": names, "bytes": pd.array(sizes, dtype="int64")})
