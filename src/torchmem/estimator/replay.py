"""A real allocator trace replayed through the model of the caching allocator.

A memory snapshot (``torch.cuda.memory._snapshot()``) holds the segments and blocks at its
end and a trace of the allocator's actions before that. :func:`start_layout` rewinds the
trace from the end to the segments and blocks in use at its first entry; :func:`replay`
seeds :class:`~torchmem.estimator.allocator.CachingAllocator` with them and replays the
trace, the model choosing each allocation's block and each new segment itself (only a
new segment's address, the driver's choice, is taken from the trace), and says where the
model and the real allocator differ.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torchmem.estimator.allocator import CachingAllocator, Layout
from torchmem.estimator.settings import DEFAULTS, Settings
from torchmem.records.caching import LARGE_BUFFER, SMALL_BUFFER, block_bytes, round_size

MISMATCHES = 20
"""How many differences a replay keeps (it counts them all)."""


class Action(NamedTuple):
    """A trace entry as the model needs it."""

    action: str
    """``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
    ``segment_free``, ``segment_map``, ``segment_unmap`` (expandable segments); others
    (``oom``, ``snapshot``, ...) are passed over."""
    address: int
    size: int
    """Bytes: the request of an allocation (not its block), the whole of a segment."""
    stream: int = 0


@dataclass(frozen=True)
class Replay:
    """What the model did with a trace, and where it differs from the real allocator."""

    allocations: int
    """``alloc`` entries replayed."""
    segment_allocs: int
    """``segment_alloc`` and ``segment_map`` entries of the trace."""
    blocks: tuple[int, ...]
    """Bytes of each allocation's block, in trace order."""
    differences: int
    """Allocations placed at another address, segments reserved or released where the
    trace does not, and the trace's segments the model did not reserve or release."""
    mismatches: tuple[str, ...]
    """The first :data:`MISMATCHES` differences, each naming its entry."""
    end: tuple[Layout, ...]
    """The model's segments and blocks in use after the trace, by address."""
    allocated_peak: int
    """The model's highest allocated bytes, from the start's blocks in use on."""
    reserved_peak: int
    """The model's highest reserved bytes, from the start's segments on."""
    at_peak: tuple[int, int]
    """The model's reserved bytes and its largest free block's bytes when its allocated
    bytes first reached their peak."""


def start_layout(
    end: Iterable[Layout], actions: Sequence[Action], settings: Settings = DEFAULTS
) -> list[Layout]:
    """The segments and the blocks in use at the first of `actions`, from those at the end
    (the snapshot's) and the trace, recorded under `settings`: segments the trace reserved
    are taken away, those it released put back, and the pages it mapped at the end of an
    expandable segment unmapped; blocks in use at both ends keep their size, and a block
    allocated before the trace and freed in it is as large as :func:`start_block` says.
    A block of the trace whose address is in no segment of the start is left out."""
    segments = {s.address: (s.size, s.stream, s.small, s.expandable) for s in end}
    used = {address: size for s in end for address, size in s.used}
    for entry in reversed(actions):
        if entry.action == "segment_alloc":
            segments.pop(entry.address, None)
        elif entry.action == "segment_free":
            small = entry.size == SMALL_BUFFER
            segments[entry.address] = (entry.size, entry.stream, small, False)
        elif entry.action in ("segment_map", "segment_unmap"):
            _remap(segments, entry)
    live: set[int] = set()
    freed: dict[int, int] = {}  # allocated before the trace, freed in it: address -> request
    for entry in actions:
        if entry.action == "alloc":
            live.add(entry.address)
        elif entry.action == "free_completed":
            if entry.address in live:
                live.remove(entry.address)
            else:
                freed.setdefault(entry.address, entry.size)
    before = {address: size for address, size in used.items() if address not in live}
    layouts = []
    for address in sorted(segments):
        size, stream, small, expandable = segments[address]
        end_at = address + size
        inside = sorted(a for a in (*before, *freed) if address <= a < end_at)
        blocks = []
        for k, a in enumerate(inside):
            room = (inside[k + 1] if k + 1 < len(inside) else end_at) - a
            blocks.append((a, before[a] if a in before else start_block(freed[a], room, settings)))
        layouts.append(Layout(address, size, stream, small, tuple(blocks), expandable))
    return layouts


def start_block(request: int, room: int, settings: Settings) -> int:
    """The block of a request of `request` bytes placed at the start of a free stretch of
    `room` bytes under `settings`: with expandable segments the request rounded; a
    request of at least ``max_split_size`` takes the whole stretch (never split);
    otherwise as :func:`block_bytes` says."""
    if settings.expandable_segments:
        return round_size(request)
    if settings.max_split_size is not None and round_size(request) >= settings.max_split_size:
        return max(room, round_size(request))
    return block_bytes(request, room)


