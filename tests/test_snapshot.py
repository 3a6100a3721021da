"""Memory snapshots: loading never runs code from the file, and every number of a
hand-built snapshot is exact to the byte."""

from __future__ import annotations

import builtins
import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torchmem
from standins import KiB, MiB
from torchmem.errors import SnapshotError, TorchmemError
from torchmem.records.run import Site
from torchmem.snapshot import BEFORE_TRACE, NO_FRAMES, Snapshot, load_snapshot

pytestmark = pytest.mark.integration

A = 0x7F0000000000
"""The address of the first segment."""
B = A + 0x10000000


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


TORCH_FRAME = frame("/usr/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear")
FORWARD = frame("/home/me/train.py", 12, "forward")
MAIN = frame("/home/me/train.py", 20, "main")
BIG = frame("/home/me/train.py", 30, "big")


def event(action: str, addr: int, size: int, seconds: float, *frames: dict[str, Any]) -> Any:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "time_us": int(seconds * 1_000_000),
        "frames": list(frames),
    }


def snapshot_dict() -> dict[str, Any]:
    """In PyTorch's format (``torch.cuda._memory_viz`` reads it), optional keys left out
    where older PyTorch left them out. Device 0: two segments, 12M reserved, 6M
    allocated, 1M freed but pending; a trace that starts mid-run (its first entry frees
    3M allocated before it) and runs out of memory. Device 1: one segment, 512K
    allocated without frames, no trace."""
    return {
        "segments": [
            {
                "device": 0,
                "address": A,
                "total_size": 8 * MiB,
                "allocated_size": 4 * MiB,
                "active_size": 5 * MiB,
                "requested_size": 4 * MiB,
                "stream": 0,
                "segment_type": "large",
                "frames": [],
                "blocks": [
                    {
                        "address": A,
                        "size": 4 * MiB,
                        "requested_size": 4 * MiB,
                        "state": "active_allocated",
                        "frames": [TORCH_FRAME, FORWARD],
                    },
                    {"address": A + 4 * MiB, "size": MiB, "state": "inactive"},
                    {
                        "address": A + 5 * MiB,
                        "size": MiB,
                        "requested_size": MiB,
                        "state": "active_pending_free",
                        "frames": [MAIN],
                    },
                    {"address": A + 6 * MiB, "size": 2 * MiB, "state": "inactive"},
                ],
            },
            {  # an older snapshot's segment: no segment_type, blocks without addresses
                "device": 0,
                "address": B,
                "total_size": 4 * MiB,
                "stream": 0,
                "blocks": [
                    {
                        "size": 2 * MiB,
                        "state": "active_allocated",
                        "history": [{"addr": B, "real_size": 2 * MiB, "frames": [MAIN]}],
                    },
                    {"size": 2 * MiB, "state": "inactive"},
                ],
            },
            {
                "device": 1,
                "address": A,
                "total_size": 2 * MiB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": A,
                        "size": 512 * KiB,
                        "requested_size": 500 * KiB,
                        "state": "active_allocated",
                        "frames": [],
                    },
                    {"address": A + 512 * KiB, "size": 1536 * KiB, "state": "inactive"},
                ],
            },
        ],
        "device_traces": [
            [
                event("free_completed", A + 0x20000000, 3 * MiB, 10.0),  # allocated before
                event("alloc", B, 2 * MiB, 10.5, TORCH_FRAME, MAIN),
                event("alloc", A + 0x30000000, 6 * MiB, 11.0, BIG),
                event("free_requested", A + 0x30000000, 6 * MiB, 11.25),
                event("free_completed", A + 0x30000000, 6 * MiB, 11.25),
                {**event("oom", 0, 6 * MiB, 12.0), "device_free": MiB},
            ],
            [],
        ],
    }


@pytest.fixture
def snapshot_file(tmp_path: Path) -> Path:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot_dict()))
    return path


