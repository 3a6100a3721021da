"""Cost of watching with the tensor meter, per operator, against the PyTorch profiler.

Contenders run in the same process, alternating, repeated; the table shows the median
time and its ratio to the unwatched run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from benchmarks import timing
from torchmem import TensorMeter


def small_ops(n: int = 10_000) -> Callable[[], None]:
    """`n` additions of two 16-element tensors."""
    a, b = torch.ones(16), torch.ones(16)

    def run() -> None:
        for _ in range(n):
            a + b

    return run


def mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A 3-layer MLP, its Adam optimizer, and a batch of 64 inputs and class labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    return model, opt, x, y


def mlp_step() -> Callable[[], None]:
    """One training step of a 3-layer MLP with Adam, batch 64."""
    model, opt, x, y = mlp()

    def run() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    run()  # Adam's state exists from here on
    return run


@contextlib.contextmanager
def tensor_meter() -> Iterator[None]:
    with TensorMeter("cpu").window():
        yield


def pytorch_profiler() -> contextlib.AbstractContextManager:
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )


CONTENDERS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "unwatched": contextlib.nullcontext,
    "torchmem TensorMeter": tensor_meter,
    "torch.profiler(profile_memory=True)": pytorch_profiler,
}
CASES = {"10,000 small ops": small_ops, "MLP training step (Adam)": mlp_step}


def measure(repeat: int = 5, scale: float = 1.0) -> list[timing.Row]:
    """(case, contender, median seconds, ratio to unwatched) for every pair."""
    rows = []
    for case, make in CASES.items():
        work = make(int(10_000 * scale)) if make is small_ops else make()
        found = timing.medians(work, CONTENDERS, repeat)
        rows += timing.rows(case, list(CONTENDERS), found, "unwatched")
    return rows


def table(rows: list[timing.Row]) -> str:
    return timing.table(rows)
