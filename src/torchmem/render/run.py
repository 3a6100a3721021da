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
import shlex
import shutil
from collections.abc import Sequence
from typing import Any

from torchmem.errors import require
from torchmem.records.frames import located
from torchmem.records.run import (
    CATEGORIES,
    DeviceRun,
    Growth,
    Held,
    HeldGraph,
    ModulePeak,
    RunRecord,
    Site,
    Step,
)
from torchmem.render import chart, icicle, workers
from torchmem.render.kit import (
    MISSING,
    SAMPLED,
    Section,
    more,
    page as page_of,
    seconds,
    section_html,
    section_text,
    signed,
    size,
)
from torchmem.render.whatif import what_if_section
from torchmem.units import readable_size

TITLE = "torchmem: where the memory went"
GROWTH_BREAK = "\n  "
"""What separates the growth's lines under the steps' table (a line break in HTML)."""
SOURCE = 24
"""The fewest characters of a site's line the text report shows, however narrow the
terminal."""


def _headline(record: RunRecord) -> str:
    exit_code = "" if record.exit_code is None else f", exit code {record.exit_code}"
    return f"{TITLE} ({seconds(record.duration)}{exit_code})"


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
            seconds(run.peak_time),
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
        (name, size(at_peak.get(name))) + (() if at_end is None else (size(at_end.get(name)),))
        for name in dict.fromkeys(names)
        if name != "communication" or at_peak.get(name) or (at_end or {}).get(name)
    ]  # communication only where there was some: sharded training's
    header = ("category", "at the peak") + (() if at_end is None else ("at the end",))
    return Section(f"What the memory on {run.device} was:", rows, header=header)


def _site(site: Site) -> str:
    return located(site.file, site.line)


def _source(site: Site) -> str:
    """The text of the site's line: the record's, else read now; empty where none."""
    return site.source or icicle.source_line(site.file, site.line) or ""


def _clip(text: str, room: int) -> str:
    return text if len(text) <= room else text[: room - 3].rstrip() + "..."


def _sites(run: DeviceRun, top: int, width: int | None = None) -> Section | None:
    """The sites alive at the peak, each with the text of its line: cut to end within
    `width` characters (at least :data:`SOURCE` of it shown); whole where None."""
    if not run.sites_at_peak:
        return None
    shown, hidden = run.sites_at_peak[:top], run.sites_at_peak[top:]
    rows = [(readable_size(s.bytes), _site(s), s.function, _source(s)) for s in shown]
    if width is not None and rows:
        before = 2 + sum(max(len(row[i]) for row in rows) + 2 for i in range(3))
        room = max(width - before, SOURCE)
        rows = [(*row[:3], _clip(row[3], room)) for row in rows]
    return Section(
        f"Allocation sites alive at the peak on {run.device}:",
        rows,
        left=(1, 2, 3),
        more=more(len(hidden), "site", sum(s.bytes for s in hidden)),
        stacks=[s.stacks for s in shown],
        code=(3,),
    )


def _step_row(label: str, steps: Sequence[Step], ram: bool) -> tuple[str, ...]:
    peak = max(step.peak_bytes for step in steps)
    ends = (steps[0].start_bytes, peak, steps[-1].end_bytes)
    row = (label, *(readable_size(value) for value in ends))
    return (*row, size(steps[-1].ram_bytes)) if ram else row


def _steps(record: RunRecord, run: DeviceRun) -> Section | None:
    """The first step, then the others together (their first start, highest peak, last
    end, and the process's RSS at the end, where it was read); and the growth, where
    there is one."""
    if not run.steps:
        return None
    first, rest = run.steps[0], run.steps[1:]
    ram = any(step.ram_bytes is not None for step in run.steps)
    rows = [_step_row("0 (first)", [first], ram)]
    if rest:
        last = rest[-1].index + rest[-1].count - 1
        rows.append(_step_row(f"1 to {last}" if last > 1 else "1", rest, ram))
    return Section(
        f"Steps on {run.device} (each ends where {_ends(record.steps_by)}):",
        rows,
        header=("steps", "start", "peak", "end") + (("ram at end",) if ram else ()),
        more=GROWTH_BREAK.join(growth_lines(run.growth)) if run.growth else "",
    )


def _ends(by: str | None) -> str:
    if by == "optimizer.step()":
        return "optimizer.step() returns"
    if by == "backward":
        return "a backward pass ends"
    return "a forward call of the outermost module returns"


