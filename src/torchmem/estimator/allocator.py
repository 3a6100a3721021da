"""A model of PyTorch's CUDA caching allocator, replayed over a run's allocations and frees.

It follows ``c10/cuda/CUDACachingAllocator.cpp``, with its default settings:

- a request is rounded up to a multiple of 512 bytes (512 at least);
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request no cached block can serve reserves a new segment: 2 MiB for the small pool,
  20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- the free block chosen is the smallest one of the request's stream large enough (best
  fit; on a tie the lowest address: the pools are ordered by (stream, size, address)),
  and it is split, the request at its start, when what remains is at least 512 bytes
  (small pool) or more than 1 MiB (large pool); otherwise the whole block is allocated
  and counted as allocated;
- a freed block merges with the free blocks beside it in its segment;
- where a new segment would exceed the memory there is, every wholly free segment is
  released first (``release_cached_blocks``), and only then is it out of memory;
- with ``expandable_segments:True`` each pool is one segment that grows at its end in
  pages of 2 MiB (small pool) or 20 MiB (large pool) as needed, a block is split when at
  least 512 bytes remain in either pool, and the best fit passes over the free block at
  the segment's end for a larger one elsewhere (it counts as large as it can grow);
- with ``max_split_size_mb`` a block of at least that size is never split: a request
  under it takes no such block, and a request of at least it takes one only if it is
  less than 20 MiB larger; short of memory, such blocks are released first;
- with ``garbage_collection_threshold`` and a memory fraction set
  (``torch.cuda.set_per_process_memory_fraction``), a request no cached block serves
  first releases wholly free large segments, the oldest (by the pool's searches since
  they were cached) first, while more than the threshold's share of the allowed memory
  is reserved.

A segment's address is the driver's choice; the model numbers its own segments from
2**40 unless told otherwise (:mod:`torchmem.estimator.replay` gives it the addresses a
real trace recorded); one that would overlap another segment is refused (ValueError). The
size rules themselves are :mod:`torchmem.records.caching`'s, which the snapshot reader
shares.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from torchmem.errors import OutOfMemory
from torchmem.records.caching import (
    LARGE_BUFFER as LARGE_BUFFER,
    MIN_BLOCK as MIN_BLOCK,
    MIN_LARGE_ALLOC as MIN_LARGE_ALLOC,
    ROUND_LARGE as ROUND_LARGE,
    SMALL_BUFFER as SMALL_BUFFER,
    SMALL_SIZE as SMALL_SIZE,
    round_size as round_size,
    segment_size as segment_size,
    splits,
)

FIRST_ADDRESS = 1 << 40
"""Where the model places its own segments when no driver says where."""


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


class Layout(NamedTuple):
    """A segment and the blocks in use in it; the rest of it is free."""

    address: int
    size: int
    """Bytes."""
    stream: int
    small: bool
    """Whether it belongs to the small pool."""
    used: tuple[tuple[int, int], ...]
    """(address, bytes) of each block in use (allocated, or freed but pending), in address
    order."""
    expandable: bool = False
    """An expandable segment: `size` is the bytes mapped so far."""


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    segment: _Segment
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None
    cached_at: int = 0
    """The pool's searches when it was last cached (its age counts from there)."""

    def key(self) -> tuple[int, int, int]:
        return (self.segment.stream, self.size, self.address)


@dataclass(eq=False)
class _Segment:
    address: int
    size: int
    stream: int = 0
    expandable: bool = False
    blocks: int = 1
    """Blocks the segment is split into."""
    first: _Block | None = field(default=None, repr=False)
    last: _Block | None = field(default=None, repr=False)
    """Expandable segments: the block at the end."""


