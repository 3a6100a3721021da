"""A device's timeline as an HTML block around one inline SVG: the bytes in use over
seconds, stacked by category where the record has them (else one line), the peak marked,
the training phases and each ``optimizer.step()`` marked, and each interval's exact values
on hover.

The SVG's own coordinates are the record's units: x in seconds from the recording's start,
y in bytes (counted down from the top of the plot, :attr:`Plot.top_bytes`), stretched to
the page's width; so each layer's height is the exact bytes of its category. Text (axes,
the peak's label, the legend) is HTML beside the SVG, so it keeps its size at any width.
Everything is inline: no fonts, files or addresses. Hover needs :data:`SCRIPT` once on the
page; without it (a notebook that runs no scripts) each interval's ``<title>`` shows the
same values as the browser's own tooltip.
"""

from __future__ import annotations

import html as markup
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchmem.records.run import CATEGORIES, DeviceRun, Phase
from torchmem.render.kit import seconds
from torchmem.units import readable_size

COLOURS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_state": "#59a14f",
    "buffers": "#b07aa1",
    "communication": "#76b7b2",
    "activations": "#e15759",
    "other": "#a0a0a0",
}
"""The fill of each of :data:`~torchmem.records.run.CATEGORIES`."""
LINE = "#1f6fb4"
"""The colour of the one line drawn where a device has no categories."""
PHASE_COLOURS = {"forward": "#9ecae1", "backward": "#fdae6b", "step": "#333333"}
PEAK = "#d62728"
MAX_STEPS = 200
"""More optimizer steps than this are thinned to every n-th, so that the marks stay apart."""
HEIGHT = 200
"""The plot's height in pixels; its width is the page's."""
LANE = 0.035
"""The share of the plot's height, at its top, where forward and backward passes show as
bands (the data reach at most 1/1.08 of the height)."""

SCRIPT = """\
(function () {
  if (window.torchmemHover) return;
  window.torchmemHover = true;
  var shown = null;
  function hide() {
    if (!shown) return;
    shown.tip.hidden = true;
    shown.hit.setAttribute("fill-opacity", "0");
    shown = null;
  }
  document.addEventListener("mousemove", function (e) {
    var hit = e.target.closest ? e.target.closest(".torchmem-hit") : null;
    var chart = hit ? hit.closest(".torchmem-chart") : null;
    var tip = chart ? chart.querySelector(".torchmem-tip") : null;
    if (!tip) { hide(); return; }
    var title = hit.querySelector("title");
    if (title) { hit.setAttribute("data-tip", title.textContent); title.remove(); }
    if (!shown || shown.hit !== hit) {
      hide();
      tip.textContent = hit.getAttribute("data-tip");
      tip.hidden = false;
      hit.setAttribute("fill-opacity", "0.1");
      shown = {hit: hit, tip: tip};
    }
    var box = chart.getBoundingClientRect(), x = e.clientX - box.left;
    var left = x + 14 + tip.offsetWidth > box.width ? x - 14 - tip.offsetWidth : x + 14;
    tip.style.left = Math.max(0, left) + "px";
    tip.style.top = (e.clientY - box.top + 14) + "px";
  });
})();
"""
"""The hover of every chart on a page: include it once, in a ``<script>`` (no address, no
network); it shows an interval's ``<title>`` in the chart's tooltip as the pointer moves."""


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


def _byte_ticks(top: int) -> list[int]:
    """Ticks for 0 to `top` bytes, round in the unit :func:`readable_size` will print."""
    unit = 1
    while top / unit >= 1024 and unit < 1024**5:
        unit *= 1024
    return [math.ceil(tick * unit) for tick in _ticks(max(top, 4) / unit)]


def _escape(value: str) -> str:
    return markup.escape(value, quote=True)


def number(value: float) -> str:
    """`value` as an SVG coordinate that reads back as the same float (no exponent)."""
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    if "e" not in text:
        return text
    return f"{value:.20f}".rstrip("0").rstrip(".") or "0"


def exact(nbytes: int) -> str:
    """``314,572,800 bytes (300.00M)``: the exact count, then as reports round it."""
    return f"{nbytes:,} bytes ({readable_size(nbytes)})"


