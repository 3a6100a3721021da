"""Where a run's memory went: a terminal summary, an SVG timeline, HTML for Jupyter, a
self-contained HTML page, and pandas.

Every renderer reads a :class:`~torchmem.records.run.RunRecord` (``torchmem run``,
``torchmem.record()``) and shows the same things: per device the bytes in use at the start,
the peak (and when), and the end; for each device that has an event log what the bytes
were (:data:`~torchmem.records.run.CATEGORIES`) at the peak and at the end; for the main
device the source lines and the largest allocations alive at the peak, and the highest
memory in use while each module ran; and the notes on what the recording could not see.
"""

from __future__ import annotations

import html as markup
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchmem.errors import require
from torchmem.records.frames import Stack
from torchmem.records.run import CATEGORIES, DeviceRun, Held, ModulePeak, RunRecord, Site
from torchmem.render.text import encodable, table
from torchmem.units import readable_size

TITLE = "torchmem: where the memory went"
MISSING = "-"
"""What a cell shows where the record has no value."""
SAMPLED = "~"
"""Marks a peak that comes from sampling (the true peak may be higher)."""

STYLE = """\
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 24px; max-width: 1000px; }
h3 { margin: 0 0 4px; }
h4 { margin: 18px 0 4px; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { padding: 2px 10px; text-align: right; font-variant-numeric: tabular-nums; }
th { border-bottom: 1px solid #999; }
tbody tr:nth-child(even) { background: #f3f4f6; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; }
.torchmem-charts { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0; }
.torchmem-charts svg { border: 1px solid #ddd; background: #fff; }
"""
"""The page's only style sheet (inline, no fonts or files fetched)."""

_LEFT = ' style="text-align: left"'


@dataclass(frozen=True)
class Section:
    """One block of the report: a title, a table, and a line on what was left out."""

    title: str
    rows: Sequence[tuple[str, ...]]
    left: tuple[int, ...] = (0,)
    header: tuple[str, ...] | None = None
    more: str = ""
    stacks: Sequence[Stack] = ()
    """Per row, the stack of the site in its second cell: HTML shows it on demand (a
    ``<details>`` in that cell); text leaves it out."""


def _seconds(value: float) -> str:
    return f"{value:.2f}s"


def _headline(record: RunRecord) -> str:
    exit_code = "" if record.exit_code is None else f", exit code {record.exit_code}"
    return f"{TITLE} ({_seconds(record.duration)}{exit_code})"


def _devices(record: RunRecord) -> Section:
    runs = list(record.devices.values())
    reserved = any(run.reserved_peak_bytes is not None for run in runs)
    header: tuple[str, ...] = ("device", "start", "peak", "at", "end")
    rows = []
    for run in runs:
        mark = "" if run.exact else SAMPLED
        row: tuple[str, ...] = (
            run.device,
            readable_size(run.start_bytes),
            mark + readable_size(run.peak_bytes),
            _seconds(run.peak_time),
            readable_size(run.end_bytes),
        )
        if reserved:
            size = run.reserved_peak_bytes
            row += (MISSING if size is None else readable_size(size),)
        rows.append(row)
    if reserved:
        header += ("reserved peak",)
    more = ""
    if not all(run.exact for run in runs):
        more = f"{SAMPLED} sampled, not exact: the true peak may be higher."
    return Section("", rows, header=header, more=more)


def _categories(run: DeviceRun) -> Section | None:
    at_peak = run.categories_at_peak
    if at_peak is None:
        return None
    at_end = run.categories_at_end
    names = list(CATEGORIES) + [n for n in [*at_peak, *(at_end or ())] if n not in CATEGORIES]
    rows = [
        (name, _size_or_missing(at_peak.get(name)))
        + (() if at_end is None else (_size_or_missing(at_end.get(name)),))
        for name in dict.fromkeys(names)
    ]
    header = ("category", "at the peak") + (() if at_end is None else ("at the end",))
    return Section(f"What the memory on {run.device} was:", rows, header=header)


def _size_or_missing(size: int | None) -> str:
    return MISSING if size is None else readable_size(size)


def _site(site: Site) -> str:
    return f"{site.file}:{site.line}" if site.line else site.file


def _more(count: int, what: str, size: int | None = None) -> str:
    """``... and 3 more sites (1.50M)``; `what` is the singular, made plural with an s."""
    if count <= 0:
        return ""
    rest = "" if size is None else f" ({readable_size(size)})"
    return f"... and {count} more {what}{'' if count == 1 else 's'}{rest}"


def _sites(run: DeviceRun, top: int) -> Section | None:
    if not run.sites_at_peak:
        return None
    shown, hidden = run.sites_at_peak[:top], run.sites_at_peak[top:]
    rows = [(readable_size(s.bytes), _site(s), s.function) for s in shown]
    return Section(
        f"Allocation sites alive at the peak on {run.device}:",
        rows,
        left=(1, 2),
        more=_more(len(hidden), "site", sum(s.bytes for s in hidden)),
        stacks=[s.stack for s in shown],
    )


