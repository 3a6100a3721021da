"""Real GPU traces, replayed: the caching-allocator model reproduces every allocation's
address and every new segment of five real CUDA memory snapshots, and the snapshot reader's
peak in block bytes is the real one, to the byte.

The snapshots (a 2.7B-parameter Transformer LM on an 80 GB GPU; ``../shared/gpu-truth``,
its README gives the workload and the facts below) are kept here as compact extracts
(``tests/data/gpu_truth``, made by its ``make_extract.py``): the segments and blocks at the
end and every trace entry's action, address, bytes and stream, without frames or times.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from torchmem.estimator.allocator import Layout
from torchmem.estimator.replay import Action, replay, start_layout
from torchmem.records.caching import KINDS, block_bytes, round_size, trace_blocks
from torchmem.snapshot import Snapshot, _Unpickler

HERE = Path(__file__).resolve().parents[1]  # tests/
SHARED = Path(__file__).resolve().parents[3] / "shared" / "gpu-truth"
_spec = importlib.util.spec_from_file_location(
    "make_extract", HERE / "data/gpu_truth/make_extract.py"
)
assert _spec is not None and _spec.loader is not None
make_extract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_extract)

TRUTH = {
    # file: (peak allocated, reserved at the end, segments, trace entries), from the README
    # of ../shared/gpu-truth, in block bytes
    "transformer-2.7b-ctx128-forward-fp32.pickle": (19_498_420_224, 19_667_091_456, 516, 4_657),
    "transformer-2.7b-ctx128-fullstep-fp32.pickle": (55_079_000_576, 61_111_009_280, 1_010, 19_770),
    "transformer-2.7b-ctx128-forward-bf16autocast.pickle": (
        24_024_505_344,
        24_245_174_272,
        688,
        5_992,
    ),
    "transformer-2.7b-ctx512-forward-fp32.pickle": (43_810_334_720, 44_715_474_944, 658, 5_265),
    "transformer-2.7b-ctx512-fullstep-fp32.pickle": (55_003_351_552, 62_830_673_920, 820, 19_936),
}
FILES = sorted(TRUTH)
WHOLE = {
    # file: allocations whose block is a whole free stretch, larger than the request rounded
    # (1 MiB or less would have remained), and the bytes they add
    "transformer-2.7b-ctx128-forward-fp32.pickle": (343, 185_040_896),
    "transformer-2.7b-ctx128-fullstep-fp32.pickle": (947, 574_128_128),
    "transformer-2.7b-ctx128-forward-bf16autocast.pickle": (124, 65_011_712),
    "transformer-2.7b-ctx512-forward-fp32.pickle": (0, 0),
    "transformer-2.7b-ctx512-fullstep-fp32.pickle": (1, 360_448),
}


def layouts(data: dict[str, Any]) -> list[Layout]:
    """The snapshot's segments, each with its blocks in use."""
    return [
        Layout(
            s["address"],
            s["total_size"],
            s["stream"],
            s["segment_type"] == "small",
            tuple((b["address"], b["size"]) for b in s["blocks"] if b["state"] != "inactive"),
            s.get("is_expandable", False),
        )
        for s in data["segments"]
    ]


def actions(data: dict[str, Any]) -> list[Action]:
    return [
        Action(e["action"], e["addr"], e["size"], e["stream"]) for e in data["device_traces"][0]
    ]


@pytest.mark.parametrize("name", FILES)
def test_the_model_reproduces_every_address_and_segment(name: str) -> None:
    data = make_extract.snapshot(make_extract.read(name))
    end, trace = layouts(data), actions(data)
    peak, reserved, segments, entries = TRUTH[name]
    assert len(trace) == entries
    done = replay(start_layout(end, trace), trace)
    assert done.mismatches == ()
    assert done.differences == 0
    assert done.allocations == sum(a.action == "alloc" for a in trace)
    assert done.segment_allocs == sum(a.action == "segment_alloc" for a in trace)
    assert sorted(done.end) == sorted(end)  # every segment and block in use at the snapshot
    assert sum(s.size for s in done.end) == reserved and len(done.end) == segments
    assert done.allocated_peak == peak


@pytest.mark.parametrize("name", FILES)
def test_the_snapshot_peak_is_the_block_byte_replay(name: str) -> None:
    """The extract has no times: the peak is placed by its entry."""
    device = Snapshot.from_dict(make_extract.snapshot(make_extract.read(name))).devices[0]
    peak, reserved, segments, entries = TRUTH[name]
    assert (device.peak_bytes, device.reserved_bytes, len(device.segments)) == (
        peak,
        reserved,
        segments,
    )
    assert not device.timed and device.peak_time is None and device.entries == entries
    assert device.peak_entry is not None and 0 < device.peak_entry <= entries
    assert max(b for _, b in device.timeline) == peak
    assert sum(s.bytes for s in device.sites_at_peak) == peak


