"""A model of PyTorch's CUDA caching allocator, replayed over a run's allocations and frees.

It follows ``c10/cuda/CUDACachingAllocator.cpp`` with its default settings:

- a request is rounded up to a multiple of 512 bytes (512 at least);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request no cached block can serve reserves a new segment: 2 MiB for the small pool,
  20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- the free block chosen is the smallest one large enough (best fit; on a tie the lowest
  address), and it is split when what remains is at least 512 bytes (small pool) or more
  than 1 MiB (large pool); otherwise the whole block is allocated and counted as allocated;
- a freed block merges with the free blocks beside it in its segment;
- where a new segment would exceed the memory there is, every wholly free segment is
  released first (``release_cached_blocks``), and only then is it out of memory;
- with ``expandable_segments:True`` each pool is one segment that grows at its end in
  pages of 2 MiB (small pool) or 20 MiB (large pool) as needed.

One stream is assumed (a training step's work runs on the current stream).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

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


def expandable_segments(conf: str | None = None) -> bool:
    """Whether an allocator configuration (by default the one in the environment,
    ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``) turns expandable segments on."""
    if conf is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


class OutOfMemory(Exception):
    """The modelled allocator could not serve a request within its capacity."""

    def __init__(self, nbytes: int, event: int) -> None:
        super().__init__(f"out of memory allocating {nbytes} bytes (event {event})")
        self.nbytes = nbytes
        self.event = event


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: _Segment
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass(eq=False)
class _Segment:
    address: int
    size: int
    expandable: bool = False
    blocks: int = 1
    """Blocks the segment is split into."""
    last: _Block | None = field(default=None, repr=False)
    """Expandable segments: the block at the end."""


class CachingAllocator:
    """Allocates and frees like the caching allocator, counting what it would report.

    Args:
        capacity: bytes the allocator may reserve at most (None: no limit).
        expandable: model ``expandable_segments:True``.
    """

    def __init__(self, capacity: int | None = None, *, expandable: bool = False) -> None:
        self.capacity = capacity
        self.expandable = expandable
        self.allocated = 0
        """Bytes of allocated blocks (``memory_allocated()``)."""
        self.reserved = 0
        """Bytes of segments (``memory_reserved()``)."""
        self.allocated_peak = 0
        self.reserved_peak = 0
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._blocks: dict[tuple[int, int], _Block] = {}
        self._segments: list[_Segment] = []
        self._growing: dict[bool, _Segment] = {}
        self._next_address = 1 << 40
        self._event = 0

    # Requests ------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> _Block:
        """Serve a request of `nbytes`; the block it returns is what ``free`` takes."""
        self._event += 1
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            block = self._grow(size, small)
        self._take(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, block.segment, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            block.segment.blocks += 1
            if block.segment.last is block:
                block.segment.last = rest
            self._put(rest)
        block.allocated = True
        self.allocated += block.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        """Return `block` to its pool, merged with its free neighbours."""
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._take(neighbour)
                block.segment.blocks -= 1
                if neighbour is block.prev:
                    block.address = neighbour.address
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                    if block.segment.last is neighbour:
                        block.segment.last = block
                block.size += neighbour.size
        self._put(block)

    # Pools ---------------------------------------------------------------------------

    def _put(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._blocks[key] = block

    def _take(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, key)]
        del self._blocks[key]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size, 0))
        return self._blocks[pool[at]] if at < len(pool) else None

    def _grow(self, size: int, small: bool) -> _Block:
        """Reserve memory for a request no free block serves: a new segment, or more pages
        at the end of the pool's expandable segment."""
        if self.expandable:
            return self._expand(size, small)
        nbytes = segment_size(size)
        self._reserve(nbytes, size)
        segment = _Segment(self._next_address, nbytes)
        self._next_address += nbytes
        self._segments.append(segment)
        block = _Block(segment.address, nbytes, segment, small)
        self._put(block)
        return block

    def _expand(self, size: int, small: bool) -> _Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        segment = self._growing.get(small)
        if segment is None:
            segment = self._growing[small] = _Segment(self._next_address, 0, expandable=True)
            self._next_address += 1 << 40  # room to grow
            self._segments.append(segment)
            segment.blocks = 0
        tail = segment.last
        have = tail.size if tail is not None and not tail.allocated else 0
        nbytes = -(-(size - have) // page) * page
        self._reserve(nbytes, size)
        end = segment.address + segment.size
        segment.size += nbytes
        if have:
            assert tail is not None
            self._take(tail)
            tail.size += nbytes
            self._put(tail)
            return tail
        block = _Block(end, nbytes, segment, small, prev=tail)
        if tail is not None:
            tail.next = block
        segment.last = block
        segment.blocks += 1
        self._put(block)
        return block

    def _reserve(self, nbytes: int, request: int) -> None:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self._release_cached()
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(request, self._event)
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _release_cached(self) -> None:
        """Release every wholly free segment (expandable: the free pages at its end)."""
        for segment in list(self._segments):
            if segment.expandable:
                tail = segment.last
                if tail is None or tail.allocated:
                    continue
                page = SMALL_BUFFER if tail.small else LARGE_BUFFER
                released = tail.size // page * page
                if not released:
                    continue
                self._take(tail)
                tail.size -= released
                segment.size -= released
                self.reserved -= released
                if tail.size:
                    self._put(tail)
                else:
                    segment.last = tail.prev
                    segment.blocks -= 1
                    if tail.prev is not None:
                        tail.prev.next = None
            elif segment.blocks == 1:
                block = self._blocks.get((segment.size, segment.address))
                if block is not None and block.segment is segment and not block.allocated:
                    self._take(block)
                    self._segments.remove(segment)
                    self.reserved -= segment.size
