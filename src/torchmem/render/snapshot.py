"""A memory snapshot: a terminal summary, HTML for Jupyter, a self-contained HTML page with
a timeline and a segment map, pandas, and the difference of two snapshots.

Every renderer reads a :class:`~torchmem.records.snapshot.SnapshotRecord`: per device the
bytes allocated, active and reserved, the peak of the trace and when; the allocation sites
alive at the peak (those in use at the snapshot where it has no trace); the segments,
largest first, with the bytes free inside them and their largest free block; and the
trace's out-of-memory event, where it has one.
"""

from __future__ import annotations

import html as markup
from typing import Any

from torchmem.errors import require
from torchmem.records.frames import located
from torchmem.records.run import DeviceRun
from torchmem.records.snapshot import (
    Block,
    DeviceSnapshot,
    Segment,
    SnapshotDiffRecord,
    SnapshotRecord,
)
from torchmem.render import chart
from torchmem.render.kit import (
    Section,
    more,
    page as page_of,
    seconds,
    section_html,
    section_text,
    signed,
    size,
)
from torchmem.render.text import encodable
from torchmem.render.whatif import what_if_section
from torchmem.units import readable_size

TITLE = "torchmem: memory snapshot"
COLOURS = {"active_allocated": "#1f6fb4", "active_pending_free": "#ff7f0e"}
"""Block colours of the segment map; every other state (free) is :data:`FREE_COLOUR`."""
FREE_COLOUR = "#d9d9d9"


def _headline(record: SnapshotRecord) -> str:
    return f"{TITLE} of {record.source}" if record.source else TITLE


def _when(device: DeviceSnapshot) -> str:
    """When the peak was: seconds into the trace, or where the trace has no times its entry
    (``entry 3,697 of 10,307``)."""
    if device.timed or device.peak_entry is None:
        return seconds(device.peak_time)
    return f"entry {device.peak_entry:,} of {device.entries:,}"


def _devices(record: SnapshotRecord) -> Section:
    rows = [
        (
            d.name,
            readable_size(d.allocated_bytes),
            readable_size(d.active_bytes),
            readable_size(d.reserved_bytes),
            size(d.peak_bytes),
            _when(d),
        )
        for d in record.devices.values()
    ]
    header = ("device", "allocated", "active", "reserved", "peak", "at")
    traced = any(d.peak_bytes is not None for d in record.devices.values())
    more = "" if traced else "The snapshot has no trace: no peak."
    return Section("", rows, header=header, more=more)


def _where(file: str, line: int) -> str:
    return located(file, line)


def _sites(device: DeviceSnapshot, top: int) -> Section | None:
    if device.sites_at_peak:
        sites, when = device.sites_at_peak, "alive at the peak"
    elif device.sites:
        sites, when = device.sites, "in use at the snapshot"
    else:
        return None
    rows = [(readable_size(s.bytes), _where(s.file, s.line), s.function) for s in sites[:top]]
    return Section(
        f"Allocation sites {when} on {device.name}:",
        rows,
        left=(1, 2),
        more=more(len(sites) - top, "site"),
        stacks=[s.stacks for s in sites[:top]],
    )


def _segments(device: DeviceSnapshot, top: int) -> Section | None:
    if not device.segments:
        return None
    rows = [
        (
            hex(s.address),
            readable_size(s.total_bytes),
            readable_size(s.active_bytes),
            readable_size(s.free_bytes),
            readable_size(s.largest_free_bytes),
            str(len(s.blocks)),
        )
        for s in device.segments[:top]
    ]
    return Section(
        f"Segments on {device.name}, largest first:",
        rows,
        left=(0,),
        header=("address", "size", "active", "free", "largest free", "blocks"),
        more=more(len(device.segments) - top, "segment"),
    )


def _oom(device: DeviceSnapshot) -> str | None:
    oom = device.oom
    if oom is None:
        return None
    free = ""
    if oom.device_free_bytes is not None:
        free = f"; the device had {readable_size(oom.device_free_bytes)} free"
    when = seconds(oom.time) if device.timed else f"entry {oom.entry:,} of {device.entries:,}"
    return (
        f"Out of memory on {device.name} at {when}: asked for"
        f" {readable_size(oom.requested_bytes)}; the largest free block was"
        f" {readable_size(oom.largest_free_bytes)}{free}."
    )


