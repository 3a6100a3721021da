"""The estimator: how long one estimate of a GPT-2-small training step (124M parameters,
sequence 1024, AdamW) takes for a CUDA target, and a full ``max_batch_size`` search for
an 80 GiB GPU; and, on the CPU, the estimate against the measured peak of the real step.
Targets on this machine: at most 1 s for one estimate, at most 10 s for the search, the
CPU estimate within 1% of the real peak. The ratio is to the target."""

from __future__ import annotations

import gc
import statistics
import time

import torch

import torchmem
from benchmarks.models import gpt2_step
from benchmarks.timing import Row

TARGETS = {"estimate": 1.0, "max_batch_size": 10.0}
"""Most seconds each may take."""


def mlp_step(batch: int) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    optimizer = torch.optim.Adam(model.parameters())
    loss = torch.nn.functional.cross_entropy(
        model(torch.randn(batch, 1024)), torch.randint(0, 10, (batch,))
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def measure(repeat: int, layers: int, capacity: str) -> tuple[list[Row], str]:
    """Median seconds of one estimate and of a search; and the CPU comparison as text."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        found = torchmem.estimate(gpt2_step, 8, layers=layers)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    batch = torchmem.max_batch_size(gpt2_step, capacity, layers=layers)
    search = time.perf_counter() - start
    case = f"GPT-2 small ({layers} layers), cuda"
    one = statistics.median(times)
    rows: list[Row] = [
        (f"{case}, batch 8", "estimate", one, one / TARGETS["estimate"]),
        (f"{case}, {capacity}", "max_batch_size", search, search / TARGETS["max_batch_size"]),
    ]
    gc.collect()
    window = torchmem.meter("cpu").window()
    mlp_step(64)
    real = window.peak()
    window.close()
    estimated = torchmem.estimate(mlp_step, 64, device="cpu").peak_bytes
    lines = [
        f"- GPT-2 small batch 8 on cuda: peak allocated {found.peak_bytes:,} B, reserved"
        f" {found.reserved_bytes:,} B; largest batch for {capacity}: {batch}",
        f"- MLP 1024-4096-1024-10 batch 64, Adam, CPU: measured {real:,} B, estimated"
        f" {estimated:,} B ({(estimated - real) / real:+.4%})",
    ]
    return rows, "\n".join(lines)


def verdicts(rows: list[Row]) -> str:
    lines = []
    for _, name, seconds, _ in rows:
        if name in TARGETS and seconds is not None:
            verdict = "met" if seconds <= TARGETS[name] else "missed"
            lines.append(f"- {name}: {seconds:.2f}s (target {TARGETS[name]}s: {verdict})")
    return "\n".join(lines)
