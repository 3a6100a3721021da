"""A recorded training loop tells its story in exact bytes: memory by category over time,
the phases of each step (at the times the optimizer's own hooks see them), and what each
module's forward kept and its backward added. CPU tensors, counted by the counting
allocator."""

from __future__ import annotations

import gc
import itertools
import time

import pytest
import torch
from torch import nn

import torchmem
from standins import MiB
from torchmem.records.run import CATEGORIES

pytestmark = pytest.mark.counting

STEPS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    for _ in range(STEPS):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are freed (set to None)


def test_each_interval_is_split_into_categories_that_sum_to_it() -> None:
    """Built before the recording, the parameters count as such from its start; Adam's
    state from its first step (two buffers per parameter, and a 4-byte step count); the
    gradients while they live, from backward to zero_grad."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024)
    params = sum(p.nbytes for p in model.parameters())
    assert params == 4_239_400  # 1024 * 1024 * 4 + 1024 * 4 + 10 * 1024 * 4 + 10 * 4
    state = 2 * params + 4 * len(list(model.parameters()))
    gc.collect()
    with torchmem.record("cpu") as rec:
        train(model, optimizer, x)
    report = rec.report()
    cpu = report.devices["cpu"]
    layers = cpu.timeline_categories
    assert layers is not None and len(layers) == len(cpu.timeline)
    for (_, total), layer in zip(cpu.timeline, layers, strict=True):
        assert sum(layer) == total
        assert layer[0] == params
    peak = max(range(len(layers)), key=lambda i: cpu.timeline[i][1])
    assert cpu.timeline[peak][1] == cpu.peak_bytes
    assert dict(zip(CATEGORIES, layers[peak], strict=True)) == cpu.categories_at_peak
    assert layers[peak][1:3] == (params, state)
    first = next(p for p in report.phases if p.kind == "step")
    ends = [t for t, _ in cpu.timeline]
    begins = [0.0, *ends[:-1]]
    before = [i for i in range(len(ends)) if ends[i] < first.start]
    after = [i for i in range(len(ends)) if begins[i] > first.end]
    assert before and after
    assert {layers[i][2] for i in before} == {0}
    assert {layers[i][2] for i in after} == {state}


def test_the_phases_are_each_forward_backward_and_step_at_their_times() -> None:
    """The optimizer's own hooks run inside our step phase (they run after the global pre
    hooks and before the global post hooks), on the same clock."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 1024)
    seen: list[int] = []
    gc.collect()
    with torchmem.record("cpu") as rec:
        pre = optimizer.register_step_pre_hook(lambda *_: seen.append(time.monotonic_ns()))
        post = optimizer.register_step_post_hook(lambda *_: seen.append(time.monotonic_ns()))
        train(model, optimizer, x)
    pre.remove()
    post.remove()
    report = rec.report()
    phases = report.phases
    assert [p.kind for p in phases] == ["forward", "backward", "step"] * STEPS
    for earlier, later in itertools.pairwise(phases):
        assert earlier.start < earlier.end <= later.start
    steps = [p for p in phases if p.kind == "step"]
    for step, began, ended in zip(steps, seen[0::2], seen[1::2], strict=True):
        began_s, ended_s = ((t - rec.start_ns) / 1e9 for t in (began, ended))
        assert step.start <= began_s < ended_s <= step.end
    assert phases[0].start > 0
    assert phases[-1].end < report.duration


def test_a_loss_module_and_its_model_make_one_backward_pass() -> None:
    """The gradient flows from the loss module's backward pass into the model's: one pass,
    from the first to open to the last to end; two forward calls of outermost modules."""
    model, loss = mlp(), nn.MSELoss()
    x, target = torch.randn(64, 1024), torch.zeros(64, 10)
    gc.collect()
    with torchmem.record("cpu") as rec:
        loss(model(x), target).backward()
    assert [p.kind for p in rec.report().phases] == ["forward", "forward", "backward"]


def test_what_each_module_kept_and_added_is_exact() -> None:
    """Linear(1024, 1024) -> ReLU -> Linear(1024, 10) on 64 float32 rows, training.

    Forward, what each call leaves alive when it returns: the first Linear its output
    (64 * 1024 * 4 = 262,144 B: ReLU's input); ReLU its output (262,144 B, which it saves for
    its backward and the second Linear saves for its weight's gradient); the second Linear
    its output (64 * 10 * 4 = 2,560 B). The Sequential keeps 264,704 B, not their sum: once
    ReLU has returned, nothing holds the first Linear's output (ReLU saved its own), and
    Sequential's loop lets it go.

    Backward, the most each rose above the use when its gradient began: the second Linear
    makes its input's gradient (262,144 B) and its weight's and bias's (40,960 + 40 B) =
    303,144 B; ReLU makes its input's gradient (262,144 B), and the gradient it received is
    freed after; the first Linear, whose input needs no gradient, makes its weight's and
    bias's (4,194,304 + 4,096 = 4,198,400 B). The Sequential's pass: those 4,198,400 B, and
    the second Linear's 41,000 B kept as gradients, less the 2,560 B gradient of its output,
    freed (ReLU's saved output, freed, and the first Linear's output gradient, alive, are
    the same size) = 4,236,840 B."""
    model = mlp()
    x = torch.randn(64, 1024)
    gc.collect()
    with torchmem.record("cpu") as rec:
        for _ in range(2):
            model(x).square().mean().backward()
            model.zero_grad()
    modules = {m.name: m for m in rec.report().modules}
    assert {name: m.forward_kept_bytes for name, m in modules.items()} == {
        "": 264_704,
        "0": 262_144,
        "1": 262_144,
        "2": 2_560,
    }
    assert {name: m.backward_rise_bytes for name, m in modules.items()} == {
        "": 4_236_840,
        "0": 4_198_400,
        "1": 262_144,
        "2": 303_144,
    }
    assert {m.calls for m in modules.values()} == {2}


def test_a_module_that_frees_more_than_it_makes_kept_nothing() -> None:
    class Shrink(nn.Module):
        def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
            small = torch.zeros(1024)  # 4 KiB, returned
            x.clear()  # the caller's 4 MiB, freed
            return small

    shrink = Shrink()
    gc.collect()
    with torchmem.record("cpu") as rec:
        shrink([torch.zeros(MiB)])
    (module,) = rec.report().modules
    assert (module.forward_kept_bytes, module.backward_rise_bytes) == (0, None)