def growth_lines(growth: Growth) -> list[str]:
    """The growth in words: one line for the rise (of the tensors, and of the process's
    RAM), then one per line of code whose allocations outlive their step (what each step
    leaves, where, and why), then one per variable that keeps autograd graphs of every
    step (and how to stop it)."""
    ram = (
        ""
        if growth.ram_bytes_per_step is None
        else f"RAM {signed(growth.ram_bytes_per_step)} per step"
    )
    if growth.bytes_per_step or growth.sites:
        exactly = f", exactly at each of {growth.steps} steps" if growth.exact else ""
        lines = [
            f"{growth.device} grows {readable_size(growth.bytes_per_step)} per step from step"
            f" {growth.first_step}{exactly}{f' ({ram})' if ram else ''}:"
        ]
    else:
        over = f"from step {growth.first_step}, over {growth.steps} steps"
        lines = [
            f"{growth.device} tensors do not grow, autograd graphs of every step do"
            f" ({f'{ram} ' if ram else ''}{over}):"
        ]
    for site in growth.sites:
        code = f" (`{site.source}`)" if site.source else ""
        why = f", {site.reason}" if site.reason else ""
        lines.append(
            f"  {readable_size(site.bytes_per_step)} each step from"
            f" {located(site.file, site.line)}{code}{why}"
        )
    if growth.bytes_per_step and not growth.sites:
        lines.append("  (no line of code's allocations outlive their step: freed later)")
    lines += [f"  {graph_words(graph)}" for graph in growth.graphs]
    return lines


def graph_words(graph: HeldGraph) -> str:
    """What a variable does with the autograd graphs it keeps, and how to stop it."""
    least = "" if graph.complete else "at least "
    count = f"{least}{graph.steps:,} steps ({least}{graph.nodes:,} nodes)"
    if graph.chained:
        return (
            f"{graph.holder} chains each step's autograd graph to the one before: it keeps"
            f" the graphs of {count}; detach it each step (`.detach()`, or `.item()` for"
            " a number)"
        )
    return (
        f"{graph.holder} keeps an autograd graph of each of {count}; keep what it holds"
        " detached (`.detach()`, or `.item()` for a number)"
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
        more=more(count, "allocation", size),
    )


def _modules(modules: Sequence[ModulePeak], top: int) -> Section | None:
    """The `top` modules whose forward kept the most, most first (ties in the order of
    first call); each with the rise of its backward. Absolute peaks stay in the JSON."""
    if not modules:
        return None
    shown = sorted(modules, key=lambda m: m.forward_kept_bytes, reverse=True)[:top]
    rows = [
        (
            m.name or "(top)",
            m.type,
            readable_size(m.forward_kept_bytes),
            size(m.backward_rise_bytes),
            str(m.calls),
        )
        for m in shown
    ]
    devices = ", ".join(dict.fromkeys(m.device for m in modules))
    return Section(
        f"Modules on {devices}: what a forward call added and kept, how far a backward rose:",
        rows,
        left=(0, 1),
        header=("module", "type", "forward kept", "backward rise", "calls"),
        more=more(len(modules) - len(shown), "module"),
    )


def _sections(record: RunRecord, top: int, width: int | None = None) -> list[Section]:
    """The report's blocks after the headline, in order; those with nothing to show left out."""
    top = max(top, 0)
    found: list[Section | None] = []
    main = record.devices.get(record.main_device)
    if record.devices:
        found.append(_devices(record))
    found.append(workers.section(record.workers, top))
    found += [_steps(record, run) for run in record.devices.values()]
    if main is not None:
        found.append(_categories(main))
    found += [_categories(run) for name, run in record.devices.items() if run is not main]
    if main is not None:
        found += [_sites(main, top, width), _largest(main, top)]
    found += [what_if_section(n, r.what_if) for n, r in record.devices.items() if r.what_if]
    found.append(_modules(record.modules, top))
    return [section for section in found if section is not None]


def _details(
    run: DeviceRun, modules: Sequence[ModulePeak], top: int, width: int | None = None
) -> list[Section]:
    found = [
        _categories(run),
        _sites(run, top, width),
        _largest(run, top),
        _modules(modules, top),
    ]
    return [section for section in found if section is not None]


def terminal_width() -> int:
    """The terminal's width in characters (100 where there is none)."""
    return shutil.get_terminal_size((100, 24)).columns