class CachingAllocator:
    """Allocates and frees like the caching allocator, counting what it would report.

    Args:
        capacity: bytes the allocator may reserve at most (None: no limit): the device's
            memory, or the share ``torch.cuda.set_per_process_memory_fraction`` allows.
        expandable: model ``expandable_segments:True``.
        max_split_size: model ``max_split_size_mb`` (in bytes; None: no limit).
        garbage_collection_threshold: model ``garbage_collection_threshold`` (0: off).
        capped: whether `capacity` is a memory fraction's share (garbage collection acts
            only then, as in PyTorch).
    """

    def __init__(
        self,
        capacity: int | None = None,
        *,
        expandable: bool = False,
        max_split_size: int | None = None,
        garbage_collection_threshold: float = 0.0,
        capped: bool = False,
    ) -> None:
        self.capacity = capacity
        self.expandable = expandable
        self.max_split = max_split_size if max_split_size is not None else 1 << 64
        self.collects = capped and capacity is not None and garbage_collection_threshold > 0
        self.threshold = garbage_collection_threshold
        self._searches = {True: 0, False: 0}
        self.allocated = 0
        """Bytes of allocated blocks (``memory_allocated()``)."""
        self.reserved = 0
        """Bytes of segments (``memory_reserved()``)."""
        self.allocated_peak = 0
        self.reserved_peak = 0
        self.at_peak = (0, 0)
        """(reserved bytes, the largest free block's bytes) when allocated bytes first
        reached their peak."""
        self._streams: set[int] = set()
        self._starts: list[int] = []
        """The segments' addresses, sorted."""
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._segments: dict[int, _Segment] = {}
        self._growing: dict[bool, _Segment] = {}
        self._next_address = FIRST_ADDRESS
        self._event = 0
        self.driver: Callable[[int, int], int] = self._own_address
        """Where a new segment of (bytes, stream) goes: the device driver's choice."""
        self.mapped: Callable[[int, int], None] = lambda address, nbytes: None
        """Told of the (address, bytes) mapped at the end of an expandable segment."""

    # Requests ------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """Serve a request of `nbytes` on `stream`; the block it returns is what ``free``
        takes."""
        self._event += 1
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small, stream)
        if block is None:
            if self.collects:
                self._collect()
            block = self._grow(size, small, stream)
        self._take(block)
        remaining = block.size - size
        if splits(size, remaining, self.expandable) and (small or size < self.max_split):
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
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
            self.at_peak = (self.reserved, self.largest_free())
        return block

    def free(self, block: _Block) -> None:
        """Return `block` to its pool, merged with its free neighbours (so its size, read
        afterwards, is the merged block's)."""
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
                        block.segment.first = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                    if block.segment.last is neighbour:
                        block.segment.last = block
                block.size += neighbour.size
        self._put(block)

    # Segments ------------------------------------------------------------------------

    def adopt(self, layout: Layout) -> list[_Block]:
        """Take over a segment reserved before the model started, with the blocks in use
        in it (counted as allocated); returns those blocks, in address order."""
        segment = _Segment(layout.address, layout.size, layout.stream, blocks=0)
        self._place(segment.address, segment.size)
        self._segments[segment.address] = segment
        if layout.expandable:
            segment.expandable = True
            self._growing[layout.small] = segment
        self.reserved += segment.size
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        used, at, prev = [], segment.address, None
        end = segment.address + segment.size
        for address, size in [*layout.used, (end, 0)]:
            for start, nbytes, allocated in ((at, address - at, False), (address, size, True)):
                if nbytes <= 0:
                    continue
                block = _Block(start, nbytes, segment, layout.small, allocated, prev)
                if prev is None:
                    segment.first = block
                else:
                    prev.next = block
                prev = segment.last = block
                segment.blocks += 1
                if allocated:
                    used.append(block)
                    self.allocated += nbytes
                else:
                    self._put(block)
            at = address + size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
            self.at_peak = (self.reserved, self.largest_free())
        return used

    def release(self, address: int) -> bool:
        """Release the segment at `address` (``empty_cache``) if it is wholly free; whether
        it was."""
        segment = self._segments.get(address)
        block = segment.first if segment is not None else None
        if segment is None or block is None or segment.blocks != 1 or block.allocated:
            return False
        self._take(block)
        del self._segments[address]
        del self._starts[bisect.bisect_left(self._starts, address)]
        self.reserved -= segment.size
        return True

    def layout(self) -> list[Layout]:
        """Every segment (expandable ones included) with its blocks in use, by address."""
        found = []
        for address in sorted(self._segments):
            segment = self._segments[address]
            used, block = [], segment.first
            small = block.small if block is not None else segment.size == SMALL_BUFFER
            while block is not None:
                if block.allocated:
                    used.append((block.address, block.size))
                block = block.next
            found.append(
                Layout(
                    address, segment.size, segment.stream, small, tuple(used), segment.expandable
                )
            )
        return found

    # Pools ---------------------------------------------------------------------------

    def largest_free(self) -> int:
        """Bytes of the largest free (cached) block; blocks not yet mapped in expandable
        segments are not counted."""
        largest = 0
        for pool in self._free.values():
            for stream in self._streams:
                at = bisect.bisect_left(pool, (stream + 1, 0, 0)) - 1
                if at >= 0 and pool[at][0] == stream:
                    largest = max(largest, pool[at][1])
        return largest

    def _put(self, block: _Block) -> None:
        block.cached_at = self._searches[block.small]
        self._streams.add(block.segment.stream)
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._blocks[key] = block

    def _take(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, key)]
        del self._blocks[key]

    def _best_fit(self, size: int, small: bool, stream: int) -> _Block | None:
        pool = self._free[small]
        if self.collects:
            self._searches[small] += 1
        at = bisect.bisect_left(pool, (stream, size, 0))
        if at == len(pool) or pool[at][0] != stream:
            return None
        block = self._blocks[pool[at]]
        while block.segment.expandable and at + 1 < len(pool) and pool[at + 1][0] == stream:
            following = self._blocks[pool[at + 1]]
            if _growable(following) >= _growable(block):
                break
            at, block = at + 1, following
        if size < self.max_split <= block.size:
            return None  # an oversize block for a request under the limit
        if size >= self.max_split and block.size >= size + LARGE_BUFFER:
            return None  # an oversize block too much larger than the request
        return block

    def _place(self, address: int, nbytes: int, growing: int | None = None) -> None:
        """Check that `nbytes` at `address` overlap no segment (but the one at `growing`,
        which they extend) and note a new segment's address: a driver or a history that
        says otherwise is refused with a ValueError."""
        at = bisect.bisect_right(self._starts, address)
        before = self._starts[at - 1] if at else None
        if before is not None and before != growing:
            clash = before + self._segments[before].size > address
        else:
            clash = False
        if clash or (at < len(self._starts) and self._starts[at] < address + nbytes):
            raise ValueError(f"{nbytes} bytes at {address:#x} overlap a segment")
        if growing is None:
            self._starts.insert(at, address)

    def _own_address(self, nbytes: int, stream: int) -> int:
        address = self._next_address
        self._next_address += (1 << 40) if self.expandable else nbytes  # room to grow
        return address

    def _grow(self, size: int, small: bool, stream: int) -> _Block:
        """Reserve memory for a request no free block serves: a new segment, or more pages
        at the end of the pool's expandable segment."""
        if self.expandable:
            return self._expand(size, small, stream)
        nbytes = segment_size(size)
        self._reserve(nbytes, size)
        segment = _Segment(self.driver(nbytes, stream), nbytes, stream)
        self._place(segment.address, nbytes)
        self._segments[segment.address] = segment
        block = _Block(segment.address, nbytes, segment, small)
        segment.first = segment.last = block
        self._put(block)
        return block

    def _expand(self, size: int, small: bool, stream: int) -> _Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        segment = self._growing.get(small)
        tail = segment.last if segment is not None else None
        have = tail.size if tail is not None and not tail.allocated else 0
        nbytes = -(-(size - have) // page) * page
        self._reserve(nbytes, size)
        if segment is None:
            address = self.driver(nbytes, stream)
            self._place(address, nbytes)
            segment = self._growing[small] = _Segment(address, 0, stream, True, blocks=0)
            self._segments[address] = segment
        else:
            self.mapped(segment.address + segment.size, nbytes)
            self._place(segment.address + segment.size, nbytes, segment.address)
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
        else:
            segment.first = block
        segment.last = block
        segment.blocks += 1
        self._put(block)
        return block

    def _reserve(self, nbytes: int, request: int) -> None:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            if self.max_split < 1 << 64:
                self._release_oversize(request)
            if self.reserved + nbytes > self.capacity:
                self.empty_cache()
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(request, self._event)
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _release_oversize(self, request: int) -> None:
        """Release the smallest free oversize segment of the large pool (stream 0) that is
        at least as large as the request (and the limit), else the largest ones until as
        many bytes are released (``release_available_cached_blocks``)."""
        pool = self._free[False]
        want = max(round_size(request), self.max_split)
        at = bisect.bisect_left(pool, (0, want, 0))
        if at < len(pool) and pool[at][0] == 0:
            self.release(self._blocks[pool[at]].segment.address)
            return
        released = 0
        while at > 0 and released < want and pool[at - 1][0] == 0:
            block = self._blocks[pool[at - 1]]
            if block.size < self.max_split:
                break
            released += block.size
            self.release(block.segment.address)
            at -= 1

    def _collect(self) -> None:
        """Release wholly free large segments by age while more than the threshold's share
        of the capacity is reserved (``garbage_collect_cached_blocks``)."""
        assert self.capacity is not None
        limit = int(self.threshold * self.capacity)
        if self.reserved <= limit:
            return
        target, reclaimed = self.reserved - limit, 0
        searches = self._searches[False]
        whole = [b for b in map(self._blocks.get, self._free[False]) if b and _whole(b)]
        ages = sum(searches - b.cached_at for b in whole)
        while whole and reclaimed < target:
            threshold = ages / len(whole)
            old = [b for b in whole if searches - b.cached_at >= threshold]
            if not old:
                break
            for block in old:
                reclaimed += block.size
                ages -= searches - block.cached_at
                self.release(block.segment.address)
            whole = [b for b in whole if searches - b.cached_at < threshold]

    def empty_cache(self) -> None:
        """Release every wholly free segment (expandable: the free pages at its end)."""
        for segment in list(self._segments.values()):
            if not segment.expandable:
                self.release(segment.address)
                continue
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
                else:
                    segment.first = None


def _growable(block: _Block) -> int:
    """A free block's size for the best fit with expandable segments: the free block at
    the end of an expandable segment can grow as large as there is memory."""
    return 1 << 64 if block.segment.expandable and block.next is None else block.size


def _whole(block: _Block) -> bool:
    return block.prev is None and block.next is None and not block.segment.expandable
