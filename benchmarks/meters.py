"""Cost of watching with the tensor meter, per operator, against the PyTorch profiler.

Contenders run in the same process, alternating, repeated; the table shows the median
time and its ratio to the unwatched run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

import torchmem
from benchmarks import timing


def small_ops(n: int = 10_000, device: str = "cpu") -> Callable[[], None]:
    """`n` additions of two 16-element tensors."""
    a, b = torch.ones(16, device=device), torch.ones(16, device=device)

    def run() -> None:
        for _ in range(n):
            a + b
        synchronize(device)

    return run


def synchronize(device: str) -> None:
    """Wait for the GPU, so a CUDA run's time includes its kernels."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def mlp(
    device: str = "cpu",
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A 3-layer MLP, its Adam optimizer, and a batch of 64 inputs and class labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    return model, opt, x, y


def mlp_step(device: str = "cpu") -> Callable[[], None]:
    """One training step of a 3-layer MLP with Adam, batch 64."""
    model, opt, x, y = mlp(device)

    def run() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        synchronize(device)

    run()  # Adam's state exists from here on
    return run


def contenders(device: str) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Unwatched, torchmem's meter for `device` (the tensor meter for ``"cpu"``, the
    caching allocator's for CUDA) and the PyTorch profiler recording memory."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return {
        "unwatched": contextlib.nullcontext,
        f"torchmem {type(torchmem.meter(device)).__name__}": torchmem.meter(device).window,
        "torch.profiler(profile_memory=True)": lambda: torch.profiler.profile(
            activities=activities, profile_memory=True
        ),
    }


CASES = {"10,000 small ops": small_ops, "MLP training step (Adam)": mlp_step}


def measure(repeat: int = 5, scale: float = 1.0, device: str = "cpu") -> list[timing.Row]:
    """(case, contender, median seconds, ratio to unwatched) for every pair."""
    rows = []
    named = contenders(device)
    for case, make in CASES.items():
        work = make(int(10_000 * scale), device) if make is small_ops else make(device)
        found = timing.medians(work, named, repeat)
        rows += timing.rows(case, list(named), found, "unwatched")
    return rows


def table(rows: list[timing.Row]) -> str:
    return timing.table(rows)


def verdicts(rows: list[timing.Row]) -> str:
    """torchmem's ratio against the profiler's, a line per case."""
    ratios: dict[str, dict[str, float]] = {}
    for case, name, _, ratio in rows:
        if ratio is not None:
            ratios.setdefault(case, {})[name.split()[0]] = ratio
    lines = []
    for case, found in ratios.items():
        ours, theirs = found["torchmem"], found["torch.profiler(profile_memory=True)"]
        verdict = "met" if ours < theirs else "missed"
        lines.append(f"- {case}: torchmem {ours:.2f}x, torch.profiler {theirs:.2f}x ({verdict})")
    return "\n".join(lines)
