"""Cost of watching with torchmem's meter, per operator, against the PyTorch profiler.

On CPU both backends run: the counting allocator (the default) and the dispatch-mode
fallback.

Contenders run in the same process, alternating, repeated; the table shows the median
time and its ratio to the unwatched run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

import torchmem
from benchmarks import timing
from torchmem.meters import CpuAllocatorMeter, CpuDispatchMeter


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
    """Unwatched, torchmem's meter for `device` (on CPU: the counting allocator and the
    dispatch-mode fallback; on CUDA: the caching allocator's) and the PyTorch profiler
    recording memory, its exit included."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    watched = torchmem.meter(device)
    named: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "unwatched": contextlib.nullcontext,
        f"torchmem {type(watched).__name__}": watched.window,
    }
    if device == "cpu" and not isinstance(watched, CpuDispatchMeter):
        named[f"torchmem {CpuDispatchMeter.__name__}"] = CpuDispatchMeter().window
    named["torch.profiler(profile_memory=True)"] = lambda: torch.profiler.profile(
        activities=activities, profile_memory=True
    )
    return named


SMALL_OPS = "10,000 small ops"
TARGET_US_PER_OP = 0.5
"""The counting allocator's cost target, in microseconds per operator."""


CASES = {SMALL_OPS: small_ops, "MLP training step (Adam)": mlp_step}


def measure(repeat: int = 5, scale: float = 1.0, device: str = "cpu") -> list[timing.Row]:
    """(case, contender, median seconds, ratio to unwatched) for every pair."""
    rows = []
    named = contenders(device)
    for case, make in CASES.items():
        work = make(int(10_000 * scale), device) if make is small_ops else make(device)
        found = timing.medians(work, named, repeat)
        rows += timing.rows(case, list(named), found, "unwatched")
    return rows


def per_op(rows: list[timing.Row], ops: int = 10_000) -> str:
    """Each contender's cost per operator over the unwatched run in the small-ops case, a
    line each, with the counting allocator's target."""
    found = {name: median for case, name, median, _ in rows if case == SMALL_OPS}
    base = found["unwatched"]
    lines = []
    for name, median in found.items():
        if name == "unwatched" or median is None or base is None:
            continue
        cost = (median - base) / ops * 1e6
        line = f"- {name}: {cost:+.2f} µs per operator"
        if name.endswith(CpuAllocatorMeter.__name__):
            verdict = "met" if cost <= TARGET_US_PER_OP else "missed"
            line += f" (target at most +{TARGET_US_PER_OP} µs: {verdict})"
        lines.append(line)
    return "\n".join(lines)


def table(rows: list[timing.Row]) -> str:
    return timing.table(rows)


def verdicts(rows: list[timing.Row]) -> str:
    """torchmem's default meter's ratio against the profiler's, a line per case."""
    ratios: dict[str, dict[str, float]] = {}
    for case, name, _, ratio in rows:
        if ratio is not None:
            ratios.setdefault(case, {})[name] = ratio
    lines = []
    for case, found in ratios.items():
        ours = next(r for name, r in found.items() if name.startswith("torchmem"))
        theirs = found["torch.profiler(profile_memory=True)"]
        verdict = "met" if ours < theirs else "missed"
        lines.append(f"- {case}: torchmem {ours:.2f}x, torch.profiler {theirs:.2f}x ({verdict})")
    return "\n".join(lines)