def details_text(
    run: DeviceRun, modules: Sequence[ModulePeak], top: int = 10, width: int | None = None
) -> list[str]:
    """One device's blocks of :func:`text` (categories, sites, largest allocations,
    modules), each a string of lines, for other reports built on the same records; the
    sites' lines cut to end within `width` characters, whole where None (a failing test's
    explanation, whose lines pytest's own wrap)."""
    sections = _details(run, modules, max(top, 0), width)
    return ["\n".join(section_text(s)) for s in sections]


def stacks_html(run: DeviceRun) -> str:
    """The icicle of `run`'s stacks alive at the peak, under a title; empty where none."""
    drawn = icicle.html(run)
    if not drawn:
        return ""
    title = f"Stacks alive at the peak on {run.device} (width: bytes; hover a box for its line):"
    return f"<h4>{markup.escape(title)}</h4>{drawn}"


def details_html(run: DeviceRun, modules: Sequence[ModulePeak], top: int = 10) -> str:
    """The blocks of :func:`details_text` as HTML, as :func:`html` shows them, the stacks
    at the peak after the sites."""
    parts = []
    for section in _details(run, modules, max(top, 0)):
        parts.append(section_html(section))
        if section.title.startswith("Allocation sites"):
            parts.append(stacks_html(run))
    return "".join(parts)


def text(record: RunRecord, top: int = 10, width: int | None = None) -> str:
    """The terminal summary, sizes as :func:`~torchmem.units.readable_size` prints them::

        torchmem: where the memory went (12.30s, exit code 0)

        device    start     peak     at     end
        cpu       1.00M  300.00M  2.41s  40.00M

        What the memory on cpu was:
          category         at the peak  at the end
          parameters             8.00M       8.00M
          ...

    Then the allocation sites alive at the peak of the main device, each with the text of
    its line (cut to end within `width` characters, the terminal's width where None), the
    largest allocations alive then, and the modules by what their forward kept. `top`
    limits each of these three lists; a line says how many more there were. A missing
    value shows as ``-``, a sampled peak is marked ``~``.
    """
    blocks = [[_headline(record)]]
    if record.command:
        blocks[0].append(f"command: {shlex.join(record.command)}")
    if not record.devices:
        blocks.append(["No device was recorded."])
    width = terminal_width() if width is None else width
    blocks += [section_text(section) for section in _sections(record, top, width)]
    if record.notes:
        blocks.append(["Notes:"] + [f"  - {note}" for note in record.notes])
    return "\n\n".join("\n".join(block) for block in blocks)


def html(record: RunRecord, top: int = 10, hover: bool = True) -> str:
    """The summary of :func:`text` as an HTML fragment (Jupyter's ``_repr_html_``): the
    same tables; after the devices one :func:`~torchmem.render.chart.timeline` per device
    (by category, with the run's phases; hover for an interval's values); after the sites
    the stacks alive at the peak (:mod:`~torchmem.render.icicle`). `hover` adds the
    charts' script (:data:`~torchmem.render.chart.SCRIPT`); a page of several runs adds
    it once itself."""
    parts = [f"<h3>{markup.escape(_headline(record))}</h3>"]
    if record.command:
        parts.append(f"<p>command: <code>{markup.escape(shlex.join(record.command))}</code></p>")
    if not record.devices:
        parts.append("<p>No device was recorded.</p>")
    main = record.devices.get(record.main_device)
    for index, section in enumerate(_sections(record, top)):
        drawn = section_html(section)
        if section.title.startswith("Steps on"):  # the growth's lines stay lines
            drawn = drawn.replace(GROWTH_BREAK, "<br>")
        parts.append(drawn)
        if index == 0 and record.devices:
            parts += [
                chart.timeline(run, record.phases, until=record.duration)
                for run in record.devices.values()
            ]
        if main is not None and section.title.startswith("Allocation sites"):
            parts.append(stacks_html(main))
    if record.notes:
        items = "".join(f"<li>{markup.escape(note)}</li>" for note in record.notes)
        parts.append(f"<h4>Notes</h4><ul>{items}</ul>")
    if hover and any(run.timeline for run in record.devices.values()):  # a chart to hover
        parts.append(f"<script>\n{chart.SCRIPT}</script>")
    return '<div class="torchmem-run">' + "\n".join(parts) + "</div>"


def page(record: RunRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html`: one file that opens offline, with an
    inline style sheet and one inline script (the charts' hover), and no fonts, images or
    links to fetch."""
    name = f"{TITLE}: {shlex.join(record.command)}" if record.command else TITLE
    return page_of(name, html(record, top))


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
