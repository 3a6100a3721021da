"""What other allocator settings would have reserved: allocator histories written by hand
(the dict ``torch.cuda.memory._snapshot()`` returns), each figure derived in its test, and
the five 2.7B snapshots of ``../shared/gpu-truth`` (their extracts)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_allocator_truth import FILES, make_extract

from torchmem.estimator.whatif import what_if
from torchmem.records.whatif import Outcome, WhatIf

MIB = 2**20
S1, S2, S3 = 1 << 32, 2 << 32, 3 << 32


def entry(action: str, address: int, size: int) -> dict[str, Any]:
    return {"action": action, "addr": address, "size": size, "stream": 0}


def segment(address: int, size: int, *blocks: tuple[int, int, str]) -> dict[str, Any]:
    return {
        "device": 0,
        "address": address,
        "total_size": size,
        "stream": 0,
        "segment_type": "large",
        "blocks": [
            {"address": a, "size": n, "requested_size": n, "state": state} for a, n, state in blocks
        ],
    }


def aging(settings: object = None) -> dict[str, Any]:
    """24 MiB reserved, used, freed; 30 MiB reserved, used, freed, used for 26 MiB, freed;
    40 MiB reserved and used: 94 MiB reserved at the peak, 40 MiB allocated."""
    trace = [
        entry("segment_alloc", S1, 24 * MIB),
        entry("alloc", S1, 24 * MIB),
        entry("free_completed", S1, 24 * MIB),
        entry("segment_alloc", S2, 30 * MIB),
        entry("alloc", S2, 30 * MIB),
        entry("free_completed", S2, 30 * MIB),
        entry("alloc", S2, 26 * MIB),
        entry("free_completed", S2, 26 * MIB),
        entry("segment_alloc", S3, 40 * MIB),
        entry("alloc", S3, 40 * MIB),
    ]
    segments = [
        segment(S1, 24 * MIB, (S1, 24 * MIB, "inactive")),
        segment(S2, 30 * MIB, (S2, 30 * MIB, "inactive")),
        segment(S3, 40 * MIB, (S3, 40 * MIB, "active_allocated")),
    ]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": settings}


def test_each_setting_replays_the_requests() -> None:
    """Expandable segments: one segment, 40 MiB mapped for the first 24 MiB (two pages of
    20 MiB), which then serves every request: 40 MiB reserved, not 94. The other settings
    change nothing here (no block of 64 MiB; no memory fraction, so no garbage collection).
    At the allocated peak (40 MiB, the last request) the 24 and 30 MiB segments are free
    cached: 54 MiB reserved but not allocated, the largest free block 30 MiB."""
    found = what_if(aging())
    assert (found.settings, found.allocations, found.reproduced, found.kept) == ("", 4, True, False)
    assert (found.reserved_peak_bytes, found.allocated_peak_bytes) == (94 * MIB, 40 * MIB)
    assert found.today == Outcome("", 94 * MIB, 40 * MIB, 94 * MIB, 30 * MIB)
    assert found.today.fragmentation_bytes == 54 * MIB
    assert [(o.settings, o.reserved_peak_bytes) for o in found.alternatives] == [
        ("expandable_segments:True", 40 * MIB),
        ("max_split_size_mb:64", 94 * MIB),
        ("garbage_collection_threshold:0.6", 94 * MIB),
    ]
    expandable = found.alternatives[0]
    assert (expandable.reserved_at_peak_bytes, expandable.largest_free_at_peak_bytes) == (
        40 * MIB,
        0,
    )


def test_garbage_collection_acts_under_a_memory_fraction() -> None:
    """Allowed 100 MiB, threshold 0.5 (50 MiB): at the 40 MiB request 54 MiB is reserved;
    the 24 MiB segment, cached at the pool's first search, is older than the 30 MiB one
    (used again at the third) and goes: 30 + 40 = 70 MiB. Today's replay under the same
    fraction still reserves the real 94 MiB."""
    found = what_if(aging(), ["garbage_collection_threshold:0.5"], allowed=100 * MIB)
    assert found.reproduced and found.allowed_bytes == 100 * MIB
    assert [(o.settings, o.reserved_peak_bytes) for o in found.alternatives] == [
        ("garbage_collection_threshold:0.5", 70 * MIB)
    ]


def test_no_what_if_where_today_is_not_reproduced() -> None:
    """Allowed 90 MiB: the model frees the cached 54 MiB to serve 40 MiB, where the real
    run reserved 94 MiB: it does not reproduce the history, so it gives no what-if."""
    found = what_if(aging(), allowed=90 * MIB)
    assert not found.reproduced and found.alternatives == ()
    assert found.today is not None and found.today.reserved_peak_bytes == 54 * MIB
    assert found.note == "the model's replay under its settings does not reproduce the real peaks"
    assert found.to_json()["reproduced"] is False


def test_no_what_if_under_settings_not_followed_or_without_a_trace() -> None:
    rounding = {"expandable_segments": False, "roundup_power2_divisions": {"1": 0, "2": 4}}
    found = what_if(aging(rounding))
    assert (found.settings, found.today, found.alternatives) == (None, None, ())
    assert found.note == "it was recorded under allocator settings the model does not follow"
    empty = what_if({**aging(), "device_traces": [[]]})
    assert (empty.settings, empty.today, empty.note) == ("", None, "it has no trace of this device")


def test_a_bad_alternative_is_named() -> None:
    with pytest.raises(ValueError, match=r"^allocator setting 'max_split_size_mb:8'"):
        what_if(aging(), ["expandable_segments:True", "max_split_size_mb:8"])


def test_segments_cached_before_the_trace_are_kept() -> None:
    """A 40 MiB segment holds 10 MiB at the trace's start; the trace frees it and puts
    36 MiB there. Allocated again, 10 MiB would reserve 20 MiB and 36 MiB a segment of its
    own (56 MiB, not the real 40): the start is kept as it was instead, and reproduces."""
    history = {
        "segments": [segment(S1, 40 * MIB, (S1, 36 * MIB, "active_allocated"))],
        "device_traces": [[entry("free_completed", S1, 10 * MIB), entry("alloc", S1, 36 * MIB)]],
    }
    history["segments"][0]["blocks"].append(
        {"address": S1 + 36 * MIB, "size": 4 * MIB, "requested_size": 0, "state": "inactive"}
    )
    found = what_if(history, ["expandable_segments:True"])
    assert (found.reproduced, found.kept, found.reserved_peak_bytes) == (True, True, 40 * MIB)
    assert found.today == Outcome("", 40 * MIB, 36 * MIB, 40 * MIB, 4 * MIB)
    assert [(o.settings, o.reserved_peak_bytes) for o in found.alternatives] == [
        ("expandable_segments:True", 40 * MIB)
    ]


def test_the_json_fields() -> None:
    found = what_if(aging(), ["expandable_segments:True"])
    assert found.to_json() == {
        "device": 0,
        "settings": "",
        "allocations": 4,
        "reserved_peak_bytes": 94 * MIB,
        "allocated_peak_bytes": 40 * MIB,
        "reproduced": True,
        "kept": False,
        "allowed_bytes": None,
        "note": "",
        "today": {
            "settings": "",
            "reserved_peak_bytes": 94 * MIB,
            "allocated_peak_bytes": 40 * MIB,
            "reserved_at_peak_bytes": 94 * MIB,
            "fragmentation_bytes": 54 * MIB,
            "largest_free_at_peak_bytes": 30 * MIB,
            "out_of_memory": False,
        },
        "alternatives": [
            {
                "settings": "expandable_segments:True",
                "reserved_peak_bytes": 40 * MIB,
                "allocated_peak_bytes": 40 * MIB,
                "reserved_at_peak_bytes": 40 * MIB,
                "fragmentation_bytes": 0,
                "largest_free_at_peak_bytes": 0,
                "out_of_memory": False,
            }
        ],
    }


KEPT = {"transformer-2.7b-ctx512-fullstep-fp32.pickle"}
"""The extract whose start, allocated again, does not reproduce its peaks: it starts with
``empty_cache()`` after segments earlier calls of the same process left."""


@pytest.mark.parametrize("name", FILES)
def test_the_real_snapshots_are_reproduced(name: str) -> None:
    """Today's replay of each 2.7B snapshot reserves its real peak: the segments at the
    end (``TRUTH`` of test_allocator_truth) are the peak, nothing is released after it."""
    found = what_if(make_extract.snapshot(make_extract.read(name)))
    assert found.reproduced and found.kept == (name in KEPT) and found.note == ""
    assert found.today is not None and len(found.alternatives) == 3
    assert found.today.reserved_peak_bytes == found.reserved_peak_bytes


def test_a_history_whose_segments_overlap_has_no_what_if() -> None:
    """The trace reserves 30 MiB at 8 MiB into the 20 MiB segment it starts with (and
    releases it again): no allocator does that, and the model refuses it rather than
    replay a history that cannot be."""
    inside = S1 + 8 * MIB
    history = {
        "segments": [segment(S1, 20 * MIB, (S1, 20 * MIB, "active_allocated"))],
        "device_traces": [
            [
                entry("segment_alloc", inside, 30 * MIB),
                entry("alloc", inside, 30 * MIB),
                entry("free_completed", inside, 30 * MIB),
                entry("segment_free", inside, 30 * MIB),
            ]
        ],
    }
    found = what_if(history)
    assert (found.today, found.alternatives, found.reserved_peak_bytes) == (None, (), 50 * MIB)
    assert found.note == f"its segments overlap: 31457280 bytes at {inside:#x} overlap a segment"


def test_the_json_reads_back() -> None:
    """A report saved as JSON (a run's, where a recording carries its what-if) reads back
    as the same record."""
    for found in (what_if(aging()), what_if(aging(), allowed=90 * MIB)):
        assert WhatIf.from_json(json.loads(json.dumps(found.to_json()))) == found
