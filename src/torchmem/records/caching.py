"""The CUDA caching allocator's size rules (``c10/cuda/CUDACachingAllocator.cpp``, default
settings), shared by the estimator's model of the allocator
(:mod:`torchmem.estimator.allocator`) and the snapshot reader, which tells each traced
allocation's block size from the trace's addresses (:func:`trace_blocks`) and replays the
trace in those blocks (:func:`replay_trace`, :func:`timeline`).

Every block of the large pool is larger than 1 MiB (its requests are, and so is every
remainder split off), and every block of the small pool is its request rounded; so a block
that starts a free stretch and is not split is the whole stretch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, NoReturn

MIN_BLOCK = 512
NO_LIMIT = 2**64
"""``max_split_size_mb`` unset: any block may be split."""
SMALL_SIZE = 2**20
"""Requests up to this size (rounded) come from the small pool."""
SMALL_BUFFER = 2 * 2**20
"""The small pool's segment (and, expandable, page) size."""
LARGE_BUFFER = 20 * 2**20
"""The large pool's segment size for requests under :data:`MIN_LARGE_ALLOC`, and its page
size when segments are expandable."""
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20
"""Segments for requests of at least :data:`MIN_LARGE_ALLOC` are rounded up to this."""

KINDS = {"alloc": 0, "free_completed": 1, "segment_alloc": 2, "segment_free": 3}
"""The trace's actions that :func:`trace_blocks` reads, and their numbers there."""


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: a multiple of 512, at least 512."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(nbytes: int) -> int:
    """The segment reserved for a (rounded) request that no cached block serves."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def splits(size: int, remaining: int, expandable: bool = False) -> bool:
    """Whether a free block is split when a (rounded) request of `size` bytes takes it and
    `remaining` bytes would be left: at least 512 in the small pool (and with expandable
    segments), more than 1 MiB in the large pool."""
    return remaining >= MIN_BLOCK if size <= SMALL_SIZE or expandable else remaining > SMALL_SIZE


def block_bytes(request: int, room: int | None, max_split: int = NO_LIMIT) -> int:
    """The block of a request of `request` bytes (as a trace records it) placed at the start
    of a free stretch of `room` bytes (up to the next block in use, or the end of the
    segment): the request rounded, or the whole stretch where what would remain is too
    small to split off, or the request is of at least `max_split` bytes
    (``max_split_size_mb``: never split). The request rounded where `room` is None or too
    small (the addresses are not known well enough)."""
    size = round_size(request)
    if room is None or room < size or (size < max_split and splits(size, room - size)):
        return size
    return room


def read_trace(
    raw: list[Any], bad: Callable[[object, int], NoReturn]
) -> tuple[list[tuple[int, int, int, int, int]], list[int]]:
    """The events of a snapshot's trace (its dicts, `raw`) that :func:`trace_blocks` reads:
    (:data:`KINDS` number, address, bytes, time in µs, entry index); and the indices of its
    out-of-memory events. ``bad(entry, index)`` is called for an entry that is not a dict
    of the types PyTorch writes, and must raise."""
    events: list[tuple[int, int, int, int, int]] = []
    ooms = []
    kinds, append = KINDS.get, events.append
    for k, entry in enumerate(raw):  # a hot loop: up to a million entries
        if type(entry) is not dict:
            bad(entry, k)
        get = entry.get
        action, time_us, address, size = (
            get("action"),
            get("time_us", 0),
            get("addr", 0),
            get("size", 0),
        )
        if not (
            type(action) is str
            and type(time_us) is int
            and type(address) is int
            and type(size) is int
        ):
            bad(entry, k)
        kind = kinds(action)
        if kind is not None:
            append((kind, address, size, time_us, k))
        elif action == "oom":
            free = get("device_free")
            if free is not None and type(free) is not int:
                bad(entry, k)
            ooms.append(k)
    return events, ooms


def trace_blocks(
    segments: Iterable[tuple[int, int]],
    in_use: Iterable[tuple[int, int]],
    events: Sequence[tuple[int, int, int, int, int]],
    expandable: bool = False,
    max_split: int = NO_LIMIT,
) -> list[int]:
    """The bytes of the block of each of a trace's `events` (:data:`KINDS` number, address,
    bytes, and two fields not read; 0 for a segment's), from the addresses: where each
    allocation starts, where the next block in use starts, and the segment's end.

    `segments` are (address, bytes) and `in_use` the blocks in use (address, bytes) at the
    end of the trace: the segments at its start follow by undoing its segment actions, the
    blocks in use then are those of the end the trace did not allocate, and those it frees
    without having allocated them (their size follows from the room they leave, when
    freed). With expandable segments a block is its request rounded; a request of at least
    `max_split` bytes (``max_split_size_mb``) takes its whole free stretch.
    """
    ends = dict((address, address + size) for address, size in segments)
    for kind, address, size, _, _ in reversed(events):
        if kind == 2:
            ends.pop(address, None)
        elif kind == 3:
            ends[address] = address + size
    traced: set[int] = set()
    before: set[int] = set()
    for kind, address, _, _, _ in events:
        if kind == 0:
            traced.add(address)
        elif kind == 1 and address not in traced:
            before.add(address)
        elif kind == 1:
            traced.remove(address)
    sizes: dict[int, int] = {a: n for a, n in in_use if a not in traced}
    used = sorted({a for a, n in sizes.items() if n > SMALL_SIZE} | before)
    return _replay_blocks(events, ends, sizes, used, expandable, max_split)


def _replay_blocks(
    events: Sequence[tuple[int, int, int, int, int]],
    ends: dict[int, int],
    sizes: dict[int, int],
    used: list[int],
    expandable: bool,
    max_split: int,
) -> list[int]:
    """:func:`trace_blocks`, from the start of the trace: `ends` of its segments (address ->
    end address), `sizes` of its blocks in use (address -> bytes) and the addresses `used`
    of those in use over :data:`SMALL_SIZE` (sorted). Changes all three."""
    starts = sorted(ends)
    right, insort = bisect.bisect_right, bisect.insort
    out: list[int] = []
    append = out.append
    for kind, address, size, _, _ in events:  # a hot loop: up to a million entries
        if kind == 0:
            nbytes = (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK or MIN_BLOCK
            if nbytes > SMALL_SIZE and not expandable:
                # block_bytes(size, _room(...)), inline
                at = right(starts, address) - 1
                end = ends[starts[at]] if at >= 0 else address
                if address < end:
                    after = right(used, address)
                    stretch = (
                        used[after] if after < len(used) and used[after] < end else end
                    ) - address
                    if nbytes <= stretch <= nbytes + SMALL_SIZE or max_split <= nbytes <= stretch:
                        nbytes = stretch
                insort(used, address)
            sizes[address] = nbytes
        elif kind == 1:
            nbytes = sizes.pop(address, 0)
            if not nbytes or nbytes > SMALL_SIZE:
                if not nbytes:
                    nbytes = (
                        round_size(size)
                        if expandable
                        else block_bytes(size, _room(address, starts, ends, used), max_split)
                    )
                at = bisect.bisect_left(used, address)
                if at < len(used) and used[at] == address:
                    del used[at]
        else:
            nbytes = 0
            if kind == 2:
                insort(starts, address)
                ends[address] = address + size
            elif kind == 3 and address in ends:
                del starts[bisect.bisect_left(starts, address)]
                del ends[address]
        append(nbytes)
    return out


def _room(address: int, starts: list[int], ends: dict[int, int], used: list[int]) -> int | None:
    """Bytes from `address` to the next block in use (`used`, sorted) or the end of its
    segment (`starts`, sorted, and their `ends`); None outside every segment."""
    at = bisect.bisect_right(starts, address) - 1
    end = ends[starts[at]] if at >= 0 else address
    if address >= end:
        return None
    after = bisect.bisect_right(used, address)
    return (used[after] if after < len(used) and used[after] < end else end) - address


class TraceReplay(NamedTuple):
    """A trace's allocations and completed frees added up in block bytes, from 0 at its
    start (a snapshot anchors it at its end)."""

    blocks: list[int]
    """The block bytes of each event (:func:`trace_blocks`)."""
    points: list[tuple[float, int]]
    """(seconds from the start, or the entry number counted from 1; bytes from then on),
    from (0, 0) on, one per allocation and completed free."""
    peak_at: int
    """The index of the event after which the peak held; -1: the start."""
    peak_x: float
    """Its seconds or entry number (0 at the start)."""
    highest: int
    """The peak's bytes."""
    end: int
    """The bytes after the last event."""
    live: list[int]
    """The indices of the allocations alive at the peak."""


