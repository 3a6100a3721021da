"""A device's timeline as an SVG chart: bytes in use over seconds, each interval's exact
peak drawn as a step, the peak marked. Pure markup: no scripts, fonts or files fetched."""

from __future__ import annotations

import html as markup
import math
from dataclasses import dataclass

from torchmem.records.run import DeviceRun
from torchmem.render.kit import seconds
from torchmem.units import readable_size

_MARGIN = (70, 16, 30, 26)
"""Left, right, top and bottom margins around the plot, in pixels."""


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


@dataclass(frozen=True)
class _Plot:
    """Where bytes and seconds fall on the chart, in pixels."""

    left: int
    top: int
    width: int
    height: int
    t_max: float
    y_max: float

    def x(self, when: float) -> float:
        return self.left + when / self.t_max * self.width

    def y(self, nbytes: float) -> float:
        return self.top + self.height - nbytes / self.y_max * self.height


def _axes(plot: _Plot, y_ticks: list[float], x_ticks: list[float]) -> list[str]:
    parts = []
    right, bottom = plot.left + plot.width, plot.top + plot.height
    for tick in y_ticks:
        y = plot.y(tick)
        parts.append(
            f'<line x1="{plot.left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e3e3e3"/>'
            f'<text x="{plot.left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#444">'
            f"{_escape(readable_size(tick))}</text>"
        )
    for tick in x_ticks:
        x = plot.x(tick)
        parts.append(
            f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#888"/>'
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" '
            f'fill="#444">{tick:g}s</text>'
        )
    parts.append(f'<path d="M{plot.left},{plot.top}V{bottom}H{right}" fill="none" stroke="#888"/>')
    return parts


def _steps(plot: _Plot, run: DeviceRun) -> str:
    points, start = [], 0.0
    for end, nbytes in run.timeline:
        points += [f"{plot.x(start):.1f},{plot.y(nbytes):.1f}"]
        points += [f"{plot.x(end):.1f},{plot.y(nbytes):.1f}"]
        start = end
    return (
        f'<polyline points="{" ".join(points)}" fill="none" stroke="#1f6fb4" '
        'stroke-width="1.5" stroke-linejoin="round"/>'
    )


def _peak_mark(plot: _Plot, run: DeviceRun, label: str) -> str:
    px, py = plot.x(run.peak_time), plot.y(run.peak_bytes)
    anchor, dx = ("end", -7) if px > plot.left + plot.width * 0.6 else ("start", 7)
    return (
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="#d62728"/>'
        f'<text x="{px + dx:.1f}" y="{max(py - 6, plot.top - 2):.1f}" text-anchor="{anchor}" '
        f'fill="#d62728">{_escape(label)}</text>'
    )


def timeline(
    run: DeviceRun, width: int = 720, height: int = 180, *, inline: bool = False, until: float = 0.0
) -> str:
    """A device's timeline chart, `width` by `height` pixels. `inline` leaves out the SVG
    namespace, which a chart inside an HTML page does not need; the time axis reaches at
    least `until` seconds (the run's duration, so that the charts of one run line up)."""
    left, right, top, bottom = _MARGIN
    peak = f"peak {readable_size(run.peak_bytes)} at {seconds(run.peak_time)}"
    sampled = " (sampled)" if not run.exact else ""
    title = f"{run.device}: highest bytes in use per interval{sampled}"
    xmlns = "" if inline else ' xmlns="http://www.w3.org/2000/svg"'
    parts = [
        f'<svg{xmlns} width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{_escape(f"{title}, {peak}")}" '
        'font-family="sans-serif" font-size="11">',
        f"<title>{_escape(f'{title}, {peak}')}</title>",
        f'<text x="8" y="17" font-size="13" font-weight="bold">{_escape(title)}</text>',
    ]
    plot_w, plot_h = max(width - left - right, 1), max(height - top - bottom, 1)
    if not run.timeline:
        parts.append(
            f'<text x="{width / 2:.1f}" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
            f'fill="#666">No timeline was recorded; {_escape(peak)}</text>'
        )
        return "".join(parts) + "</svg>"
    y_ticks = _byte_ticks(math.ceil(max(run.peak_bytes, *(b for _, b in run.timeline)) * 1.08))
    t_max = max(until, run.peak_time, *(t for t, _ in run.timeline))
    plot = _Plot(left, top, plot_w, plot_h, t_max if t_max > 0 else 1.0, y_ticks[-1])
    x_ticks = [t for t in _ticks(plot.t_max) if t <= plot.t_max * (1 + 1e-9)]
    parts += _axes(plot, y_ticks, x_ticks)
    parts += [_steps(plot, run), _peak_mark(plot, run, peak)]
    return "".join(parts) + "</svg>"