def _shape(held: Held) -> str:
    return MISSING if held.shape is None else str(tuple(held.shape))


def _largest(run: DeviceRun, top: int) -> Section | None:
    if not run.largest_at_peak:
        return None
    shown, hidden = run.largest_at_peak[:top], run.largest_at_peak[top:]
    count, size = run.others_at_peak
    count, size = count + len(hidden), size + sum(h.bytes for h in hidden)
    rows = [
        (
            readable_size(h.bytes),
            h.name,
            h.category,
            _shape(h),
            h.dtype or MISSING,
            h.site or MISSING,
        )
        for h in shown
    ]
    return Section(
        f"Largest allocations alive at the peak on {run.device}:",
        rows,
        left=(1, 2, 3, 4, 5),
        more=_more(count, "allocation", size),
    )


def _highest(module: ModulePeak) -> int:
    return max(module.forward_peak_bytes, module.backward_peak_bytes or 0)


def _modules(modules: Sequence[ModulePeak], top: int) -> Section | None:
    """In the order of first call; the `top` highest, highest first, where cut."""
    if not modules:
        return None
    shown = list(modules)
    if len(shown) > top:
        shown = sorted(shown, key=_highest, reverse=True)[:top]
    rows = [
        (
            m.name or "(top)",
            m.type,
            readable_size(m.forward_peak_bytes),
            _size_or_missing(m.backward_peak_bytes),
            str(m.calls),
        )
        for m in shown
    ]
    devices = ", ".join(dict.fromkeys(m.device for m in modules))
    return Section(
        f"Modules: highest memory in use on {devices} while each ran:",
        rows,
        left=(0, 1),
        header=("module", "type", "forward", "backward", "calls"),
        more=_more(len(modules) - len(shown), "module"),
    )


def _sections(record: RunRecord, top: int) -> list[Section]:
    """The report's blocks after the headline, in order; those with nothing to show left out."""
    top = max(top, 0)
    found: list[Section | None] = []
    main = record.devices.get(record.main_device)
    if record.devices:
        found.append(_devices(record))
    if main is not None:
        found.append(_categories(main))
    found += [_categories(run) for name, run in record.devices.items() if run is not main]
    if main is not None:
        found += [_sites(main, top), _largest(main, top)]
    found.append(_modules(record.modules, top))
    return [section for section in found if section is not None]


def _details(run: DeviceRun, modules: Sequence[ModulePeak], top: int) -> list[Section]:
    found = [_categories(run), _sites(run, top), _largest(run, top), _modules(modules, top)]
    return [section for section in found if section is not None]


def details_text(run: DeviceRun, modules: Sequence[ModulePeak], top: int = 10) -> list[str]:
    """One device's blocks of :func:`text` (categories, sites, largest allocations,
    modules), each a string of lines, for other reports built on the same records."""
    return ["\n".join(section_text(s)) for s in _details(run, modules, max(top, 0))]


def details_html(run: DeviceRun, modules: Sequence[ModulePeak], top: int = 10) -> str:
    """The blocks of :func:`details_text` as HTML, as :func:`html` shows them."""
    return "".join(section_html(s) for s in _details(run, modules, max(top, 0)))


def section_text(section: Section) -> list[str]:
    """`section` as lines of text: its title, then its table indented under it."""
    indent = "  " if section.title else ""
    lines = [section.title] if section.title else []
    rows = ([section.header] if section.header else []) + list(section.rows)
    lines += [indent + line for line in table(rows, left=section.left)]
    if section.more:
        lines.append(indent + section.more)
    return lines


def text(record: RunRecord, top: int = 10) -> str:
    """The terminal summary, sizes as :func:`~torchmem.units.readable_size` prints them::

        torchmem: where the memory went (12.30s, exit code 0)

        device    start     peak     at     end
        cpu       1.00M  300.00M  2.41s  40.00M

        What the memory on cpu was:
          category         at the peak  at the end
          parameters             8.00M       8.00M
          ...

    Then the allocation sites and the largest allocations alive at the peak of the main
    device, and the modules. `top` limits each of these three lists (the modules then
    shown are those whose forward or backward peak was highest); a line says how many
    more there were. A missing value shows as ``-``, a sampled peak is marked ``~``.
    """
    blocks = [[_headline(record)]]
    if record.command:
        blocks[0].append(f"command: {shlex.join(record.command)}")
    if not record.devices:
        blocks.append(["No device was recorded."])
    blocks += [section_text(section) for section in _sections(record, top)]
    if record.notes:
        blocks.append(["Notes:"] + [f"  - {note}" for note in record.notes])
    return "\n\n".join("\n".join(block) for block in blocks)


