"""PyTorch's CUDA allocator history, shared between torchmem's recordings and the program's
own use of it: the program keeps its settings and its snapshot, and a recording keeps what
it needs or says what it lost. The wiring runs on :class:`standins.HistoryStandIn`; the
real history is checked in tests marked ``cuda``."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchmem
from standins import HistoryStandIn
from torchmem.events import history

ENTRIES = 1_000_000
OURS = {"context": "alloc", "stacks": "python", "max_entries": ENTRIES}


@pytest.fixture
def cuda_history(monkeypatch: pytest.MonkeyPatch) -> HistoryStandIn:
    return HistoryStandIn().install(monkeypatch)


def addresses(snapshot: dict) -> list[int]:
    return [e["addr"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]


def test_a_history_that_was_off_is_turned_on_for_the_recording_and_off_after(
    cuda_history: HistoryStandIn,
) -> None:
    lease = history.acquire(True, ENTRIES)
    assert (cuda_history.enabled, cuda_history.settings) == ("all", OURS)
    cuda_history.alloc(1024, 512)
    assert addresses(lease.release()) == [1024]
    assert cuda_history.enabled is None
    assert torch.cuda.memory._record_memory_history == cuda_history._record_memory_history
    assert lease.notes == [] and lease.lost == {}


def test_the_program_turning_it_on_keeps_its_settings_and_its_snapshot(
    cuda_history: HistoryStandIn,
) -> None:
    lease = history.acquire(True, ENTRIES)
    cuda_history.alloc(1024, 512)
    torch.cuda.memory._record_memory_history(max_entries=5000, stacks="all")
    # Both get what they asked for: the program's richer context and stacks, our entries.
    assert cuda_history.settings == {"context": "all", "stacks": "all", "max_entries": ENTRIES}
    cuda_history.alloc(2048, 512)
    assert addresses(torch.cuda.memory._snapshot()) == [1024, 2048]  # its _dump_snapshot
    assert addresses(lease.release()) == [1024, 2048]
    # The program's own settings are back, and its history goes on.
    assert (cuda_history.enabled, cuda_history.settings) == (
        "all",
        {"context": "all", "stacks": "all", "max_entries": 5000},
    )
    cuda_history.alloc(4096, 512)
    assert addresses(torch.cuda.memory._snapshot()) == [1024, 2048, 4096]


def test_the_program_turning_it_off_does_not_discard_the_recording(
    cuda_history: HistoryStandIn,
) -> None:
    lease = history.acquire(True, ENTRIES)
    torch.cuda.memory._record_memory_history(max_entries=10)
    cuda_history.alloc(1024, 512)
    torch.cuda.memory._record_memory_history(enabled=None)
    cuda_history.alloc(2048, 512)
    assert addresses(lease.release()) == [1024, 2048]
    assert cuda_history.enabled is None  # as the program left it


def test_the_program_clearing_it_keeps_what_the_recording_saw_before(
    cuda_history: HistoryStandIn,
) -> None:
    lease = history.acquire(True, ENTRIES)
    cuda_history.alloc(1024, 512)
    torch.cuda.memory._record_memory_history(clear_history=True)
    cuda_history.alloc(2048, 512)
    assert addresses(torch.cuda.memory._snapshot()) == [2048]  # the program's: cleared
    assert addresses(lease.release()) == [1024, 2048]  # the recording's: whole
    assert cuda_history.calls[-1] == (
        "all",
        {"context": "all", "stacks": "all", "max_entries": 2**63 - 1, "clear_history": False},
    )


def test_the_actions_a_recording_reads_are_never_skipped(cuda_history: HistoryStandIn) -> None:
    lease = history.acquire(True, ENTRIES)
    torch.cuda.memory._record_memory_history(skip_actions=["alloc", "free_requested"])
    assert cuda_history.settings["skip_actions"] == ["free_requested"]
    cuda_history.alloc(1024, 512)
    lease.release()
    assert cuda_history.settings["skip_actions"] == ["alloc", "free_requested"]


def test_a_history_on_before_the_recording_is_used_as_it_is_and_left_on(
    cuda_history: HistoryStandIn,
) -> None:
    torch.cuda.memory._record_memory_history(context=None, max_entries=3)
    cuda_history.alloc(1024, 512)
    calls = len(cuda_history.calls)
    lease = history.acquire(True, ENTRIES)
    time.sleep(0.002)  # the trace's clock counts microseconds
    for k in range(5):
        cuda_history.alloc(4096 * (k + 1), 512)
    snapshot = lease.release()
    assert len(cuda_history.calls) == calls  # its settings were never touched
    assert (cuda_history.enabled, cuda_history.settings["max_entries"]) == ("all", 3)
    assert addresses(snapshot) == [12288, 16384, 20480]
    assert lease.notes == [
        "The program had turned PyTorch's CUDA memory history on before the recording"
        " started: torchmem used it with the program's settings."
    ]
    assert list(lease.lost) == [0]  # its 3 entries do not reach back to the start


def test_a_history_on_but_still_empty_is_left_on(cuda_history: HistoryStandIn) -> None:
    torch.cuda.memory._record_memory_history(max_entries=1000)
    history.acquire(True, ENTRIES).release()
    assert (cuda_history.enabled, cuda_history.settings["max_entries"]) == ("all", 1000)


def test_a_full_history_says_what_it_lost(cuda_history: HistoryStandIn) -> None:
    lease = history.acquire(True, 4)
    for k in range(6):
        cuda_history.alloc(4096 * (k + 1), 512)
    assert len(lease.release()["device_traces"][0]) == 4
    assert list(lease.lost) == [0] and lease.lost[0] >= 0


def test_nested_recordings_share_the_history(cuda_history: HistoryStandIn) -> None:
    outer = history.acquire(False, 100)
    assert cuda_history.settings == {"context": None, "stacks": "python", "max_entries": 100}
    inner = history.acquire(True, ENTRIES)
    assert cuda_history.settings == OURS
    cuda_history.alloc(1024, 512)
    inner.release()
    assert cuda_history.enabled == "all"  # the outer recording goes on
    cuda_history.alloc(2048, 512)
    assert addresses(outer.release()) == [1024, 2048]
    assert cuda_history.enabled is None


def test_a_history_that_cannot_be_set_leaves_nothing_installed(
    cuda_history: HistoryStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        history.acquire(True, ENTRIES)
    assert torch.cuda.memory._record_memory_history is fails
    assert history._shared.leases == []


def test_code_that_replaced_the_function_since_keeps_its_own(
    cuda_history: HistoryStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = history.acquire(True, ENTRIES)
    intercepted = torch.cuda.memory._record_memory_history

    def theirs(*args: object, **kwargs: object) -> None:
        intercepted(*args, **kwargs)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", theirs)
    lease.release()
    assert torch.cuda.memory._record_memory_history is theirs


SCRIPT = """
import torch
torch.cuda.memory._record_memory_history(max_entries=100000)
kept = torch.empty(2**20, device="cuda")
torch.cuda.memory._dump_snapshot({path!r})
torch.cuda.memory._record_memory_history(enabled=None)
"""


@pytest.mark.cuda
def test_a_script_that_records_its_own_snapshot_under_torchmem_run(tmp_path: Path) -> None:
    """The script's own ``_dump_snapshot`` holds its allocation, and the report is right."""
    own = tmp_path / "own.pickle"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(path=str(own)))
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "torchmem", "run", "-q", "--json", str(report), str(script)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    with open(own, "rb") as file:
        snapshot = pickle.load(file)
    assert 4 * 2**20 in [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    run = json.loads(report.read_text())
    assert run["devices"]["cuda:0"]["end_bytes"] == 4 * 2**20  # `kept`, alive at the end
    assert run["devices"]["cuda:0"]["peak_bytes"] == 4 * 2**20


@pytest.mark.cuda
def test_record_keeps_the_programs_real_history_on() -> None:
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        with torchmem.record("cuda:0"):
            kept = torch.empty(2**18, device="cuda")
        after = torch.empty(2**18, device="cuda")
        sizes = [
            e["size"]
            for e in torch.cuda.memory._snapshot()["device_traces"][0]
            if e["action"] == "alloc"
        ]
        assert sizes[-2:] == [2**20, 2**20]  # kept, then after: still recording
        del kept, after
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