def _time(value: float, span: float) -> str:
    return f"{value * 1e3:.3f}ms" if span < 0.1 else f"{value:.3f}s"


@dataclass(frozen=True)
class Plot:
    """The SVG's coordinates: x from 0 to :attr:`seconds`, y from 0 (the top) to
    :attr:`top_bytes` (no bytes)."""

    seconds: float
    top_bytes: int

    def y(self, nbytes: int) -> int:
        return self.top_bytes - nbytes

    def left(self, when: float) -> str:
        """The CSS ``left`` of `when`, in percent of the plot's width."""
        return f"{when / self.seconds * 100:.3f}%"

    def top(self, nbytes: int) -> str:
        return f"{self.y(nbytes) / self.top_bytes * 100:.3f}%"


def _intervals(run: DeviceRun) -> list[tuple[float, float, int]]:
    """``(start, end, bytes)`` of each interval of the timeline."""
    found, start = [], 0.0
    for end, nbytes in run.timeline:
        found.append((start, end, nbytes))
        start = end
    return found


def _layers(plot: Plot, run: DeviceRun, rows: Sequence[Sequence[int]]) -> list[str]:
    """One path per category: a rectangle per interval, as high as its bytes there, on top
    of the categories before it."""
    paths: list[list[str]] = [[] for _ in CATEGORIES]
    for (start, end, _), row in zip(_intervals(run), rows, strict=True):
        below, width = 0, number(end - start)
        for index, nbytes in enumerate(row[: len(CATEGORIES)]):
            if nbytes > 0:
                y = plot.y(below + nbytes)
                paths[index].append(f"M{number(start)},{y}h{width}v{nbytes}h-{width}z")
            below += nbytes
    return [
        f'<path class="torchmem-layer" data-category="{name}" fill="{COLOURS[name]}" '
        f'd="{"".join(parts)}"/>'
        for name, parts in zip(CATEGORIES, paths, strict=True)
        if parts
    ]


def _line(plot: Plot, run: DeviceRun) -> list[str]:
    """The fallback: the highest bytes of each interval as one step line, lightly filled."""
    steps = "".join(
        f"H{number(start)}V{plot.y(nbytes)}H{number(end)}" for start, end, nbytes in _intervals(run)
    )
    outline = f"M0,{plot.top_bytes}{steps}"
    return [
        f'<path d="{outline}V{plot.top_bytes}z" fill="{LINE}" fill-opacity="0.12"/>',
        f'<path class="torchmem-line" d="{outline}" fill="none" stroke="{LINE}" '
        'stroke-width="1.5" vector-effect="non-scaling-stroke"/>',
    ]


def _steps(phases: Sequence[Phase]) -> tuple[list[Phase], int]:
    """The optimizer steps to mark and every how many one is marked."""
    steps = [p for p in phases if p.kind == "step"]
    every = max(1, math.ceil(len(steps) / MAX_STEPS))
    return steps[::every], every


def _bands(phases: Sequence[Phase], kind: str, gap: float) -> list[tuple[float, float]]:
    """``(start, end)`` of the phases of `kind`, those less than `gap` seconds apart as one
    (a thousand steps would be a thousand bands narrower than a pixel)."""
    found: list[tuple[float, float]] = []
    for phase in phases:
        if phase.kind != kind:
            continue
        if found and phase.start - found[-1][1] < gap:
            found[-1] = (found[-1][0], max(found[-1][1], phase.end))
        else:
            found.append((phase.start, phase.end))
    return found


def _phases(plot: Plot, phases: Sequence[Phase]) -> list[str]:
    """Forward and backward passes as bands in the lane at the top (those closer than a
    thousandth of the plot's width as one); a thin line across the plot at the start of
    each optimizer step."""
    lane = number(plot.top_bytes * LANE)
    parts = []
    for kind in ("forward", "backward"):
        bands = "".join(
            f"M{number(start)},0h{number(end - start)}v{lane}h-{number(end - start)}z"
            for start, end in _bands(phases, kind, plot.seconds / 1000)
        )
        if bands:
            parts.append(
                f'<path class="torchmem-phase" data-phase="{kind}" '
                f'fill="{PHASE_COLOURS[kind]}" d="{bands}"/>'
            )
    marks = "".join(f"M{number(p.start)},0V{plot.top_bytes}" for p in _steps(phases)[0])
    if marks:
        parts.append(
            f'<path class="torchmem-step" d="{marks}" stroke="{PHASE_COLOURS["step"]}" '
            'stroke-opacity="0.45" stroke-width="1" vector-effect="non-scaling-stroke"/>'
        )
    return parts


