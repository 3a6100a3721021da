"""The allocator model under ``PYTORCH_CUDA_ALLOC_CONF`` settings, rule by rule, in exact
bytes: ``max_split_size_mb``, expandable segments' best fit, ``garbage_collection_threshold``;
and the settings read from strings and from snapshots."""

from __future__ import annotations

import pytest

from torchmem.estimator.allocator import FIRST_ADDRESS, CachingAllocator
from torchmem.estimator.settings import Settings, parse, recorded

MIB = 2**20


def test_settings_are_read_from_a_configuration_string() -> None:
    assert parse("") == Settings()
    assert parse(" expandable_segments:True ") == Settings(expandable_segments=True)
    found = parse("max_split_size_mb:64,garbage_collection_threshold:0.6")
    assert found == Settings(False, 64 * MIB, 0.6)
    assert str(found) == "max_split_size_mb:64,garbage_collection_threshold:0.6"
    assert str(parse("expandable_segments:False")) == ""


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ("expandable_segments:yes", "'expandable_segments:yes': expected True or False"),
        ("max_split_size_mb:20", "'max_split_size_mb:20': expected a whole number of MiB over 20"),
        ("max_split_size_mb:1.5", "'max_split_size_mb:1.5': expected a whole number of MiB"),
        ("garbage_collection_threshold:1.5", "'garbage_collection_threshold:1.5': expected a"),
        ("garbage_collection_threshold:x", "'garbage_collection_threshold:x': expected a"),
        ("roundup_power2_divisions:4", "'roundup_power2_divisions:4': the allocator model"),
        ("expandable_segments", "'expandable_segments': expected key:value"),
    ],
)
def test_a_bad_setting_is_named(conf: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^allocator setting {message}"):
        parse(f"{conf},expandable_segments:True")


def test_settings_are_read_from_a_snapshot() -> None:
    """PyTorch writes SIZE_MAX, no limit, as -1; rounding to powers of two (any division
    over 1) is not followed: None."""
    assert recorded(None) == Settings()
    written = {"expandable_segments": False, "max_split_size": -1}
    assert recorded({**written, "garbage_collection_threshold": 0.0}) == Settings()
    assert recorded({**written, "max_split_size": 64 * MIB}) == Settings(max_split_size=64 * MIB)
    assert recorded({**written, "roundup_power2_divisions": {"1": 0, "2": 4}}) is None
    assert recorded({"expandable_segments": "yes"}) is None


def test_a_block_of_max_split_size_or_more_is_never_split() -> None:
    """With max_split_size_mb:64: a request under 64 MiB takes no block of 64 MiB or more,
    and one of 64 MiB or more takes a block only if it is less than 20 MiB larger, whole.

    100 MiB reserved and freed; 30 MiB: a new segment (130 MiB); 90 MiB: the 100 MiB block
    whole (allocated 130 MiB); freed, 70 MiB: 100 >= 70 + 20, a new segment (200 MiB)."""
    allocator = CachingAllocator(max_split_size=64 * MIB)
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(30 * MIB)
    assert allocator.reserved == 130 * MIB
    large = allocator.malloc(90 * MIB)
    assert (large.size, allocator.allocated, allocator.reserved) == (
        100 * MIB,
        130 * MIB,
        130 * MIB,
    )
    allocator.free(large)
    assert allocator.malloc(70 * MIB).size == 70 * MIB
    assert allocator.reserved == 200 * MIB
    # Without the limit the 100 MiB block serves all three, split: 100 MiB reserved.
    unlimited = CachingAllocator()
    unlimited.free(unlimited.malloc(100 * MIB))
    kept = unlimited.malloc(30 * MIB)
    assert unlimited.malloc(60 * MIB).size == 60 * MIB and kept.size == 30 * MIB
    assert unlimited.reserved == 100 * MIB


def test_short_of_memory_oversize_blocks_are_released_first() -> None:
    """Capacity 200 MiB, max_split_size_mb:64: 100 MiB freed (cached), 30 MiB (130 MiB
    reserved); 80 MiB cannot take the 100 MiB block (100 >= 80 + 20) and 130 + 80 > 200:
    the 100 MiB segment is released, then 80 MiB reserved: 110 MiB."""
    allocator = CachingAllocator(200 * MIB, max_split_size=64 * MIB)
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(30 * MIB)
    allocator.malloc(80 * MIB)
    assert (allocator.reserved, allocator.reserved_peak) == (110 * MIB, 130 * MIB)


def test_expandable_best_fit_passes_over_the_growing_end() -> None:
    """One 20 MiB page: 8 MiB at 0, 6 MiB at 8, the free end of 6 MiB at 14. The 8 MiB
    block freed, 5 MiB is served from it (the free end counts as large as it can grow),
    not from the 6 MiB end, which the plain best fit would take."""
    allocator = CachingAllocator(expandable=True)
    first = allocator.malloc(8 * MIB)
    allocator.malloc(6 * MIB)
    assert allocator.reserved == 20 * MIB
    allocator.free(first)
    assert allocator.malloc(5 * MIB).address == FIRST_ADDRESS
    assert allocator.malloc(6 * MIB).address == FIRST_ADDRESS + 14 * MIB
    assert allocator.reserved == 20 * MIB


def test_garbage_collection_releases_the_oldest_cached_segments() -> None:
    """Capacity 100 MiB set as a memory fraction, threshold 0.5 (50 MiB). The large pool's
    searches age the cached blocks: 24 MiB cached at search 1; 30 MiB cached at 2, reused
    and cached again at 3. At search 4 a 40 MiB request finds no block: 54 MiB reserved is
    over 50 by 4; the ages are 3 and 1, their mean 2: the 24 MiB segment goes (24 >= 4),
    and 30 + 40 = 70 MiB is reserved; 94 MiB without the memory fraction."""
    reserved = []
    for capped in (True, False):
        allocator = CachingAllocator(100 * MIB, garbage_collection_threshold=0.5, capped=capped)
        allocator.free(allocator.malloc(24 * MIB))
        allocator.free(allocator.malloc(30 * MIB))
        allocator.free(allocator.malloc(26 * MIB))
        allocator.malloc(40 * MIB)
        reserved.append(allocator.reserved)
    assert reserved == [70 * MIB, 94 * MIB]


def test_the_largest_free_block_at_the_allocated_peak() -> None:
    """8 MiB and 4 MiB from one 20 MiB segment: at the peak of 12 MiB, 20 MiB reserved and
    the segment's free end, 8 MiB, the largest free block. Freed, the 8 MiB block is free
    too, but the peak has passed."""
    allocator = CachingAllocator()
    first = allocator.malloc(8 * MIB)
    allocator.malloc(4 * MIB)
    allocator.free(first)
    allocator.malloc(2 * MIB)
    assert (allocator.allocated_peak, allocator.at_peak) == (12 * MIB, (20 * MIB, 8 * MIB))