def _blocks(record: SnapshotRecord, top: int) -> list[Section | str]:
    """The report's parts after the headline: tables, and the OOM lines."""
    parts: list[Section | str] = [_devices(record)] if record.devices else []
    for device in record.devices.values():
        found = [_sites(device, top), _segments(device, top), _oom(device)]
        if device.what_if is not None:
            found.append(what_if_section(device.name, device.what_if))
        parts += [part for part in found if part is not None]
    return parts


def text(record: SnapshotRecord, top: int = 10) -> str:
    """The terminal summary, sizes as :func:`~torchmem.units.readable_size` prints them::

        torchmem: memory snapshot of snapshot.pickle

        device  allocated   active  reserved    peak     at
        0           6.00M    7.00M    12.00M  10.00M  1.50s

        Allocation sites alive at the peak on device 0:
          8.00M  train.py:12  forward
          ...

    Then per device its segments, largest first, and the out-of-memory event of the
    trace, where it has one. `top` limits the sites and segments; a line says how many
    more there were.
    """
    top = max(top, 1)
    blocks = [[_headline(record)]]
    if not record.devices:
        blocks.append(["The snapshot holds no segments and no trace."])
    for part in _blocks(record, top):
        blocks.append([part] if isinstance(part, str) else section_text(part))
    return encodable("\n\n".join("\n".join(block) for block in blocks))


def _timeline_svg(device: DeviceSnapshot) -> str:
    peak = device.peak_bytes if device.peak_bytes is not None else device.active_bytes
    run = DeviceRun(
        device.name,
        device.timeline[0][1] if device.timeline else device.active_bytes,
        peak,
        device.peak_time or 0.0,
        device.active_bytes,
        device.timeline,
    )
    # No hover script on this page: each interval's values show as its SVG title.
    return chart.timeline(run)


