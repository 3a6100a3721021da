"""A CPU recording saved in PyTorch's memory snapshot format, opened by PyTorch's own
``torch.cuda._memory_viz`` and by ``torchmem run --snapshot``."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

import torchmem
from standins import KiB, MiB
from torchmem.errors import TorchmemError
from torchmem.records.frames import shown

pytestmark = pytest.mark.counting

HERE = shown(__file__)


def load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as file:
        data: dict[str, Any] = pickle.load(file)
    return data


def mine(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries whose frame is a line of this file."""
    return [e for e in entries if e["frames"] and e["frames"][0]["filename"] == HERE]


def recorded(tmp_path: Path) -> tuple[dict[str, Any], int, int]:
    with torchmem.record("cpu") as rec:
        kept = torch.zeros(1024, 1024)
        kept_line = sys._getframe().f_lineno - 1
        gone = torch.zeros(64, 1024)
        gone_line = sys._getframe().f_lineno - 1
        del gone
    rec.save_snapshot(tmp_path / "cpu.pickle")
    assert kept.sum() == 0
    return load(tmp_path / "cpu.pickle"), kept_line, gone_line


def test_a_cpu_recording_saves_its_live_allocations_as_segments(tmp_path: Path) -> None:
    data, kept_line, _ = recorded(tmp_path)
    assert set(data) == {"segments", "device_traces", "torchmem_device_names"}
    assert len(data["device_traces"]) == 1  # the CPU is device 0 without GPUs
    assert data["torchmem_device_names"] == ["cpu"]
    segments = mine(data["segments"])
    assert [(s["total_size"], s["frames"][0]["line"]) for s in segments] == [(4 * MiB, kept_line)]
    (segment,) = segments
    assert segment["blocks"] == [
        {
            "address": segment["address"],
            "size": 4 * MiB,
            "requested_size": 4 * MiB,
            "state": "active_allocated",
            "frames": [{"filename": HERE, "line": kept_line, "name": "recorded"}],
        }
    ]
    assert segment["allocated_size"] == segment["active_size"] == 4 * MiB
    assert all(s["device"] == 0 for s in data["segments"])


def test_a_cpu_recording_traces_each_allocation_and_free(tmp_path: Path) -> None:
    data, kept_line, gone_line = recorded(tmp_path)
    trace = mine(data["device_traces"][0])
    assert [(e["action"], e["size"], e["frames"][0]["line"]) for e in trace] == [
        ("segment_alloc", 4 * MiB, kept_line),
        ("alloc", 4 * MiB, kept_line),
        ("segment_alloc", 256 * KiB, gone_line),
        ("alloc", 256 * KiB, gone_line),
        ("free_requested", 256 * KiB, gone_line),
        ("free_completed", 256 * KiB, gone_line),
        ("segment_free", 256 * KiB, gone_line),
    ]
    assert trace[2]["addr"] == trace[-1]["addr"]
    times = [e["time_us"] for e in trace]
    assert times == sorted(times) and times[0] > 1_600_000_000_000_000  # µs since 1970


def test_pytorchs_own_tools_open_a_cpu_recording(tmp_path: Path) -> None:
    data, _, _ = recorded(tmp_path)
    summary = _memory_viz.segsum(data)
    reserved = sum(s["total_size"] for s in data["segments"])
    assert f"segments: {len(data['segments'])}\n" in summary
    assert f"total_reserved: {_memory_viz.Bytes(reserved)}\n" in summary
    assert f"total_allocated: {_memory_viz.Bytes(reserved)}\n" in summary  # no cache on CPU
    assert "total_free: 0.0B\n" in summary
    page = _memory_viz.trace_plot(data)
    assert "Active Memory Timeline" in page
    assert "cudaMalloc" in _memory_viz.trace(data)  # PyTorch's words for a segment_alloc


def test_a_snapshot_needs_a_stopped_recording_with_an_event_log(tmp_path: Path) -> None:
    rec = torchmem.record("cpu").start()
    with pytest.raises(RuntimeError, match="stop the recording"):
        rec.save_snapshot(tmp_path / "early.pickle")
    rec.stop()
    with torchmem.record("ram") as ram:
        pass
    with pytest.raises(TorchmemError, match="no snapshot to save"):
        ram.save_snapshot(tmp_path / "ram.pickle")
    assert not (tmp_path / "ram.pickle").exists()


def test_torchmem_run_saves_a_snapshot(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(
        textwrap.dedent(
            """\
            import torch
            x = torch.zeros(1024, 1024)
            """
        )
    )
    command = [sys.executable, "-m", "torchmem", "run", "-q", "--snapshot", "job.pickle"]
    done = subprocess.run(
        [*command, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    data = load(tmp_path / "job.pickle")
    ours = [s for s in data["segments"] if s["frames"] and s["frames"][0]["filename"] == "job.py"]
    assert [(s["total_size"], s["frames"][0]["line"]) for s in ours] == [(4 * MiB, 2)]
    assert "total_allocated" in _memory_viz.segsum(data)


def test_torchmems_loader_reads_a_cpu_recording_as_the_report_does(tmp_path: Path) -> None:
    with torchmem.record("cpu") as rec:
        kept = torch.zeros(1024, 1024)
        spike = torch.zeros(4096, 1024)  # 16 MiB, the peak
        del spike
    rec.save_snapshot(tmp_path / "cpu.pickle")
    assert kept.sum() == 0
    cpu = rec.report().devices["cpu"]
    snap = torchmem.load_snapshot(tmp_path / "cpu.pickle")
    (device,) = snap.devices.values()
    assert device.name == "cpu"
    text = str(snap)
    assert "Allocation sites alive at the peak on cpu:\n" in text
    assert f"16.00M  {HERE}:" in text
    assert device.allocated_bytes == device.active_bytes == device.reserved_bytes
    # The snapshot counts what Python could see alive; the rise to the peak is the same.
    assert device.peak_bytes - device.allocated_bytes == cpu.peak_bytes - cpu.end_bytes
    assert cpu.peak_bytes - cpu.end_bytes == 16 * MiB
    mine = [(site.file, site.bytes) for site in device.sites_at_peak if site.file == HERE]
    assert mine == [(HERE, 16 * MiB), (HERE, 4 * MiB)]