def _remap(segments: dict[int, tuple[int, int, bool, bool]], entry: Action) -> None:
    """Undo a map (or unmap) of `entry`'s pages at the end of its expandable segment."""
    for address, (size, stream, small, expandable) in segments.items():
        if expandable and address <= entry.address <= address + size:
            grown = size - entry.size if entry.action == "segment_map" else size + entry.size
            if grown:
                segments[address] = (grown, stream, small, True)
            else:
                del segments[address]
            return
    if entry.action == "segment_unmap":  # the segment's last pages: it was there before
        small = entry.size % LARGE_BUFFER != 0
        segments[entry.address] = (entry.size, entry.stream, small, True)


def replay(
    start: Iterable[Layout], actions: Iterable[Action], settings: Settings = DEFAULTS
) -> Replay:
    """Replay `actions` through the model following `settings`, seeded with `start`
    (:func:`start_layout`)."""
    return _Replayer(start, settings).run(actions)


class _Replayer:
    def __init__(self, start: Iterable[Layout], settings: Settings) -> None:
        self.allocator, self.used = _adopted(start, settings)
        self.own = self.allocator.driver
        self.allocator.driver = self.driver
        self.allocator.mapped = self.mapped
        self.reserved: deque[tuple[int, int]] = deque()  # the trace's segments not yet taken
        self.mismatches: list[str] = []
        self.differences = 0
        self.entry = 0

    def differ(self, why: str) -> None:
        self.differences += 1
        if len(self.mismatches) < MISMATCHES:
            self.mismatches.append(f"entry {self.entry}: {why}")

    def driver(self, nbytes: int, stream: int) -> int:
        """A new segment's address: the trace's next one, where it has one of this size."""
        if self.reserved and self.reserved[0][1] == nbytes:
            return self.reserved.popleft()[0]
        self.differ(f"the model reserves a segment of {nbytes} bytes, the trace does not")
        return self.own(nbytes, stream)

    def mapped(self, address: int, nbytes: int) -> None:
        """Pages the model maps at the end of an expandable segment: the trace's next."""
        if self.reserved and self.reserved[0] == (address, nbytes):
            self.reserved.popleft()
        else:
            self.differ(f"the model maps {nbytes} bytes at {address:#x}, the trace does not")

    def run(self, actions: Iterable[Action]) -> Replay:
        allocator, used = self.allocator, self.used
        blocks: list[int] = []
        segment_allocs = 0
        for self.entry, (action, address, size, stream) in enumerate(actions):
            if action == "alloc":
                block = allocator.malloc(size, stream)
                for _, extra in self.reserved:
                    self.differ(f"the trace reserves {extra} bytes of segment, the model does not")
                self.reserved.clear()
                if block.address != address:
                    self.differ(f"{size} bytes allocated at {block.address:#x}, not {address:#x}")
                blocks.append(block.size)
                used[address] = block
            elif action == "free_completed":
                freed = used.pop(address, None)
                if freed is None:
                    self.differ(f"a free at {address:#x}, where the model has no block in use")
                else:
                    allocator.free(freed)
            elif action in ("segment_alloc", "segment_map"):
                segment_allocs += 1
                self.reserved.append((address, size))
            elif action == "segment_free" and not allocator.release(address):
                self.differ(f"the trace releases the segment at {address:#x}, the model cannot")
            elif action == "segment_unmap":
                self.differ(f"the trace unmaps {size} bytes at {address:#x}, the model does not")
        return Replay(
            len(blocks),
            segment_allocs,
            tuple(blocks),
            self.differences,
            tuple(self.mismatches),
            tuple(allocator.layout()),
            allocator.allocated_peak,
            allocator.reserved_peak,
            allocator.at_peak,
        )


def following(
    settings: Settings, capacity: int | None = None, capped: bool = False
) -> CachingAllocator:
    """A model following `settings` (:class:`CachingAllocator` gives the arguments)."""
    return CachingAllocator(
        capacity,
        expandable=settings.expandable_segments,
        max_split_size=settings.max_split_size,
        garbage_collection_threshold=settings.garbage_collection_threshold,
        capped=capped,
    )


def _adopted(
    layouts: Iterable[Layout], settings: Settings = DEFAULTS
) -> tuple[CachingAllocator, dict[int, Any]]:
    """A model following `settings` holding `layouts` (segments reserved before it
    started), and its blocks in use by address."""
    allocator = following(settings)
    used: dict[int, Any] = {}
    for layout in layouts:
        used.update((b.address, b) for b in allocator.adopt(layout))
    return allocator, used