def segment_map(device: DeviceSnapshot, top: int = 10, width: int = 720) -> str:
    """An inline SVG (no namespace: for HTML) of the `top` largest segments of `device`:
    one bar each, as long as the segment relative to the largest, its blocks coloured by
    state (:data:`COLOURS`); each block's size and state show as its tooltip."""
    left, bar, gap, head = 80, 14, 6, 26
    segments = device.segments[:top]
    height = head + len(segments) * (bar + gap) + 4
    largest = max((s.total_bytes for s in segments), default=1) or 1
    scale = (width - left - 10) / largest
    title = f"{device.name}: segments, largest first (blue: allocated, orange:"
    title += " freed, pending; grey: free)"
    parts = [
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{markup.escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="8" y="17" font-size="13" font-weight="bold">{markup.escape(title)}</text>',
    ]
    for row, segment in enumerate(segments):
        y = head + row * (bar + gap)
        parts.append(
            f'<text x="{left - 6}" y="{y + bar - 3}" text-anchor="end" fill="#444">'
            f"{readable_size(segment.total_bytes)}</text>"
        )
        parts += [_block_rect(segment, b, left, y, bar, scale) for b in segment.blocks]
        parts.append(
            f'<rect x="{left}" y="{y}" width="{segment.total_bytes * scale:.2f}" '
            f'height="{bar}" fill="none" stroke="#888"/>'
        )
    return "".join(parts) + "</svg>"


def _block_rect(segment: Segment, block: Block, left: int, y: int, bar: int, scale: float) -> str:
    x = left + (block.address - segment.address) * scale
    tip = f"{readable_size(block.bytes)} {block.state} at {hex(block.address)}"
    return (
        f'<rect x="{x:.2f}" y="{y}" width="{block.bytes * scale:.2f}" height="{bar}" '
        f'fill="{COLOURS.get(block.state, FREE_COLOUR)}"><title>{markup.escape(tip)}</title></rect>'
    )


def html(record: SnapshotRecord, top: int = 10) -> str:
    """The summary of :func:`text` as an HTML fragment (Jupyter's ``_repr_html_``): the
    same tables, with per device the timeline of its trace and a :func:`segment_map`.
    A file name that is not UTF-8 comes out escaped (:func:`~torchmem.render.text.encodable`),
    as in each report here."""
    top = max(top, 1)
    parts = [f"<h3>{markup.escape(_headline(record))}</h3>"]
    if not record.devices:
        parts.append("<p>The snapshot holds no segments and no trace.</p>")
    devices = list(record.devices.values())
    for index, part in enumerate(_blocks(record, top)):
        if isinstance(part, str):
            parts.append(f"<p>{markup.escape(part)}</p>")
        else:
            parts.append(section_html(part))
        if index == 0 and devices:
            parts += [_timeline_svg(d) for d in devices if d.timeline and d.timed]
            maps = "".join(segment_map(d, top) for d in devices if d.segments)
            parts.append(f'<div class="torchmem-charts">{maps}</div>')
    return encodable('<div class="torchmem-snapshot">' + "\n".join(parts) + "</div>")


def page(record: SnapshotRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html`: one file that opens offline, with an
    inline style sheet and no scripts, fonts, images or links to fetch."""
    return page_of(_headline(record), html(record, top))


def dataframe(record: SnapshotRecord) -> Any:
    """One row per segment (a row per block would repeat each segment's figures):
    ``device`` (``"cuda:0"``, ``"cpu"``), ``address``, ``total_bytes``,
    ``allocated_bytes``, ``active_bytes``, ``free_bytes``, ``largest_free_bytes``,
    ``blocks`` (how many), ``stream``, ``segment_type``; segments of each device largest
    first. Needs pandas."""
    pd = require("pandas", "a snapshot's DataFrame")
    rows = [(d.name, s) for d in record.devices.values() for s in d.segments]
    segments = [s for _, s in rows]
    sizes = ("total_bytes", "allocated_bytes", "active_bytes", "free_bytes")
    data: dict[str, Any] = {
        "device": [name for name, _ in rows],
        "address": pd.array([s.address for s in segments], dtype="int64"),
    }
    for name in sizes:
        data[name] = pd.array([getattr(s, name) for s in segments], dtype="int64")
    data["largest_free_bytes"] = pd.array([s.largest_free_bytes for s in segments], dtype="int64")
    data["blocks"] = pd.array([len(s.blocks) for s in segments], dtype="int64")
    data["stream"] = pd.array([s.stream for s in segments], dtype="int64")
    data["segment_type"] = [s.segment_type for s in segments]
    return pd.DataFrame(data)


def diff_text(diff: SnapshotDiffRecord, top: int = 10) -> str:
    """How two snapshots differ::

        torchmem: snapshot diff a.pickle -> b.pickle

                   before   after  change
        allocated   6.00M   8.00M  +2.00M
        ...

        Allocation sites that changed most:
          +2.00M  train.py:12  forward  1.00M -> 3.00M

    `top` limits the sites; a line says how many more changed.
    """
    top = max(top, 1)
    names = f"{diff.before or 'before'} -> {diff.after or 'after'}"
    totals = Section(
        "",
        [
            (name, readable_size(b), readable_size(a), signed(a - b))
            for name, (b, a) in diff.totals.items()
        ],
        header=("", "before", "after", "change"),
    )
    blocks = [[f"torchmem: snapshot diff {names}"], section_text(totals)]
    if diff.sites:
        rows = [
            (
                signed(s.change_bytes),
                _where(s.file, s.line),
                s.function,
                f"{readable_size(s.before_bytes)} -> {readable_size(s.after_bytes)}",
            )
            for s in diff.sites[:top]
        ]
        hidden = more(len(diff.sites) - top, "site")
        sites = Section("Allocation sites that changed most:", rows, left=(1, 2), more=hidden)
        blocks.append(section_text(sites))
    else:
        blocks.append(["No allocation site changed."])
    return encodable("\n\n".join("\n".join(block) for block in blocks))