# -- SVG ---------------------------------------------------------------------------------


def _ticks(top: float) -> list[float]:
    """0 and then 3 or 4 equal steps of 1, 2, 2.5 or 5 times a power of ten, the last at
    or above `top` (which must be positive)."""
    power = math.floor(math.log10(top)) - 1
    while True:
        for multiple in (1.0, 2.0, 2.5, 5.0):
            step = multiple * 10.0**power
            count = math.ceil(top / step - 1e-9)
            if count <= 4:
                return [i * step for i in range(count + 1)]
        power += 1


def _byte_ticks(top: int) -> list[float]:
    """Ticks for 0 to `top` bytes, round in the unit :func:`readable_size` will print."""
    unit = 1.0
    while top / unit >= 1024 and unit < 1024.0**5:
        unit *= 1024
    return [tick * unit for tick in _ticks(max(top, 4) / unit)]


def _escape(value: str) -> str:
    return markup.escape(value, quote=True)


def _svg(run: DeviceRun, width: int, height: int, standalone: bool, until: float = 0.0) -> str:
    """The chart; its time axis reaches at least `until` seconds (the run's duration, so
    that the charts of one run line up)."""
    left, right, top, bottom = 70, 16, 30, 26
    plot_w, plot_h = max(width - left - right, 1), max(height - top - bottom, 1)
    peak = f"peak {readable_size(run.peak_bytes)} at {_seconds(run.peak_time)}"
    sampled = " (sampled)" if not run.exact else ""
    title = f"{run.device}: highest bytes in use per interval{sampled}"
    xmlns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    parts = [
        f'<svg{xmlns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{_escape(f"{title}, {peak}")}" '
        'font-family="sans-serif" font-size="11">',
        f"<title>{_escape(f'{title}, {peak}')}</title>",
        f'<text x="8" y="17" font-size="13" font-weight="bold">{_escape(title)}</text>',
    ]
    if not run.timeline:
        parts.append(
            f'<text x="{width / 2:.1f}" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
            f'fill="#666">No timeline was recorded; {_escape(peak)}</text>'
        )
        return "".join(parts) + "</svg>"
    highest = max(run.peak_bytes, *(b for _, b in run.timeline))
    y_ticks = _byte_ticks(math.ceil(highest * 1.08))
    y_max = y_ticks[-1]
    t_max = max(until, run.peak_time, *(t for t, _ in run.timeline))
    t_max = t_max if t_max > 0 else 1.0
    x_ticks = [t for t in _ticks(t_max) if t <= t_max * (1 + 1e-9)]

    def x(seconds: float) -> float:
        return left + seconds / t_max * plot_w

    def y(size: float) -> float:
        return top + plot_h - size / y_max * plot_h

    for tick in y_ticks:
        parts.append(
            f'<line x1="{left}" y1="{y(tick):.1f}" x2="{left + plot_w}" y2="{y(tick):.1f}" '
            'stroke="#e3e3e3"/>'
            f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" fill="#444">'
            f"{_escape(readable_size(tick))}</text>"
        )
    for tick in x_ticks:
        parts.append(
            f'<line x1="{x(tick):.1f}" y1="{top + plot_h}" x2="{x(tick):.1f}" '
            f'y2="{top + plot_h + 4}" stroke="#888"/>'
            f'<text x="{x(tick):.1f}" y="{top + plot_h + 16}" text-anchor="middle" '
            f'fill="#444">{tick:g}s</text>'
        )
    parts.append(
        f'<path d="M{left},{top}V{top + plot_h}H{left + plot_w}" fill="none" stroke="#888"/>'
    )
    points, start = [], 0.0
    for end, size in run.timeline:
        points += [f"{x(start):.1f},{y(size):.1f}", f"{x(end):.1f},{y(size):.1f}"]
        start = end
    parts.append(
        f'<polyline points="{" ".join(points)}" fill="none" stroke="#1f6fb4" '
        'stroke-width="1.5" stroke-linejoin="round"/>'
    )
    px, py = x(run.peak_time), y(run.peak_bytes)
    anchor, dx = ("end", -7) if px > left + plot_w * 0.6 else ("start", 7)
    parts.append(
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="#d62728"/>'
        f'<text x="{px + dx:.1f}" y="{max(py - 6, top - 2):.1f}" text-anchor="{anchor}" '
        f'fill="#d62728">{_escape(peak)}</text>'
    )
    return "".join(parts) + "</svg>"


def svg(run: DeviceRun, width: int = 720, height: int = 180, *, inline: bool = False) -> str:
    """A standalone SVG chart of a device's timeline: bytes in use over seconds, each
    interval's exact peak drawn as a step, the run's peak marked with a dot and labelled.

    Pure markup, no scripts, fonts or files fetched; `width` and `height` in pixels.
    `inline` leaves out the SVG namespace, which a chart inside an HTML page does not need.
    """
    return _svg(run, width, height, standalone=not inline)


