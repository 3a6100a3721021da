"""The CUDA caching allocator's size rules (``c10/cuda/CUDACachingAllocator.cpp``, default
settings), shared by the estimator's model of the allocator
(:mod:`torchmem.estimator.allocator`) and the snapshot reader, which tells each traced
allocation's block size from the trace's addresses (:func:`trace_blocks`).

Every block of the large pool is larger than 1 MiB (its requests are, and so is every
remainder split off), and every block of the small pool is its request rounded; so a block
that starts a free stretch and is not split is the whole stretch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

MIN_BLOCK = 512
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


def block_bytes(request: int, room: int | None) -> int:
    """The block of a request of `request` bytes (as a trace records it) placed at the start
    of a free stretch of `room` bytes (up to the next block in use, or the end of the
    segment): the request rounded, or the whole stretch where what would remain is too
    small to split off. The request rounded where `room` is None or too small (the
    addresses are not known well enough)."""
    size = round_size(request)
    if room is None or room < size or splits(size, room - size):
        return size
    return room


def trace_blocks(
    segments: Iterable[tuple[int, int]],
    in_use: Iterable[tuple[int, int]],
    events: Sequence[tuple[int, int, int, int, int]],
    expandable: bool = False,
) -> list[int]:
    """The bytes of the block of each of a trace's `events` (:data:`KINDS` number, address,
    bytes, and two fields not read; 0 for a segment's), from the addresses: where each
    allocation starts, where the next block in use starts, and the segment's end.

    `segments` are (address, bytes) and `in_use` the blocks in use (address, bytes) at the
    end of the trace: the segments at its start follow by undoing its segment actions, the
    blocks in use then are those of the end the trace did not allocate, and those it frees
    without having allocated them (their size follows from the room they leave, when
    freed). With expandable segments a block is its request rounded.
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
    starts = sorted(ends)
    right, insort = bisect.bisect_right, bisect.insort

    def room(address: int) -> int | None:
        """Bytes from `address` to the next block in use or its segment's end."""
        at = right(starts, address) - 1
        end = ends[starts[at]] if at >= 0 else address
        if address >= end:
            return None
        after = right(used, address)
        return (used[after] if after < len(used) and used[after] < end else end) - address

    out: list[int] = []
    append = out.append
    for kind, address, size, _, _ in events:  # a hot loop: up to a million entries
        if kind == 0:
            nbytes = (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK or MIN_BLOCK
            if nbytes > SMALL_SIZE and not expandable:
                # block_bytes(size, room(address)), inline
                at = right(starts, address) - 1
                end = ends[starts[at]] if at >= 0 else address
                if address < end:
                    after = right(used, address)
                    stretch = (
                        used[after] if after < len(used) and used[after] < end else end
                    ) - address
                    if nbytes <= stretch <= nbytes + SMALL_SIZE:
                        nbytes = stretch
                insort(used, address)
            sizes[address] = nbytes
        elif kind == 1:
            nbytes = sizes.pop(address, 0)
            if not nbytes or nbytes > SMALL_SIZE:
                if not nbytes:
                    nbytes = round_size(size) if expandable else block_bytes(size, room(address))
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
