"""The allocations alive at a device's peak by stack: an icicle (a flame graph drawn top
down) as HTML.

The root is everything alive at the peak; under it each stack's outermost frame, and so
on inwards, each box as wide as the bytes alive at the peak that were allocated below it.
Each of a site's stacks (:attr:`Site.stacks`: one per way its line was reached) carries
its own bytes down to its innermost frame (and to the site's own line where the stack does
not reach it); a site's bytes that no stack holds (memory from before the recording, a
site whose stack was not recorded) are a box right under the root. Bytes alive at the peak that
no site names (none where the recording kept every site) are one box of their own, so the
root is the peak. Each box's tooltip names the frame and, for the user's own lines, the
text of the line.
"""

from __future__ import annotations

import html as markup
import linecache
import zlib
from dataclasses import dataclass, field

from torchmem.records.frames import USER, Frame, kind, located
from torchmem.records.run import DeviceRun, Site
from torchmem.render.chart import exact

ROW = 20
"""Pixels per level of the stacks."""
SMALLEST = 2000
"""Boxes narrower than 1/SMALLEST of the root are left out of the HTML (their bytes stay
in the boxes above them), so that a run with thousands of small sites stays a small page."""
UNNAMED = "(not named by a site)"
"""The box of bytes alive at the peak that no site names."""


@dataclass
class Node:
    """A frame of the stacks at the peak and what lies under it."""

    frame: Frame | None
    """``(file, line, function)``; None for the root."""
    bytes: int = 0
    """Bytes alive at the peak allocated in or under this frame."""
    source: str | None = None
    """The text of the line, for the user's own lines."""
    children: dict[Frame, Node] = field(default_factory=dict)


@dataclass(frozen=True)
class Box:
    """A box of the icicle: where it sits, in bytes from the left and levels from the top."""

    node: Node
    depth: int
    offset: int
    """Bytes to the left of this box on its level."""


def source_line(file: str, line: int) -> str | None:
    """The stripped text of `line` of `file` (Python's line cache: a notebook's cells
    too); None where it cannot be read or is blank."""
    if line <= 0:
        return None
    text = linecache.getline(file, line).strip()
    return text or None


def _paths(site: Site) -> list[tuple[int, list[Frame]]]:
    """The bytes of each of the site's stacks with its frames from the outermost in to the
    site's own line; then the bytes no stack holds, with the site's line alone."""
    own = (site.file, site.line, site.function)
    found = []
    for nbytes, stack in site.stacks:
        path = list(reversed(stack))
        if not any(frame[:2] == own[:2] for frame in path):
            path.append(own)
        found.append((nbytes, path))
    rest = site.bytes - sum(s.bytes for s in site.stacks)
    if rest > 0 or not site.stacks:
        found.append((rest, [own]))
    return found


def tree(run: DeviceRun) -> Node:
    """The stacks of :attr:`DeviceRun.sites_at_peak` merged from the outermost frame in;
    the root holds the peak (sites and what no site names)."""
    root = Node(None)
    for site in run.sites_at_peak:
        for nbytes, path in _paths(site):
            _add(root, site, nbytes, path)
    rest = run.peak_bytes - root.bytes
    if rest > 0:
        root.children[(UNNAMED, 0, "")] = Node((UNNAMED, 0, ""), rest)
        root.bytes += rest
    return root


def _add(root: Node, site: Site, nbytes: int, path: list[Frame]) -> None:
    """Add `nbytes` of `site` under `root`, along `path` (outermost first)."""
    node = root
    root.bytes += nbytes
    for frame in path:
        child = node.children.get(frame)
        if child is None:
            user = kind(frame[0], frame[2]) == USER
            text = site.source if frame[:2] == (site.file, site.line) else None
            if text is None and user:
                text = source_line(frame[0], frame[1])
            child = node.children[frame] = Node(frame, source=text)
        child.bytes += nbytes
        node = child


def boxes(root: Node) -> list[Box]:
    """Every box of the icicle, the root first, each level's boxes left to right (larger
    first)."""
    found, todo = [], [(root, 0, 0)]
    while todo:
        node, depth, offset = todo.pop()
        found.append(Box(node, depth, offset))
        below = offset
        children = sorted(node.children.values(), key=lambda c: c.bytes, reverse=True)
        placed = []
        for child in children:
            placed.append((child, depth + 1, below))
            below += child.bytes
        todo.extend(reversed(placed))
    return found


def _label(node: Node) -> tuple[str, str]:
    """The box's text and its tooltip."""
    if node.frame is None:
        return (
            f"all alive at the peak: {exact(node.bytes)}",
            f"all alive at the peak\n{exact(node.bytes)}",
        )
    file, line, function = node.frame
    where = located(file, line)
    short = located(file.replace("\\", "/").rsplit("/", 1)[-1], line)
    text = f"{function} ({short})" if function else short
    tip = f"{function}\n{where}" if function else where
    tip += f"\n{exact(node.bytes)}"
    if node.source:
        tip += f"\n{node.source}"
    return text, tip


def _colour(node: Node) -> str:
    if node.frame is None:
        return "#d9d9d9"
    file, _, function = node.frame
    shade = zlib.crc32(f"{file}{function}".encode("utf-8", "surrogateescape")) % 12
    if node.frame[1] == 0:
        return f"hsl(0, 0%, {74 + shade}%)"
    if kind(file, function) == USER:
        return f"hsl({20 + shade * 2}, 85%, {68 + shade % 4 * 3}%)"
    return f"hsl(210, 35%, {74 + shade % 4 * 3}%)"


def html(run: DeviceRun) -> str:
    """The icicle of `run`'s stacks at the peak: HTML, as wide as the page, one row of
    :data:`ROW` pixels per level, boxes narrower than 1/:data:`SMALLEST` of it left out;
    empty where the device has no sites."""
    if not run.sites_at_peak:
        return ""
    root = tree(run)
    total = root.bytes or 1
    found = [box for box in boxes(root) if box.node.bytes * SMALLEST >= total]
    depth = max(box.depth for box in found) + 1
    parts = []
    for box in found:
        text, tip = _label(box.node)
        left, width = box.offset / total * 100, box.node.bytes / total * 100
        parts.append(
            f'<div class="torchmem-box" data-bytes="{box.node.bytes}" data-depth="{box.depth}" '
            f'title="{markup.escape(tip).replace(chr(10), "&#10;")}" '
            f'style="position: absolute; left: {left:.4f}%; '
            f"width: {width:.4f}%; top: {box.depth * ROW}px; height: {ROW - 2}px; "
            f"background: {_colour(box.node)}; border-right: 1px solid #fff; "
            "box-sizing: border-box; overflow: hidden; white-space: nowrap; "
            "text-overflow: ellipsis; font-size: 11px; line-height: 18px; "
            f'padding: 0 {3 if width >= 1 else 0}px">{markup.escape(text)}</div>'
        )
    return (
        f'<div class="torchmem-icicle" style="position: relative; height: {depth * ROW}px; '
        f'margin: 6px 0 12px; font-family: system-ui, sans-serif">{"".join(parts)}</div>'
    )