def torchmem_snapshot(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torchmem", "snapshot", *words]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


# -- nothing from the file runs -------------------------------------------------------------


class RunsAShellCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return os.system, (f"touch {self.marker}",)


class Evaluates:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",)


def test_the_fixtures_payloads_do_run_when_unpickled_plainly(tmp_path: Path) -> None:
    """The refusals below mean something: these pickles run their payload elsewhere."""
    for payload in (RunsAShellCommand(tmp_path / "a"), Evaluates(tmp_path / "b")):
        pickle.loads(pickle.dumps(payload))
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("payload", "asks_for"),
    [(RunsAShellCommand, f"{os.system.__module__}.system"), (Evaluates, "builtins.eval")],
)
def test_a_pickle_that_would_run_code_is_refused(
    tmp_path: Path, payload: type, asks_for: str
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[payload(marker)]]}))
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    assert str(caught.value) == (
        f"refused to load {path}: it asks for {asks_for}, and a snapshot holds plain data"
        " only; nothing from it was run"
    )
    assert isinstance(caught.value, TorchmemError)
    assert not marker.exists()


def test_a_persistent_id_is_refused(tmp_path: Path) -> None:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "outside" if obj == "the data" else None

    path = tmp_path / "snapshot.pickle"
    with path.open("wb") as file:
        Pickler(file).dump({"segments": ["the data"]})
    with pytest.raises(SnapshotError, match=r"it asks for a persistent object 'outside', and"):
        load_snapshot(path)


