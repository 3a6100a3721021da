"""Training steps and growth: exact bytes per step on CPU tensors, under the counting
allocator.

The models have no biases and the batches are 64 x 256 float32, so each activation is
65,536 bytes (64 KiB) and each weight 262,144 bytes (256 KiB). A recording's start counts
whatever earlier tests left alive, so the figures are taken from it.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch import nn

import torchmem
from standins import KiB
from torchmem.events import steps
from torchmem.events.notes import Notes
from torchmem.events.sources import Log
from torchmem.events.steps import rise
from torchmem.events.tally import CLOSE, HIT, OPEN, STEP
from torchmem.records.run import DeviceRun, GrowthSite, HeldGraph

pytestmark = pytest.mark.counting
STEPS = 6
ACTIVATION = 64 * KiB
"""One 64 x 256 float32 activation: 65,536 bytes."""
NO_RAM = np.empty((0, 2), np.int64)
"""No reading of the process's RSS."""


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False)
    )


def record() -> torchmem.Recording:
    gc.collect()
    return torchmem.record("cpu")


def cpu_of(rec: torchmem.Recording) -> DeviceRun:
    return rec.report().devices["cpu"]


def site(run: DeviceRun, source: str) -> GrowthSite:
    assert run.growth is not None
    found = [s for s in run.growth.sites if s.source == source]
    assert len(found) == 1, [s.source for s in run.growth.sites]
    return found[0]


def test_the_steps_of_an_mlp_with_adam_are_exact() -> None:
    """Two 256 x 256 weights (256 KiB each) under Adam; each step a 64 x 256 batch.

    Step 0 (from the recording's start to its first ``optimizer.step()``) ends with the
    gradients (2 x 256 KiB), Adam's state (exp_avg and exp_avg_sq of each weight:
    4 x 256 KiB), its two 4-byte ``step`` counters, the batch ``x`` (64 KiB) and the 4-byte
    ``loss`` alive: 524,288 + 1,048,576 + 8 + 65,536 + 4 = 1,638,412 bytes more than at the
    start. Every step peaks in Adam's update of the second weight, at
    ``exp_avg_sq.sqrt() / bias_correction2_sqrt``: the first weight's ``denom`` (still
    bound to the loop's variable), the square root and the quotient, 3 x 262,144 bytes,
    and 12 bytes of the Python float PyTorch wraps as a tensor for the division (an
    8-byte double, and the 4-byte float it is cast to): 786,444 above the step's end,
    with all of Adam's state made. Each later step begins and ends alike (``zero_grad``
    frees the gradients, the backward pass makes them again); its forward pass (a new
    batch beside the old, three activations, a loss) stays below that peak.
    """
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    with record() as rec:
        for _ in range(4):
            x = torch.randn(64, 256)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    report = rec.report()
    cpu = report.devices["cpu"]
    start = cpu.start_bytes
    end = start + 1_638_412
    table = [(s.index, s.start_bytes, s.peak_bytes, s.end_bytes, s.count) for s in cpu.steps]
    assert table == [
        (0, start, end + 786_444, end, 1),
        (1, end, end + 786_444, end, 1),
        (2, end, end + 786_444, end, 1),
        (3, end, end + 786_444, end, 1),
    ]
    assert report.steps_by == "optimizer.step()"
    assert cpu.growth is None
    assert [s.end for s in cpu.steps] == sorted(s.end for s in cpu.steps)
    assert all(s.start < s.end for s in cpu.steps)


