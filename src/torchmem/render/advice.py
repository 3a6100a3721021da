"""Advice as a terminal table, HTML for Jupyter, a self-contained page, and pandas."""

from __future__ import annotations

import html as markup
from typing import Any

from torchmem.errors import require
from torchmem.records.advice import AdviceRecord
from torchmem.render.kit import page as page_of
from torchmem.render.text import table
from torchmem.units import readable_size

HEADER = ("change", "saves", "peak", "saves reserved", "reserved", "what to do")


def _headline(record: AdviceRecord) -> str:
    name = record.function or "the function"
    return f"torchmem advice: {name} on {record.device} ({record.seconds:.2f}s)"


def _totals(record: AdviceRecord) -> str:
    found = (
        f"Estimated peak {readable_size(record.peak_bytes)}"
        f" (reserved {readable_size(record.reserved_bytes)}) as the step is"
    )
    if not record.changes:
        return found + "; no change tried lowers it."
    return (
        f"{found}; {readable_size(record.advised_peak_bytes)}"
        f" (reserved {readable_size(record.advised_reserved_bytes)}) with every change below."
    )


def _rows(record: AdviceRecord) -> list[tuple[str, ...]]:
    return [
        (
            change.kind,
            readable_size(change.saving_bytes),
            readable_size(change.peak_bytes),
            readable_size(change.reserved_saving_bytes),
            readable_size(change.reserved_bytes),
            change.action,
        )
        for change in record.changes
    ]


def _batch(record: AdviceRecord) -> str | None:
    found = record.largest_batch
    if found is None:
        return None
    size = readable_size(found.capacity_bytes)
    line = f"Largest batch that fits {f'{found.gpu} ({size})' if found.gpu else size}:"
    line += f" {found.batch} as the step is"
    if record.changes:
        line += f", {found.advised_batch} with every change above"
    return line + "."


def text(record: AdviceRecord, top: int = 10) -> str:
    """The totals, each change with its saving and what to do, the largest batch, and the
    notes (each change not advised, and why)."""
    blocks = [_headline(record), _totals(record)]
    if record.changes:
        blocks.append("\n".join(table([HEADER, *_rows(record)], left=(0, 5))))
    batch = _batch(record)
    if batch is not None:
        blocks.append(batch)
    if record.notes:
        blocks.append("\n".join(["Notes:"] + [f"  - {note}" for note in record.notes]))
    return "\n\n".join(blocks)


def html(record: AdviceRecord, top: int = 10) -> str:
    """:func:`text` as an HTML fragment (Jupyter)."""
    parts = [
        f"<h3>{markup.escape(_headline(record))}</h3>",
        f"<p>{markup.escape(_totals(record))}</p>",
    ]
    if record.changes:
        head = "".join(f"<th>{markup.escape(h)}</th>" for h in HEADER)
        body = "".join(
            "<tr>"
            + "".join(f"<td>{markup.escape(cell)}</td>" for cell in row[:-1])
            + f'<td style="text-align:left">{markup.escape(row[-1])}</td></tr>'
            for row in _rows(record)
        )
        parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    batch = _batch(record)
    if batch is not None:
        parts.append(f"<p>{markup.escape(batch)}</p>")
    if record.notes:
        entries = "".join(f"<li>{markup.escape(note)}</li>" for note in record.notes)
        parts.append(f"<h4>Notes</h4><ul>{entries}</ul>")
    return '<div class="torchmem-advice">' + "\n".join(parts) + "</div>"


def page(record: AdviceRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html` that opens offline."""
    return page_of(_headline(record), html(record, top))


def dataframe(record: AdviceRecord) -> Any:
    """One row per change listed: columns ``change``, ``saving_bytes``, ``peak_bytes``,
    ``reserved_saving_bytes``, ``reserved_bytes``, ``action``. Needs pandas."""
    pd = require("pandas", "advice's DataFrame")
    changes = record.changes
    return pd.DataFrame(
        {
            "change": [c.kind for c in changes],
            "saving_bytes": pd.array([c.saving_bytes for c in changes], dtype="int64"),
            "peak_bytes": pd.array([c.peak_bytes for c in changes], dtype="int64"),
            "reserved_saving_bytes": pd.array(
                [c.reserved_saving_bytes for c in changes], dtype="int64"
            ),
            "reserved_bytes": pd.array([c.reserved_bytes for c in changes], dtype="int64"),
            "action": [c.action for c in changes],
        }
    )