def _hover(plot: Plot, run: DeviceRun) -> list[str]:
    """An invisible rectangle per interval whose title gives its values, exact."""
    rows = run.timeline_categories
    parts = []
    for index, (start, end, nbytes) in enumerate(_intervals(run)):
        if end <= start:
            continue
        lines = [
            f"{_time(start, plot.seconds)} to {_time(end, plot.seconds)}",
            f"total: {exact(nbytes)}",
        ]
        if rows is not None:
            lines += [
                f"{name}: {exact(b)}" for name, b in zip(CATEGORIES, rows[index], strict=False)
            ]
        parts.append(
            f'<rect class="torchmem-hit" x="{number(start)}" y="0" width="{number(end - start)}" '
            f'height="{plot.top_bytes}" fill="#000" fill-opacity="0">'
            f"<title>{_escape(chr(10).join(lines))}</title></rect>"
        )
    return parts


def _svg(plot: Plot, run: DeviceRun, phases: Sequence[Phase], label: str, ticks: list[int]) -> str:
    grid = "".join(f"M0,{plot.y(tick)}H{number(plot.seconds)}" for tick in ticks)
    rows = run.timeline_categories
    drawn = _line(plot, run) if rows is None else _layers(plot, run, rows)
    peak = (
        f'<path class="torchmem-peak" d="M{number(run.peak_time)},{plot.top_bytes}'
        f'V{plot.y(run.peak_bytes)}" stroke="{PEAK}" stroke-width="1.5" '
        'stroke-dasharray="4 3" vector-effect="non-scaling-stroke"/>'
    )
    return "".join(
        [
            f'<svg viewBox="0 0 {number(plot.seconds)} {plot.top_bytes}" '
            f'preserveAspectRatio="none" width="100%" height="{HEIGHT}" role="img" '
            f'aria-label="{_escape(label)}" style="display: block; overflow: visible">',
            f"<title>{_escape(label)}</title>",
            f'<path d="{grid}" stroke="#e3e3e3" vector-effect="non-scaling-stroke"/>',
            *_phases(plot, phases),
            *drawn,
            peak,
            *_hover(plot, run),
            f'<path d="M0,0V{plot.top_bytes}H{number(plot.seconds)}" fill="none" '
            'stroke="#888" vector-effect="non-scaling-stroke"/>',
            "</svg>",
        ]
    )


_SMALL = (
    "font-size: 11px; color: #555; white-space: nowrap; position: absolute; pointer-events: none"
)
_TIP = (
    "position: absolute; z-index: 2; pointer-events: none; white-space: pre; "
    "font: 12px ui-monospace, Menlo, Consolas, monospace; background: #fff; color: #222; "
    "border: 1px solid #999; border-radius: 3px; padding: 4px 6px; "
    "box-shadow: 0 1px 4px rgba(0, 0, 0, 0.2)"
)


def _labels(plot: Plot, run: DeviceRun, ticks: list[int]) -> list[str]:
    """The size of each grid line (inside the plot, at its left) and the peak's dot."""
    parts = [
        f'<span style="{_SMALL}; left: 3px; top: {plot.top(tick)}; transform: '
        f"translateY({'0' if tick == ticks[-1] else '-100%'}); "
        f'background: rgba(255, 255, 255, 0.75)">{_escape(readable_size(tick))}</span>'
        for tick in ticks
    ]
    parts.append(
        f'<span class="torchmem-peak-dot" style="position: absolute; '
        f"left: {plot.left(run.peak_time)}; "
        f"top: {plot.top(run.peak_bytes)}; width: 7px; height: 7px; border-radius: 50%; "
        f'background: {PEAK}; transform: translate(-50%, -50%); pointer-events: none"></span>'
    )
    return parts