@pytest.mark.parametrize("name", FILES)
def test_the_blocks_from_addresses_are_the_models(name: str) -> None:
    """The snapshot reader's blocks (from addresses) are the ones the model chooses."""
    data = make_extract.snapshot(make_extract.read(name))
    end, trace = layouts(data), actions(data)
    events = [(KINDS[a.action], a.address, a.size, 0, 0) for a in trace if a.action in KINDS]
    blocks = trace_blocks(
        [(s.address, s.size) for s in end],
        [b for s in end for b in s.used],
        events,
    )
    allocated = [b for b, e in zip(blocks, events, strict=True) if e[0] == 0]
    assert allocated == list(replay(start_layout(end, trace), trace).blocks)
    requested = [e[2] for e in events if e[0] == 0]
    whole = [(b, round_size(r)) for b, r in zip(allocated, requested, strict=True)]
    whole = [(b, r) for b, r in whole if b != r]
    assert (len(whole), sum(b - r for b, r in whole)) == WHOLE[name]


def test_a_block_is_the_stretch_it_starts_where_too_little_would_remain() -> None:
    mib = 2**20
    assert block_bytes(1000, 4 * mib) == 1024  # small pool: at least 512 remain, split
    assert block_bytes(3 * mib, 4 * mib) == 4 * mib  # large: 1 MiB would remain, not split
    assert block_bytes(3 * mib, 4 * mib + 512) == 3 * mib  # more than 1 MiB remains: split
    assert block_bytes(3 * mib, None) == block_bytes(3 * mib, mib) == 3 * mib  # unknown room


def test_a_trace_that_starts_mid_run_is_rewound_to_its_start() -> None:
    """A block allocated before the trace and freed in it, a segment released in it and one
    reserved in it: the start has the released one, not the new one, and the freed block
    as large as the room it leaves; the new segment's block is all of it (not split: 1 MiB
    would remain)."""
    mib, a, b, c = 2**20, 1 << 32, 2 << 32, 3 << 32
    end = [
        Layout(a, 20 * mib, 0, False, ((a + 4 * mib, 2 * mib),)),
        Layout(c, 20 * mib, 0, False, ()),
    ]
    trace = [
        Action("free_requested", a, 3 * mib),
        Action("free_completed", a, 3 * mib),
        Action("segment_free", b, 2 * mib),
        Action("segment_alloc", c, 20 * mib),
        Action("alloc", c, 19 * mib),
        Action("free_completed", c, 19 * mib),
    ]
    start = start_layout(end, trace)
    assert start == [
        Layout(a, 20 * mib, 0, False, ((a, 4 * mib), (a + 4 * mib, 2 * mib))),
        Layout(b, 2 * mib, 0, True, ()),
    ]
    done = replay(start, trace)
    assert done.mismatches == () and done.blocks == (20 * mib,)
    assert sorted(done.end) == sorted(end)


def test_a_replay_names_where_the_model_differs() -> None:
    mib, a = 2**20, 1 << 32
    trace = [
        Action("segment_alloc", a, 20 * mib),
        Action("alloc", a + 2 * mib, 2 * mib),  # the model puts it at the segment's start
        Action("alloc", a + 5 * mib, 19 * mib),  # the model wants a new segment
        Action("free_completed", a + 9 * mib, 1),  # nothing there
        Action("segment_free", a, 20 * mib),  # not free
    ]
    done = replay([], trace)
    assert done.differences == 5
    assert done.mismatches == (
        f"entry 1: 2097152 bytes allocated at {a:#x}, not {a + 2 * mib:#x}",
        "entry 2: the model reserves a segment of 20971520 bytes, the trace does not",
        f"entry 2: 19922944 bytes allocated at {1 << 40:#x}, not {a + 5 * mib:#x}",
        f"entry 3: a free at {a + 9 * mib:#x}, where the model has no block in use",
        f"entry 4: the trace releases the segment at {a:#x}, the model cannot",
    )


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"the real snapshots are not here ({SHARED})")
@pytest.mark.parametrize("name", FILES)
def test_the_extract_is_the_real_snapshots(name: str) -> None:
    """The stored extract is what make_extract.py makes of the real file, and the reader
    gives the real file (with frames and times) the same peak."""
    path = SHARED / name
    with path.open("rb") as file:
        data = _Unpickler(file, str(path)).load()
    assert make_extract.extract(data) == make_extract.read(name)
    device = Snapshot.from_dict(data, name).devices[0]
    assert device.timed and device.peak_bytes == TRUTH[name][0]
    assert device.entries == TRUTH[name][3]