def test_a_steady_loop_does_not_grow() -> None:
    """The same work as the leaks below with nothing kept: each step ends where it began."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    cpu = cpu_of(rec)
    assert len(cpu.steps) == STEPS
    assert len({s.end_bytes for s in cpu.steps[1:]}) == 1
    assert cpu.growth is None


def test_outputs_kept_in_a_list() -> None:
    """Each step's output (64 x 256 float32: 65,536 bytes) stays in ``outputs``; the
    backward pass frees what its graph saved."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            out = model(x)
            outputs.append(out)
            loss = out.square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    cpu = cpu_of(rec)
    assert cpu.growth is not None
    assert (cpu.growth.bytes_per_step, cpu.growth.first_step, cpu.growth.exact) == (
        ACTIVATION,
        1,
        True,
    )
    found = site(cpu, "out = model(x)")
    assert (found.bytes_per_step, found.reason) == (ACTIVATION, "held by list `outputs`")
    assert len(cpu.growth.sites) == 1


def test_a_forward_hook_caching_outputs() -> None:
    """A forward hook on the first layer keeps its output (65,536 bytes a step) in a list
    that only the hook's closure holds."""
    model = mlp()
    keep_outputs(model[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    cpu = cpu_of(rec)
    assert cpu.growth is not None
    assert (cpu.growth.bytes_per_step, cpu.growth.exact) == (ACTIVATION, True)
    found = site(cpu, "loss = model(x).square().mean()")
    assert found.bytes_per_step == ACTIVATION
    assert found.reason == "held by a list in a forward hook of `model.0`"


def keep_outputs(module: nn.Module) -> None:
    store: list[torch.Tensor] = []
    module.register_forward_hook(lambda m, args, out: store.append(out))


def test_retain_graph_with_the_graph_kept() -> None:
    """``backward(retain_graph=True)`` and the loss kept: each step keeps the graph's saved
    tensors, the batch ``x`` (saved by the first layer), the ReLU's output (saved by it and
    the second layer) and the model's output (saved by ``square``), 3 x 65,536 bytes, and
    the 4-byte loss: 196,612 bytes a step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward(retain_graph=True)
            optimizer.step()
            losses.append(loss)
    cpu = cpu_of(rec)
    assert cpu.growth is not None
    assert (cpu.growth.bytes_per_step, cpu.growth.exact) == (3 * ACTIVATION + 4, True)
    batch = site(cpu, "x = torch.randn(64, 256)")
    assert batch.bytes_per_step == ACTIVATION
    assert batch.reason == (
        "kept with the autograd graph of a tensor in list `losses` (saved tensors of 1"
        " module: 0 (Linear)), after a backward pass through it (retain_graph=True)"
    )
    line = site(cpu, "loss = model(x).square().mean()")
    assert line.bytes_per_step == 2 * ACTIVATION + 4
    assert line.reason == (
        "held by list `losses`; kept with the autograd graph of a tensor in list `losses`"
        " (saved tensors of 1 module: 1 (ReLU)), after a backward pass through it"
        " (retain_graph=True)"
    )


def test_evaluation_without_no_grad_kept_in_a_list() -> None:
    """Predictions kept with gradients on and no backward pass: each keeps its graph, the
    batch (saved by the first layer) and the ReLU's output (saved by it and the second
    layer), and is itself 65,536 bytes: 196,608 bytes a step. No optimizer and no backward
    pass: a step ends where the model's forward call returns."""
    model = mlp()
    preds = []
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            preds.append(model(x))
    report = rec.report()
    cpu = report.devices["cpu"]
    assert report.steps_by == "forward"
    assert cpu.growth is not None
    assert (cpu.growth.bytes_per_step, cpu.growth.exact) == (3 * ACTIVATION, True)
    line = site(cpu, "preds.append(model(x))")
    assert line.bytes_per_step == 2 * ACTIVATION
    assert line.reason == (
        "held by list `preds`; kept with the autograd graph of a tensor in list `preds`"
        " (saved tensors of 1 module: 1 (ReLU)), and no backward pass went through it"
        " (evaluation without torch.no_grad())"
    )
    assert site(cpu, "x = torch.randn(64, 256)").bytes_per_step == ACTIVATION


def test_a_loss_summed_with_its_graph() -> None:
    """``total += loss`` over evaluation batches with gradients on: ``total`` holds every
    batch's graph, whose saved tensors are the batch (saved by the first layer), the
    ReLU's output and the model's output (saved by ``square``): 196,608 bytes a step. The
    sum itself is a new 4-byte tensor each step, the old one freed; the first step that
    makes it (step 1: steps end where the model's forward call returns, and the loss of
    a batch is summed after it) adds those 4 bytes too, so the rise is exact from step 2.
    """
    model = mlp()
    total = 0.0
    with record() as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            total += model(x).square().mean()
    cpu = cpu_of(rec)
    assert cpu.growth is not None
    growth = cpu.growth
    assert (growth.bytes_per_step, growth.first_step, growth.exact) == (3 * ACTIVATION, 2, True)
    line = site(cpu, "total += model(x).square().mean()")
    assert line.bytes_per_step == 2 * ACTIVATION
    assert line.reason == (
        "kept with the autograd graph of `total` (saved tensors of 1 module: 1 (ReLU)),"
        " and no backward pass went through it (evaluation without torch.no_grad())"
    )


def test_a_loss_summed_after_its_backward_pass_keeps_every_steps_graph() -> None:
    """``total += loss`` after ``loss.backward()`` (PyTorch's FAQ): the backward pass freed
    the saved tensors, so no CPU tensor grows, but ``total`` keeps every step's graph
    (its nodes are the process's RAM), each chained to the one before by the sum: a growth
    of its own, naming ``total``. Each step's graph is the loss's ``MeanBackward0``,
    ``PowBackward0``, two ``MmBackward0`` and their ``TBackward0``, ``ReluBackward0`` and
    the sum's ``AddBackward0`` (7 nodes), and the two weights' gradient accumulators are
    shared: 6 x 8 + 2 = 50 nodes (the first step's sum adds a Python float: no node of its
    own, ``AddBackward0`` all the same)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    total = 0.0
    with record() as rec:
        for _ in range(STEPS):
            loss = model(torch.randn(64, 256)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss
    growth = cpu_of(rec).growth
    assert growth is not None
    assert (growth.bytes_per_step, growth.first_step, growth.steps, growth.sites) == (0, 1, 5, ())
    assert growth.graphs == (HeldGraph("`total`", STEPS, 50, chained=True),)
    assert isinstance(growth.ram_bytes_per_step, int)
    assert all(isinstance(step.ram_bytes, int) for step in cpu_of(rec).steps)


def test_a_rise_is_told_from_its_steps() -> None:
    """The rule on the ends alone: at least 3 steps after the first, 9 in 10 rising."""
    assert rise(np.array([0, 10, 20, 30])) == (1, 10, True)
    assert rise(np.array([0, 10, 20])) is None  # too few steps
    assert rise(np.array([0, 5, 5, 5, 5])) is None
    assert rise(np.array([0, 100, 100, 104, 108, 112])) == (3, 4, True)
    assert rise(np.array([0, 7, 12, 20, 25])) == (1, 6, False)
    assert rise(np.array([0, 10, 20, 30, 30, 30])) is None  # stopped rising


def test_steps_from_a_gpu_log_and_the_watchers_notes() -> None:
    """A GPU's allocator history (here made by hand, times in ns) merged with the notes a
    watcher keeps (the model's forward calls, the optimizers' steps): two optimizers
    stepped one after the other, with no forward call between, end one step; a step's
    peak counts allocations made and freed inside it. Bytes: A 100 (kept), B 50 (freed), C 200
    (freed), D 100 (kept).

    step 0: from 0 to the steps at 40 and 41: peak 150 (A and B), end 100;
    step 1: to 70: peak 300 (A and C), end 100;
    step 2: to 90: peak 200 (A and D), end 200.
    """
    events = torch.tensor(
        [
            [10, 0xA, 100, -1, -1],
            [20, 0xB, 50, -1, 2],
            [30, 0xB, -50, -1, 1],
            [50, 0xC, 200, -1, 4],
            [60, 0xC, -200, -1, 3],
            [80, 0xD, 100, -1, -1],
        ]
    )
    notes = Notes()
    for number, when in enumerate((5, 45, 75)):  # the model's forward calls
        notes.rows.append((when, OPEN, number, 7, 0, ""))
        notes.rows.append((when + 1, CLOSE, number, 7, 0, ""))
    for when, optimizer in ((40, 1), (41, 2), (70, 1), (90, 1)):
        notes.rows.append((when, STEP, optimizer, 0, 0, ""))
    found = Log("cuda:0", 0, 0, events, {}).tally(notes)
    # The process's RSS read where steps may end: a step's is the last read by its end,
    # after its beginning (none in step 2: 69 is before it began, at 70).
    ram = np.array([[40, 1000], [41, 1100], [69, 2000]])
    table = steps.table(found.tally.steps, 0, ram)
    assert table is not None and table.by == "optimizer.step()"
    assert table.start.tolist() == [0, 100, 100]
    assert table.peak.tolist() == [150, 300, 200]
    assert table.end.tolist() == [100, 100, 200]
    assert table.began.tolist() == [0, 41, 70]
    assert table.ended.tolist() == [41, 70, 90]
    assert table.ram.tolist() == [1100, 2000, -1]


def test_without_an_optimizer_a_backward_pass_ends_a_step() -> None:
    """The gradients of a root module's backward pass (depth 0: ``ref`` 1) end a step at the
    last of them before the next forward call (``open``, depth 0) begins: 100 bytes made
    in each of two passes, each pass hit twice."""
    events = torch.tensor([[10, 0xA, 100, -1, -1], [40, 0xB, 100, -1, -1]])
    notes = Notes()
    for when, kind in ((5, OPEN), (20, HIT), (25, HIT), (30, OPEN), (50, HIT), (55, HIT)):
        notes.rows.append((when, kind, 1, 7, 0 if kind == OPEN else 1, ""))
    table = steps.table(Log("cpu", 0, 0, events, {}).tally(notes).tally.steps, 0, NO_RAM)
    assert table is not None and table.by == "backward"
    assert (table.ended.tolist(), table.end.tolist()) == ([25, 55], [100, 200])


class Trainer:
    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}


def test_outputs_kept_in_a_dict_of_an_object() -> None:
    """Each step's output (65,536 bytes) stays in a dictionary, an attribute of an object a
    variable holds."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer()
    with record() as rec:
        for step in range(STEPS):
            out = model(torch.randn(64, 256))
            trainer.cache[step] = out
            optimizer.zero_grad()
            out.square().mean().backward()
            optimizer.step()
    cpu = cpu_of(rec)
    assert cpu.growth is not None and cpu.growth.bytes_per_step == ACTIVATION
    found = site(cpu, "out = model(torch.randn(64, 256))")
    assert (found.bytes_per_step, found.reason) == (ACTIVATION, "held by dict `trainer.cache`")


def train_in_a_function(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    history = []
    for _ in range(STEPS):
        out = model(torch.randn(64, 256))
        history.append(out)
        optimizer.zero_grad()
        out.square().mean().backward()
        optimizer.step()


def test_a_loop_in_a_function_that_returned() -> None:
    """The outputs (65,536 bytes a step) are freed when the function returns, before the
    recording stops: the line is named from what was alive at the last step's end, and
    nothing holds them any more to say why; that autograd saved them (for ``square``,
    outside any module) is still known."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with record() as rec:
        train_in_a_function(model, optimizer)
    cpu = cpu_of(rec)
    assert cpu.growth is not None and cpu.growth.bytes_per_step == ACTIVATION
    found = site(cpu, "out = model(torch.randn(64, 256))")
    assert found.bytes_per_step == ACTIVATION
    assert found.reason == (
        "alive at the last step's end, freed before the recording stopped (what held it was"
        " gone); saved for backward"
    )