def replay_trace(
    segments: Iterable[tuple[int, int]],
    in_use: Iterable[tuple[int, int]],
    events: Sequence[tuple[int, int, int, int, int]],
    start_us: int | None,
    expandable: bool = False,
    max_split: int = NO_LIMIT,
) -> TraceReplay:
    """Replay `events` (:func:`trace_blocks`, whose fourth field is the time in µs and
    fifth the entry index) in block bytes; times are seconds from `start_us`, or where that
    is None (the trace has no times) entry numbers."""
    blocks = trace_blocks(segments, in_use, events, expandable, max_split)
    running = highest = 0
    peak_at = -1
    points: list[tuple[float, int]] = [(0.0, 0)]
    when = peak_x = 0.0
    append = points.append
    for k, ((kind, _, _, time_us, entry), nbytes) in enumerate(zip(events, blocks, strict=True)):
        if kind == 0:
            running += nbytes
        elif kind == 1:
            running -= nbytes
        else:
            continue
        if start_us is None:
            when = entry + 1
        elif time_us:  # else: as the entry before
            when = (time_us - start_us) / 1e6
        append((when, running))
        if running > highest:
            highest, peak_at, peak_x = running, k, when
    live: dict[int, int] = {}
    for k in range(peak_at + 1):
        kind, address = events[k][:2]
        if kind == 0:
            live[address] = k
        elif kind == 1:
            live.pop(address, None)
    return TraceReplay(blocks, points, peak_at, peak_x, highest, running, list(live.values()))


def timeline(
    points: Iterable[tuple[float, int]], span: float, intervals: int, integral: bool = False
) -> tuple[tuple[float, int], ...]:
    """The highest bytes of `points` (x, bytes from then on) in each of at most `intervals`
    equal intervals of x from 0 to `span`; exact, not sampled. With `integral` (x counts
    entries) each interval ends at a whole number."""
    ordered = list(points)
    if span <= 0:
        return ((0.0, max(b for _, b in ordered)),)
    count = min(intervals, len(ordered))
    out = []
    i, value = 0, ordered[0][1]
    for k in range(count):
        end = -(-int(span) * (k + 1) // count) if integral else span * (k + 1) / count
        high = value
        while i < len(ordered) and (ordered[i][0] <= end or k == count - 1):
            value = ordered[i][1]
            if value > high:
                high = value
            i += 1
        out.append((end, high))
    return tuple(out)
