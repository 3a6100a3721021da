"""Estimates of each rank of a sharded training step, beside PyTorch's own
``FSDPMemTracker`` and the real ranks: an FSDP2 step (four ``Linear(WIDTH, WIDTH)`` layers,
each ``fully_shard``-ed, AdamW, one step) at 2 and 4 ranks on the CPU. The truth is each
real rank's peak above its start, recorded around the step (``torchrun``, gloo).
``torchmem.estimate(step, world_size=N)`` runs the step once as each rank, on fake tensors
and PyTorch's fake process group. ``FSDPMemTracker`` (``torch.distributed._tools``) runs it
on fake tensors as rank 0 on the fake process group, its device mesh made outside its fake
mode (inside, ``DeviceMesh`` cannot read its ranks). For each: rank 0's peak, its error
against the real rank 0's, and the seconds the estimate took (all ranks, for torchmem; the
real job's whole ``torchrun``, for the truth). Target: torchmem's peak exact on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import torchmem

WIDTH = 1024
STEP = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard


    def step(width: int, batch: int) -> None:
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(batch, width)).sum().backward()
        optimizer.step()
    """
)
JOB = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    import torchmem
    from sharded_step import step

    dist.init_process_group("gloo")
    with torchmem.record("cpu") as recording:
        step(int(sys.argv[1]), int(sys.argv[2]))
    cpu = recording.report().devices["cpu"]
    with open(f"peak{dist.get_rank()}.json", "w") as file:
        json.dump(cpu.peak_bytes - cpu.start_bytes, file)
    dist.destroy_process_group()
    """
)


class Found(NamedTuple):
    ranks: int
    contender: str
    peaks: tuple[int, ...] | None
    """Each rank's peak bytes (rank 0's alone for FSDPMemTracker); None: it could not run."""
    seconds: float


def measure(width: int, batch: int, worlds: tuple[int, ...]) -> list[Found]:
    """For each world size in `worlds`: the real ranks', torchmem's and FSDPMemTracker's
    peaks of the step at `width` and `batch`."""
    found = []
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "sharded_step.py").write_text(STEP)
        Path(folder, "job.py").write_text(JOB)
        sys.path.insert(0, folder)
        try:
            from sharded_step import step  # type: ignore[import-not-found]

            for ranks in worlds:
                found.append(_real(folder, ranks, width, batch))
                started = time.perf_counter()
                estimate = torchmem.estimate(step, width, batch, device="cpu", world_size=ranks)
                peaks = tuple(each.peak_bytes for each in estimate.ranks)
                found.append(
                    Found(ranks, "torchmem.estimate", peaks, time.perf_counter() - started)
                )
                found.append(_tracker(ranks, width, batch))
        finally:
            sys.path.remove(folder)
            sys.modules.pop("sharded_step", None)
    return found


def _real(folder: str, ranks: int, width: int, batch: int) -> Found:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", "job.py", str(width), str(batch)]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    started = time.perf_counter()
    subprocess.run(command, cwd=folder, env=environ, check=True, capture_output=True)
    seconds = time.perf_counter() - started
    peaks = tuple(json.loads(Path(folder, f"peak{r}.json").read_text()) for r in range(ranks))
    return Found(ranks, "real ranks (torchrun, gloo)", peaks, seconds)


def _tracker(ranks: int, width: int, batch: int) -> Found:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return Found(ranks, "FSDPMemTracker", None, 0.0)
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks,))
        with FakeTensorMode():
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters())
            x = torch.randn(batch, width)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x,))
            with tracker:
                model(x).sum().backward()
                optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    finally:
        dist.destroy_process_group()
    return Found(ranks, "FSDPMemTracker", (peak,), time.perf_counter() - started)


def table(found: list[Found]) -> str:
    """A markdown row per world size and contender: rank 0's peak, its error against the
    real rank 0's, whether every rank is exact, and the seconds."""
    lines = [
        "| ranks | contender | rank 0's peak | error | every rank exact | seconds |",
        "| ---: | --- | ---: | ---: | --- | ---: |",
    ]
    truth = {f.ranks: f.peaks for f in found if f.contender.startswith("real")}
    for f in found:
        if f.peaks is None:
            lines.append(f"| {f.ranks} | {f.contender} | not installed | - | - | - |")
            continue
        real = truth[f.ranks] or ()
        error = f.peaks[0] - real[0]
        every = "-" if len(f.peaks) < len(real) else "yes" if f.peaks == real else "no"
        lines.append(
            f"| {f.ranks} | {f.contender} | {f.peaks[0]:,} B | {error:+,} B"
            f" ({error / real[0]:+.2%}) | {every} | {f.seconds:.2f} |"
        )
    return "\n".join(lines)


def verdicts(found: list[Found]) -> str:
    """Per world size: whether torchmem's estimate equals every real rank's peak."""
    truth = {f.ranks: f.peaks for f in found if f.contender.startswith("real")}
    lines = []
    for f in found:
        if f.contender == "torchmem.estimate":
            met = "met" if f.peaks == truth[f.ranks] else "missed"
            lines.append(f"- {f.ranks} ranks: every rank's peak exact ({met})")
    return "\n".join(lines)
