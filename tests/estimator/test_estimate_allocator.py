"""The model of PyTorch's CUDA caching allocator, rule by rule, in exact bytes."""

from __future__ import annotations

import pytest

from torchmem.estimator.allocator import (
    CachingAllocator,
    OutOfMemory,
    expandable_segments,
    round_size,
    segment_size,
)

MIB = 2**20


@pytest.mark.parametrize(
    ("request_bytes", "rounded"), [(0, 512), (1, 512), (512, 512), (513, 1024), (4000, 4096)]
)
def test_requests_round_to_512_bytes(request_bytes: int, rounded: int) -> None:
    assert round_size(request_bytes) == rounded


@pytest.mark.parametrize(
    ("request_bytes", "segment"),
    [
        (512, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 512, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),
        (11 * MIB, 12 * MIB),
        (12 * MIB + 512, 14 * MIB),
    ],
)
def test_segment_sizes(request_bytes: int, segment: int) -> None:
    assert segment_size(request_bytes) == segment


def test_small_blocks_share_a_segment_and_merge_back() -> None:
    allocator = CachingAllocator()
    a, b = allocator.malloc(1000), allocator.malloc(1000)
    assert (a.size, b.size, allocator.allocated, allocator.reserved) == (1024, 1024, 2048, 2 * MIB)
    allocator.free(a)
    allocator.free(b)
    assert allocator.allocated == 0
    c = allocator.malloc(2 * MIB - 512)  # too large for the small pool: a large segment
    assert allocator.reserved == 22 * MIB and c.size == 2 * MIB - 512
    allocator.free(c)
    d = allocator.malloc(MIB)  # the merged 2 MiB small block serves it; 1 MiB is left
    assert (allocator.reserved, d.size, allocator.allocated_peak) == (22 * MIB, MIB, 2 * MIB - 512)


def test_a_large_remainder_of_one_mib_or_less_is_not_split() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(11 * MIB)  # a 12 MiB segment; 1 MiB would remain: not split
    assert (block.size, allocator.allocated, allocator.reserved) == (12 * MIB, 12 * MIB, 12 * MIB)
    allocator.free(block)
    split = allocator.malloc(10 * MIB)  # 2 MiB would remain: split
    assert (split.size, allocator.allocated) == (10 * MIB, 10 * MIB)


def test_best_fit_takes_the_smallest_free_block() -> None:
    allocator = CachingAllocator()
    big, small = allocator.malloc(40 * MIB), allocator.malloc(12 * MIB)
    allocator.free(big)
    allocator.free(small)
    again = allocator.malloc(11 * MIB)
    assert again.segment is small.segment
    assert allocator.reserved == 52 * MIB


def test_capacity_releases_free_segments_before_running_out() -> None:
    allocator = CachingAllocator(capacity=30 * MIB)
    allocator.free(allocator.malloc(20 * MIB))
    block = allocator.malloc(22 * MIB)  # the free 20 MiB segment goes back first
    assert allocator.reserved == 22 * MIB and block.size == 22 * MIB
    with pytest.raises(OutOfMemory):
        allocator.malloc(10 * MIB)
    assert allocator.reserved_peak == 22 * MIB


def test_expandable_segments_grow_in_pages() -> None:
    allocator = CachingAllocator(expandable=True)
    a = allocator.malloc(3 * MIB)  # large pool: one 20 MiB page
    b = allocator.malloc(30 * MIB)  # 17 MiB free at the end: one more page
    assert allocator.reserved == 40 * MIB
    assert b.address == a.address + a.size
    allocator.free(a)
    allocator.free(b)
    allocator.malloc(35 * MIB)
    assert allocator.reserved == 40 * MIB


def test_expandable_segments_are_read_from_the_configuration() -> None:
    assert expandable_segments("expandable_segments:True")
    assert expandable_segments("max_split_size_mb:128, expandable_segments:True")
    assert not expandable_segments("expandable_segments:False")
    assert not expandable_segments("")
