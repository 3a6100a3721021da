"""Ground truth recorded on a real GPU by ``scripts/gpu_truth.py`` (``bash
scripts/gpu_check.sh``): a memory snapshot of each training step of
:mod:`gpu_workloads`, with the caching allocator's own counters (``facts.json``), checked
here without a GPU: the snapshot reader's peak is ``max_memory_allocated()``, the
allocator model replays the trace exactly, and the estimate of the same step is the real
peak and reserve (or differs by the bytes written here). On a GPU (tests marked
``cuda``), ``torchmem.record()`` of the step peaks at ``max_memory_allocated()`` too.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from gpu_workloads import WORKLOADS
from test_allocator_truth import actions, layouts
from torchmem.estimator.replay import replay, start_layout

RECORDED = Path(__file__).resolve().parent / "data" / "gpu_truth" / "recorded"
FACTS = json.loads((RECORDED / "facts.json").read_text())
NAMES = sorted(FACTS["workloads"])
DIFFERENCE = {"lm-small-fullstep-fp32": (-8_192, 0)}
"""Estimated minus real (peak, reserved) bytes where they are not equal: a backward pass's
scratch tensors differ between CUDA's kernels and the CPU's."""


def snapshot(name: str, tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The recorded snapshot's dict (plain data: read with the restricted unpickler) and
    the path of an unzipped copy."""
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(gzip.decompress((RECORDED / f"{name}.pickle.gz").read_bytes()))
    with open(path, "rb") as file:
        return torchmem.snapshot._Unpickler(file, str(path)).load(), path


def test_every_workload_was_recorded() -> None:
    assert sorted(WORKLOADS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_the_snapshot_peak_is_max_memory_allocated(name: str, tmp_path: Path) -> None:
    facts = FACTS["workloads"][name]
    device = torchmem.load_snapshot(snapshot(name, tmp_path)[1]).devices[0]
    assert device.peak_bytes == facts["max_memory_allocated"]
    assert device.reserved_bytes == facts["memory_reserved_at_end"]
    assert device.allocated_bytes == facts["memory_allocated_at_end"]


@pytest.mark.parametrize("name", NAMES)
def test_the_allocator_model_replays_the_trace_exactly(name: str, tmp_path: Path) -> None:
    data = snapshot(name, tmp_path)[0]
    end, trace = layouts(data), actions(data)
    done = replay(start_layout(end, trace), trace)
    assert (done.mismatches, done.differences) == ((), 0)
    assert done.allocated_peak == FACTS["workloads"][name]["max_memory_allocated"]
    assert sorted(done.end) == sorted(end)


@pytest.mark.parametrize("name", NAMES)
def test_the_estimate_is_the_real_peak_and_reserve(name: str) -> None:
    facts, workload = FACTS["workloads"][name], WORKLOADS[name]
    estimate = torchmem.estimate(lambda: workload.step(workload.build("cuda")))
    peak, reserved = facts["max_memory_allocated"], facts["max_memory_reserved"]
    found = (estimate.peak_bytes - peak, estimate.reserved_bytes - reserved)
    assert found == DIFFERENCE.get(name, (0, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_recording_of_the_step_peaks_at_max_memory_allocated(name: str) -> None:
    workload = WORKLOADS[name]
    state = workload.build("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torchmem.record("cuda:0") as rec:
        workload.step(state)
        torch.cuda.synchronize()
    run = rec.report().devices["cuda:0"]
    assert run.peak_bytes == torch.cuda.max_memory_allocated()
    assert run.end_bytes == torch.cuda.memory_allocated()
    del state