# -- HTML --------------------------------------------------------------------------------


def _cell(tag: str, value: str, left: bool) -> str:
    return f"<{tag}{_LEFT if left else ''}>{markup.escape(value)}</{tag}>"


def _stack_cell(value: str, stack: Stack) -> str:
    """A site's cell whose stack opens on a click: no script, a ``<details>``."""
    frames = "".join(
        f"<li><code>{markup.escape(f'{file}:{line}')}</code> {markup.escape(function)}</li>"
        for file, line, function in stack
    )
    return (
        f"<td{_LEFT}><details><summary>{markup.escape(value)}</summary>"
        f'<ol style="margin: 2px 0; text-align: left">{frames}</ol></details></td>'
    )


def section_html(section: Section) -> str:
    """`section` as HTML: an ``<h4>`` title, a table, and a paragraph on what was left out.
    A row's stack, where it has one, opens under its site on a click."""

    def row(cells: tuple[str, ...], tag: str, stack: Stack = ()) -> str:
        inner = "".join(
            _stack_cell(c, stack) if i == 1 and stack else _cell(tag, c, i in section.left)
            for i, c in enumerate(cells)
        )
        return f"<tr>{inner}</tr>"

    title = f"<h4>{markup.escape(section.title)}</h4>" if section.title else ""
    head = f"<thead>{row(section.header, 'th')}</thead>" if section.header else ""
    stacks = list(section.stacks) or [()] * len(section.rows)
    body = "".join(
        row(cells, "td", stack) for cells, stack in zip(section.rows, stacks, strict=True)
    )
    more = f"<p>{markup.escape(section.more)}</p>" if section.more else ""
    table = f'<table style="border-collapse: collapse">{head}<tbody>{body}</tbody></table>'
    return f"{title}{table}{more}"


def html(record: RunRecord, top: int = 10) -> str:
    """The summary of :func:`text` as an HTML fragment (Jupyter's ``_repr_html_``): the
    same tables, and after the devices one :func:`svg` timeline per device."""
    parts = [f"<h3>{markup.escape(_headline(record))}</h3>"]
    if record.command:
        parts.append(f"<p>command: <code>{markup.escape(shlex.join(record.command))}</code></p>")
    if not record.devices:
        parts.append("<p>No device was recorded.</p>")
    for index, section in enumerate(_sections(record, top)):
        parts.append(section_html(section))
        if index == 0 and record.devices:
            charts = "".join(
                _svg(run, 720, 180, False, record.duration) for run in record.devices.values()
            )
            parts.append(f'<div class="torchmem-charts">{charts}</div>')
    if record.notes:
        items = "".join(f"<li>{markup.escape(note)}</li>" for note in record.notes)
        parts.append(f"<h4>Notes</h4><ul>{items}</ul>")
    return '<div class="torchmem-run">' + "\n".join(parts) + "</div>"


def page(record: RunRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html`: one file that opens offline, with an
    inline style sheet and no scripts, fonts, images or links to fetch."""
    name = f"{TITLE}: {shlex.join(record.command)}" if record.command else TITLE
    return encodable(  # a script in a folder whose name is not UTF-8
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>\n'
        f"<title>{markup.escape(name)}</title>\n<style>\n{STYLE}</style>\n</head>\n"
        f"<body>\n{html(record, top)}\n</body>\n</html>\n"
    )


def dataframe(record: RunRecord) -> Any:
    """One row per device: ``device``, ``start_bytes``, ``peak_bytes``, ``peak_time``
    (seconds), ``end_bytes``, then ``<category>_at_peak`` in bytes for each of
    :data:`~torchmem.records.run.CATEGORIES` (empty where the device has no event log).
    Needs pandas."""
    pd = require("pandas", "a run's DataFrame")
    names = list(CATEGORIES)
    for run in record.devices.values():
        names += [n for n in run.categories_at_peak or {} if n not in names]
    columns = ["device", "start_bytes", "peak_bytes", "peak_time", "end_bytes"]
    columns += [f"{name}_at_peak" for name in names]
    runs = list(record.devices.values())
    data: dict[str, Any] = {
        "device": [run.device for run in runs],
        "start_bytes": pd.array([run.start_bytes for run in runs], dtype="int64"),
        "peak_bytes": pd.array([run.peak_bytes for run in runs], dtype="int64"),
        "peak_time": pd.array([run.peak_time for run in runs], dtype="float64"),
        "end_bytes": pd.array([run.end_bytes for run in runs], dtype="int64"),
    }
    for name in names:
        sizes = [(run.categories_at_peak or {}).get(name) for run in runs]
        data[f"{name}_at_peak"] = pd.array(sizes, dtype="Int64")
    return pd.DataFrame(data, columns=columns)