def _x_axis(plot: Plot) -> str:
    ticks = [t for t in _ticks(plot.seconds) if t <= plot.seconds * (1 + 1e-9)]
    spans = []
    for tick in ticks:
        at = tick / plot.seconds
        shift = "0" if at < 0.02 else ("-100%" if at > 0.98 else "-50%")
        spans.append(
            f'<span style="{_SMALL}; top: 2px; left: {plot.left(tick)}; '
            f'transform: translateX({shift})">{tick:g}s</span>'
        )
    return f'<div style="position: relative; height: 18px">{"".join(spans)}</div>'


def _legend(run: DeviceRun, phases: Sequence[Phase]) -> list[str]:
    def swatch(colour: str, name: str, bar: bool = False) -> str:
        shape = "width: 2px; height: 12px" if bar else "width: 10px; height: 10px"
        return (
            f'<span style="white-space: nowrap"><span style="display: inline-block; {shape}; '
            f'background: {colour}; vertical-align: -1px"></span> {_escape(name)}</span>'
        )

    items = []
    if run.timeline_categories is not None:
        items += [swatch(COLOURS[name], name.replace("_", " ")) for name in CATEGORIES]
    kinds = {p.kind for p in phases}
    items += [swatch(PHASE_COLOURS[k], f"{k} pass") for k in ("forward", "backward") if k in kinds]
    marked, every = _steps(phases)
    if marked:
        items.append(
            swatch(
                PHASE_COLOURS["step"], "optimizer step" + (f" (every {every})" * (every > 1)), True
            )
        )
    return items


def timeline(run: DeviceRun, phases: Sequence[Phase] = (), *, until: float = 0.0) -> str:
    """A device's timeline: an HTML block (inline SVG, no namespace) as wide as the page.

    The bytes in use per interval, stacked by category where :attr:`DeviceRun.timeline_
    categories` has them, else one line; the peak marked with its exact bytes; `phases`
    (the run's forward and backward passes as bands at the top, a line at each optimizer
    step, thinned past :data:`MAX_STEPS`). The time axis reaches at least `until` seconds
    (the run's duration, so that the charts of one run line up). Each interval's values
    show on hover (with :data:`SCRIPT` on the page) or as its SVG ``<title>``."""
    peak = (
        f"peak {readable_size(run.peak_bytes)} at {seconds(run.peak_time)} "
        f"({run.peak_bytes:,} bytes)"
    )
    sampled = " (sampled)" if not run.exact else ""
    what = "by category, " if run.timeline_categories is not None else ""
    title = f"{run.device}: bytes in use, {what}highest per interval{sampled}"
    # The peak's label is in the legend, where it wraps with it: in the plot it would
    # leave a narrow window.
    mark = (
        f'<span class="torchmem-peak-label" style="color: {PEAK}; font-weight: 600; '
        f'white-space: nowrap">{_escape(peak)}</span>'
        if run.timeline
        else ""
    )
    head = (
        '<div style="display: flex; flex-wrap: wrap; gap: 2px 14px; align-items: baseline; '
        f'font-size: 12px; margin: 0 0 6px"><b style="font-size: 13px">{_escape(title)}</b>'
        f"{mark}{''.join(_legend(run, phases))}</div>"
    )
    block = (
        '<div class="torchmem-chart" style="position: relative; margin: 10px 0 14px; '
        f'font-family: system-ui, sans-serif" data-device="{_escape(run.device)}">{head}'
    )
    if not run.timeline:
        return f'{block}<p style="color: #666">No timeline was recorded; {_escape(peak)}</p></div>'
    y_ticks = _byte_ticks(math.ceil(max(run.peak_bytes, *(b for _, b in run.timeline)) * 1.08))
    t_max = max(until, run.peak_time, *(t for t, _ in run.timeline))
    plot = Plot(t_max if t_max > 0 else 1.0, max(y_ticks[-1], 1))
    label = f"{title}, {peak}"
    return (
        f'{block}<div style="position: relative">{_svg(plot, run, phases, label, y_ticks)}'
        f"{''.join(_labels(plot, run, y_ticks))}</div>{_x_axis(plot)}"
        f'<div class="torchmem-tip" hidden="" style="{_TIP}"></div></div>'
    )