def test_the_command_refuses_it_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps(RunsAShellCommand(marker)))
    done = torchmem_snapshot("evil.pickle", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"torchmem snapshot: error: refused to load evil.pickle: it asks for"
        f" {os.system.__module__}.system, and a snapshot holds plain data only; nothing from"
        " it was run\n"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"not a pickle at all\n", "evil.pickle is not a pickle: "),
        (pickle.dumps([1, 2]), "evil.pickle is not a memory snapshot: it holds a list, not a dict"),
        (
            pickle.dumps({"x": 1}),
            "evil.pickle is not a memory snapshot: it has no list of 'segments'",
        ),
        (
            pickle.dumps({"segments": [{"address": 0, "total_size": 1, "blocks": [{"size": 1}]}]}),
            "evil.pickle is not a memory snapshot: segment 0, block 0 has no 'state'",
        ),
        (
            pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": "1"}]]}),
            "evil.pickle is not a memory snapshot: entry 0 of the trace of device 0 has a bad"
            " 'size'",
        ),
    ],
)
def test_what_is_not_a_snapshot_is_named(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    assert str(caught.value).replace(str(path), "evil.pickle").startswith(why)
    done = torchmem_snapshot("evil.pickle", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith(f"torchmem snapshot: error: {why}")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_missing_file_and_a_bad_top_end_the_command(tmp_path: Path) -> None:
    done = torchmem_snapshot("nothing.pickle", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        1,
        "torchmem snapshot: error: cannot read nothing.pickle: No such file or directory\n",
    )
    for words, why in [
        (("--top", "0", "nothing.pickle"), "--top must be at least 1, not 0"),
        (("diff", "a.pickle"), "diff compares two snapshots: diff A B"),
        (("--html", "o.html", "diff", "a", "b"), "--html shows one snapshot, not a diff"),
        (("a.pickle", "b.pickle"), "one snapshot at a time (or diff A B), not 2"),
    ]:
        done = torchmem_snapshot(*words, cwd=tmp_path)
        assert (done.returncode, done.stderr) == (2, f"torchmem snapshot: error: {why}\n")


# -- the numbers ----------------------------------------------------------------------------


def test_totals_are_exact_per_device(snapshot_file: Path) -> None:
    snap = load_snapshot(snapshot_file)
    assert snap.source == str(snapshot_file)
    assert list(snap.devices) == [0, 1]
    zero, one = snap.devices[0], snap.devices[1]
    assert (zero.allocated_bytes, zero.active_bytes, zero.reserved_bytes) == (
        6 * MiB,
        7 * MiB,
        12 * MiB,
    )
    assert (one.allocated_bytes, one.active_bytes, one.reserved_bytes) == (
        512 * KiB,
        512 * KiB,
        2 * MiB,
    )
    assert (snap.allocated_bytes, snap.active_bytes, snap.reserved_bytes) == (
        6 * MiB + 512 * KiB,
        7 * MiB + 512 * KiB,
        14 * MiB,
    )
    assert zero.sites == (
        Site("/home/me/train.py", 12, "forward", 4 * MiB),
        Site("/home/me/train.py", 20, "main", 2 * MiB),
    )
    assert one.sites == (Site(NO_FRAMES, 0, "", 512 * KiB),)


def test_fragmentation_per_segment(snapshot_file: Path) -> None:
    first, second = load_snapshot(snapshot_file).devices[0].segments
    assert (first.address, first.total_bytes, first.segment_type) == (A, 8 * MiB, "large")
    assert (first.allocated_bytes, first.active_bytes) == (4 * MiB, 5 * MiB)
    assert (first.free_bytes, first.largest_free_bytes) == (3 * MiB, 2 * MiB)
    assert (second.address, second.total_bytes, second.segment_type) == (B, 4 * MiB, None)
    assert (second.free_bytes, second.largest_free_bytes) == (2 * MiB, 2 * MiB)
    assert [(b.address, b.bytes, b.state) for b in second.blocks] == [
        (B, 2 * MiB, "active_allocated"),
        (B + 2 * MiB, 2 * MiB, "inactive"),
    ]


def test_the_peak_of_a_trace_that_starts_mid_run(snapshot_file: Path) -> None:
    """The replay ends at the 7M active (6M allocated + 1M pending free); its changes add
    up to -3M + 2M + 6M - 6M = -1M, so the trace starts at 8M and peaks at 8M - 3M + 2M
    + 6M = 13M, 1s after its first entry."""
    zero = load_snapshot(snapshot_file).devices[0]
    assert (zero.peak_bytes, zero.peak_time, zero.duration) == (13 * MiB, 1.0, 2.0)
    assert zero.sites_at_peak == (
        Site("/home/me/train.py", 30, "big", 6 * MiB),
        Site(BEFORE_TRACE, 0, "", 5 * MiB),
        Site("/home/me/train.py", 20, "main", 2 * MiB),
    )
    assert zero.timeline == (
        (0.4, 8 * MiB),
        (0.8, 7 * MiB),
        (1.2, 13 * MiB),
        (1.6, 13 * MiB),
        (2.0, 7 * MiB),
    )
    one = load_snapshot(snapshot_file).devices[1]
    assert (one.peak_bytes, one.peak_time, one.timeline, one.oom) == (None, None, (), None)


def test_the_oom_event_against_the_largest_free_block(snapshot_file: Path) -> None:
    oom = load_snapshot(snapshot_file).devices[0].oom
    assert oom is not None
    assert (oom.requested_bytes, oom.largest_free_bytes, oom.device_free_bytes, oom.time) == (
        6 * MiB,
        2 * MiB,
        MiB,
        2.0,
    )


def test_a_long_trace_keeps_at_most_2000_exact_intervals() -> None:
    data = {"segments": [], "device_traces": [[]]}
    for i in range(5000):
        data["device_traces"][0] += [
            event("alloc", 4096, 512 + i, i / 1000),
            event("free_completed", 4096, 512 + i, i / 1000 + 0.0005),
        ]
    zero = Snapshot.from_dict(data).devices[0]
    assert len(zero.timeline) == 2000
    block = 5632  # the largest request, 512 + 4999 bytes, in a block: a multiple of 512
    assert zero.peak_bytes == max(size for _, size in zero.timeline) == block
    assert zero.timeline[-1] == (pytest.approx(4.9995), block)


def test_a_site_is_the_innermost_frame_of_the_users_code() -> None:
    """PyTorch, Python's standard library, installed packages and C++ frames are passed
    over, by their paths on the machine that took the snapshot; without a user frame, the
    innermost installed package's frame, else the innermost Python frame, names it."""
    frames = [
        frame("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
        frame("/opt/conda/lib/python3.10/site-packages/torch/nn/modules/linear.py", 125, "f"),
        frame("/opt/conda/lib/python3.10/runpy.py", 86, "_run_code"),
        frame("", 0, "unknown"),
        frame("/opt/conda/lib/python3.10/site-packages/mylib/layers.py", 3, "build"),
        frame("/home/me/train.py", 5, "<module>"),
    ]
    block = {"size": 512, "requested_size": 512, "state": "active_allocated", "frames": frames}
    data = {"segments": [{"address": 0, "total_size": 512, "blocks": [block]}]}
    python = tuple((f["filename"], f["line"], f["name"]) for f in frames if f["line"])
    (site,) = Snapshot.from_dict(data).devices[0].sites
    assert (site, site.stack) == (Site("/home/me/train.py", 5, "<module>", 512), python)
    block["frames"] = frames[:5]
    assert Snapshot.from_dict(data).devices[0].sites == (Site(*python[2], 512),)
    block["frames"] = frames[:4]
    assert Snapshot.from_dict(data).devices[0].sites == (Site(*python[0], 512),)


def test_pytorchs_own_reader_takes_the_hand_built_snapshot() -> None:
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    summary = memory_viz.segsum(snapshot_dict())
    assert "total_reserved: 14.0MiB\ntotal_allocated: 6.5MiB\n" in summary


def test_a_snapshot_from_memory_and_the_exports(snapshot_file: Path) -> None:
    assert Snapshot.from_dict(snapshot_dict()) == Snapshot(load_snapshot(snapshot_file).devices)
    assert torchmem.load_snapshot is load_snapshot
    assert torchmem.SnapshotError is SnapshotError
    assert torchmem.Snapshot is Snapshot


# -- the reports ----------------------------------------------------------------------------


def test_a_snapshot_without_a_trace_or_without_anything() -> None:
    assert str(Snapshot.from_dict({"segments": []}, "e.pickle")) == (
        "torchmem: memory snapshot of e.pickle\n\nThe snapshot holds no segments and no trace."
    )
    untraced = snapshot_dict()
    del untraced["device_traces"]
    lines = str(Snapshot.from_dict(untraced)).splitlines()
    assert lines[:7] == [
        "torchmem: memory snapshot",
        "",
        "device  allocated   active  reserved  peak  at",
        "cuda:0      6.00M    7.00M    12.00M     -   -",
        "cuda:1    512.00K  512.00K     2.00M     -   -",
        "The snapshot has no trace: no peak.",
        "",
    ]
    assert lines[7:10] == [
        "Allocation sites in use at the snapshot on cuda:0:",
        "  4.00M  /home/me/train.py:12  forward",
        "  2.00M  /home/me/train.py:20  main",
    ]
    assert not any(line.startswith("Out of memory") for line in lines)


REPORT = """\
torchmem: memory snapshot of snapshot.pickle

device  allocated   active  reserved    peak     at
cuda:0      6.00M    7.00M    12.00M  13.00M  1.00s
cuda:1    512.00K  512.00K     2.00M       -      -

Allocation sites alive at the peak on cuda:0:
  6.00M  /home/me/train.py:30  big
  5.00M  <before the trace>
  ... and 1 more site

Segments on cuda:0, largest first:
  address          size  active   free  largest free  blocks
  0x7f0000000000  8.00M   5.00M  3.00M         2.00M       4
  0x7f0010000000  4.00M   2.00M  2.00M         2.00M       2

Out of memory on cuda:0 at 2.00s: asked for 6.00M; the largest free block was 2.00M; \
the device had 1.00M free.

Allocation sites in use at the snapshot on cuda:1:
  512.00K  <no frames>

Segments on cuda:1, largest first:
  address          size   active   free  largest free  blocks
  0x7f0000000000  2.00M  512.00K  1.50M         1.50M       2
"""


def test_the_command_prints_the_report(snapshot_file: Path) -> None:
    words = ("--top", "2", "--json", "out.json", "--html", "page.html", snapshot_file.name)
    done = torchmem_snapshot(*words, cwd=snapshot_file.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout == REPORT
    page = (snapshot_file.parent / "page.html").read_text()
    assert "<title>torchmem: memory snapshot of snapshot.pickle</title>" in page
    assert "peak 13.00M at 1.00s" in page
    data = json.loads((snapshot_file.parent / "out.json").read_text())
    expected = load_snapshot(snapshot_file).to_json() | {"source": "snapshot.pickle"}
    assert data == json.loads(json.dumps(expected))
    assert data["devices"]["0"]["peak_bytes"] == 13 * MiB


def test_the_html_page_fetches_nothing(snapshot_file: Path, tmp_path: Path) -> None:
    snap = load_snapshot(snapshot_file)
    out = tmp_path / "page.html"
    snap.save_html(out)
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")
    assert "http" not in page and "<script" not in page.lower() and "url(" not in page
    assert page.count("<svg") == 3  # the timeline of device 0, a segment map per device
    assert page.count("active_allocated at") == 3  # the tooltips of the allocated blocks
    assert "13.00M" in snap._repr_html_()


def test_diff_of_two_snapshots(tmp_path: Path) -> None:
    later = copy.deepcopy(snapshot_dict())
    later["segments"][1]["blocks"][0]["state"] = "inactive"
    later["segments"].append(
        {
            "device": 0,
            "address": B + 0x10000000,
            "total_size": 20 * MiB,
            "stream": 0,
            "blocks": [
                {
                    "size": 16 * MiB,
                    "state": "active_allocated",
                    "frames": [frame("/home/me/train.py", 40, "grow")],
                },
                {"size": 4 * MiB, "state": "inactive"},
            ],
        }
    )
    diff = Snapshot.from_dict(snapshot_dict(), "a.pickle").diff(
        Snapshot.from_dict(later, "b.pickle")
    )
    assert diff.totals == {
        "allocated": (6 * MiB + 512 * KiB, 20 * MiB + 512 * KiB),
        "active": (7 * MiB + 512 * KiB, 21 * MiB + 512 * KiB),
        "reserved": (14 * MiB, 34 * MiB),
    }
    assert [
        (s.file, s.line, s.before_bytes, s.after_bytes, s.change_bytes) for s in diff.sites
    ] == [
        ("/home/me/train.py", 40, 0, 16 * MiB, 16 * MiB),
        ("/home/me/train.py", 20, 2 * MiB, 0, -2 * MiB),
    ]
    assert str(diff) == (
        "torchmem: snapshot diff a.pickle -> b.pickle\n"
        "\n"
        "           before   after   change\n"
        "allocated   6.50M  20.50M  +14.00M\n"
        "active      7.50M  21.50M  +14.00M\n"
        "reserved   14.00M  34.00M  +20.00M\n"
        "\n"
        "Allocation sites that changed most:\n"
        "  +16.00M  /home/me/train.py:40  grow  0.00B -> 16.00M\n"
        "   -2.00M  /home/me/train.py:20  main   2.00M -> 0.00B"
    )
    assert diff.to_json()["totals"]["reserved"] == {
        "before_bytes": 14 * MiB,
        "after_bytes": 34 * MiB,
        "change_bytes": 20 * MiB,
    }
    (tmp_path / "a.pickle").write_bytes(pickle.dumps(snapshot_dict()))
    (tmp_path / "b.pickle").write_bytes(pickle.dumps(later))
    done = torchmem_snapshot("diff", "a.pickle", "b.pickle", "--top", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-3:] == [
        "Allocation sites that changed most:",
        "  +16.00M  /home/me/train.py:40  grow  0.00B -> 16.00M",
        "  ... and 1 more site",
    ]


def test_to_dataframe_one_row_per_segment(snapshot_file: Path) -> None:
    pytest.importorskip("pandas")
    frame_ = load_snapshot(snapshot_file).to_dataframe()
    assert list(frame_.columns) == [
        "device",
        "address",
        "total_bytes",
        "allocated_bytes",
        "active_bytes",
        "free_bytes",
        "largest_free_bytes",
        "blocks",
        "stream",
        "segment_type",
    ]
    assert frame_["total_bytes"].tolist() == [8 * MiB, 4 * MiB, 2 * MiB]
    assert frame_["free_bytes"].tolist() == [3 * MiB, 2 * MiB, 1536 * KiB]
    assert frame_["largest_free_bytes"].tolist() == [2 * MiB, 2 * MiB, 1536 * KiB]
    assert frame_["device"].tolist() == ["cuda:0", "cuda:0", "cuda:1"]


@pytest.mark.cuda
def test_a_real_snapshot_adds_up(tmp_path: Path) -> None:
    """Sizes that are multiples of 512 bytes, so that the allocator's rounding does not
    show; the trace starts after earlier tests allocated, which the anchoring absorbs."""
    import torch

    memory = torch.cuda.memory
    path = tmp_path / "real.pickle"
    memory._record_memory_history(stacks="python")
    try:
        kept = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # KEPT_LINE
        dropped = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        del dropped
        memory._dump_snapshot(str(path))
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    finally:
        memory._record_memory_history(enabled=None)
    device = load_snapshot(path).devices[torch.cuda.current_device()]
    assert (device.allocated_bytes, device.reserved_bytes) == (allocated, reserved)
    assert device.peak_bytes == allocated + 8 * MiB
    kept_line = (
        Path(__file__)
        .read_text()
        .splitlines()
        .index('        kept = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # KEPT_LINE')
    )
    assert Site(__file__, kept_line + 1, "test_a_real_snapshot_adds_up", 4 * MiB) in device.sites
    del kept


def test_the_readmes_sample_is_this_report() -> None:
    section = (Path(__file__).resolve().parent.parent / "docs" / "snapshots.md").read_text()
    sample = section.split("$ torchmem snapshot snapshot.pickle --top 2\n", 1)[1]
    assert sample.split("```", 1)[0] == REPORT


def test_the_command_in_process(
    snapshot_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command through ``main``, for the errors that end it and each output."""
    from torchmem.cli import main

    out = tmp_path / "out"
    assert main(["snapshot", "--top", "2", "--json", f"{out}.json", str(snapshot_file)]) == 0
    assert capsys.readouterr().out.endswith(REPORT.rsplit("\n\n", 1)[1])
    assert json.loads(Path(f"{out}.json").read_text())["devices"]["0"]["peak_bytes"] == 13 * MiB
    later = tmp_path / "later.pickle"
    later.write_bytes(pickle.dumps(snapshot_dict()))
    assert (
        main(["snapshot", "diff", "--json", f"{out}.diff.json", str(snapshot_file), str(later)])
        == 0
    )
    assert json.loads(Path(f"{out}.diff.json").read_text())["sites"] == []
    capsys.readouterr()
    for words, code, message in [
        (["--top", "0", str(snapshot_file)], 2, "--top must be at least 1, not 0"),
        ([], 2, "nothing to read: give a snapshot PATH, or diff A B"),
        (["diff", str(snapshot_file)], 2, "diff compares two snapshots: diff A B"),
        (["--html", "x.html", "diff", "a", "b"], 2, "--html shows one snapshot, not a diff"),
        (["a", "b"], 2, "one snapshot at a time (or diff A B), not 2"),
        ([str(tmp_path / "none.pickle")], 1, f"cannot read {tmp_path / 'none.pickle'}:"),
    ]:
        assert main(["snapshot", *words]) == code, words
        err = capsys.readouterr().err
        assert err.startswith(f"torchmem snapshot: error: {message}"), err
        assert err.count("\n") == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_as_it_was(snapshot_file: Path, enabled: bool) -> None:
    import gc

    (gc.enable if enabled else gc.disable)()
    try:
        load_snapshot(snapshot_file)
        assert gc.isenabled() is enabled
        with pytest.raises(SnapshotError):
            Snapshot.from_dict({"segments": 3})
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_a_trace_without_times_places_its_peak_by_entry() -> None:
    """No "at 0.00s" and no one-point timeline: the peak is "entry N of M" (counted from
    1), the timeline runs over entry numbers, and so does the out-of-memory event."""
    data = snapshot_dict()
    for entry in data["device_traces"][0]:
        del entry["time_us"]
    zero = Snapshot.from_dict(data).devices[0]
    assert (zero.timed, zero.peak_time, zero.duration) == (False, None, 0.0)
    assert (zero.peak_bytes, zero.peak_entry, zero.entries) == (13 * MiB, 3, 6)
    assert zero.timeline == (  # five intervals of the six entries, each ending on one
        (2, 8 * MiB),  # the start's 8M, then -3M, +2M
        (3, 13 * MiB),
        (4, 13 * MiB),  # entry 4 requests the free, entry 5 completes it
        (5, 13 * MiB),
        (6, 7 * MiB),
    )
    assert zero.oom is not None and zero.oom.entry == 6
    lines = str(Snapshot.from_dict(data)).splitlines()
    assert lines[2:4] == [
        "device  allocated   active  reserved    peak            at",
        "cuda:0      6.00M    7.00M    12.00M  13.00M  entry 3 of 6",
    ]
    assert lines[16].startswith("Out of memory on cuda:0 at entry 6 of 6: asked for 6.00M;")
    found = Snapshot.from_dict(data).to_json()["devices"]["0"]
    assert {k: found[k] for k in ("timed", "peak_time_s", "duration_s", "peak_entry")} == {
        "timed": False,
        "peak_time_s": None,
        "duration_s": None,
        "peak_entry": 3,
    }
    assert found["entries"] == 6 and found["oom"]["entry"] == 6
    assert found["timeline"] == [[end, size] for end, size in zero.timeline]
    assert "<svg" in Snapshot.from_dict(data)._repr_html_()  # the segment map; no time chart


def test_the_peak_counts_blocks_not_requests() -> None:
    """A 19M request takes a whole new 20M segment (1M would remain: too little to split
    off in the large pool), a 1,000-byte one a block of 1,024: the peak is 20M + 1,024
    bytes, as max_memory_allocated() counts, not the 19M + 1,000 requested."""
    big, small = 0x7F0000000000, 0x7F0002000000
    data = {
        "segments": [
            {
                "device": 0,
                "address": big,
                "total_size": 20 * MiB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [{"address": big, "size": 20 * MiB, "state": "inactive"}],
            },
            {
                "device": 0,
                "address": small,
                "total_size": 2 * MiB,
                "stream": 0,
                "segment_type": "small",
                "blocks": [
                    {"address": small, "size": 1024, "state": "active_allocated", "frames": []},
                    {"address": small + 1024, "size": 2 * MiB - 1024, "state": "inactive"},
                ],
            },
        ],
        "device_traces": [
            [
                event("segment_alloc", big, 20 * MiB, 1.0),
                event("alloc", big, 19 * MiB, 1.0, BIG),
                event("segment_alloc", small, 2 * MiB, 2.0),
                event("alloc", small, 1000, 2.0, FORWARD),
                event("free_requested", big, 19 * MiB, 3.0),
                event("free_completed", big, 19 * MiB, 3.0),
            ]
        ],
    }
    zero = Snapshot.from_dict(data).devices[0]
    assert (zero.peak_bytes, zero.peak_time, zero.active_bytes) == (20 * MiB + 1024, 1.0, 1024)
    assert zero.sites_at_peak == (
        Site("/home/me/train.py", 30, "big", 20 * MiB),
        Site("/home/me/train.py", 12, "forward", 1024),
    )
    assert max(size for _, size in zero.timeline) == 20 * MiB + 1024
