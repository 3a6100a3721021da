"""Growth that finds what users report: lines that sum to the growth exactly, none at 0 B;
the variables that keep autograd graphs of every step, and the one that chains them; the
process's RAM at each step's end. Real loops on CPU tensors under the counting allocator.

As in ``test_steps.py``, the models have no biases and the batches are 64 x 256 float32:
each activation is 65,536 bytes, each row of a batch 1,024.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import torchmem
from torchmem.records.run import DeviceRun, Growth, HeldGraph

pytestmark = pytest.mark.counting
STEPS = 6
ACTIVATION = 65_536
ROW = 1_024


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 256, bias=False)
    )


def cpu_of(rec: torchmem.Recording) -> DeviceRun:
    return rec.report().devices["cpu"]


def growth_of(rec: torchmem.Recording) -> Growth:
    growth = cpu_of(rec).growth
    assert growth is not None
    return growth


def test_the_lines_sum_to_the_growth_a_tensor_replaced_by_a_larger_one_too() -> None:
    """Each step keeps its output in ``outputs`` (65,536 bytes) and adds a row of its batch
    to ``history`` (1,024 bytes): ``torch.cat`` makes a larger tensor each step and the
    one before is freed, so no allocation of that line lives from one step to the next;
    what the line keeps is the difference, 1,024 bytes a step. The lines sum to the
    growth, 66,560 bytes a step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    history = torch.empty(0, 256)
    gc.collect()
    with torchmem.record("cpu") as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            out = model(x)
            outputs.append(out)
            optimizer.zero_grad()
            out.square().mean().backward()
            optimizer.step()
            history = torch.cat([history, x[:1]])
    growth = growth_of(rec)
    assert (growth.bytes_per_step, growth.exact) == (ACTIVATION + ROW, True)
    assert [(s.source, s.bytes_per_step, s.reason) for s in growth.sites] == [
        ("out = model(x)", ACTIVATION, "held by list `outputs`"),
        ("history = torch.cat([history, x[:1]])", ROW, "held by `history`"),
    ]
    assert sum(s.bytes_per_step for s in growth.sites) == growth.bytes_per_step


def test_a_tensor_kept_once_is_no_line_of_0_bytes() -> None:
    """The outputs kept as above, and in step 3 a 2-byte tensor kept once: the steps do not
    rise alike, so the growth is their mean, 327,682 bytes over 5 steps: 65,536 bytes a
    step (2 bytes left out). Over the steps measured (1 to 4: what the last made may still
    be the loop's variables') the outputs' line kept 65,536 bytes a step, the 2-byte
    tensor's half a byte: the growth is the outputs' line alone, and no line is listed at
    0 bytes."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    kept = {}
    gc.collect()
    with torchmem.record("cpu") as rec:
        for step in range(STEPS):
            out = model(torch.randn(64, 256))
            outputs.append(out)
            optimizer.zero_grad()
            out.square().mean().backward()
            optimizer.step()
            if step == 3:
                kept["once"] = torch.zeros(1, dtype=torch.int16)
    growth = growth_of(rec)
    assert (growth.bytes_per_step, growth.exact) == (ACTIVATION, False)
    assert [(s.source, s.bytes_per_step) for s in growth.sites] == [
        ("out = model(torch.randn(64, 256))", ACTIVATION)
    ]


def test_a_list_of_losses_keeps_a_graph_of_each_step() -> None:
    """``losses.append(loss)`` after the backward pass: 4 bytes a step, and each loss
    keeps its step's graph (``MeanBackward0``, ``PowBackward0``, two ``MmBackward0`` and
    their ``TBackward0``, ``ReluBackward0``: 7 nodes, and the two weights' gradient
    accumulators, shared): 6 x 7 + 2 = 44 nodes. The loop's ``loss`` holds the last one's
    only."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    gc.collect()
    with torchmem.record("cpu") as rec:
        for _ in range(STEPS):
            loss = model(torch.randn(64, 256)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss)
    growth = growth_of(rec)
    assert growth.bytes_per_step == 4
    assert growth.graphs == (HeldGraph("list `losses`", STEPS, 44, chained=False),)
    assert isinstance(growth.ram_bytes_per_step, int)


class Recurrent(nn.Module):
    """A recurrent model that keeps its hidden state across calls without detaching it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(256, 256, bias=False)
        self.rec = nn.Linear(256, 256, bias=False)
        self.hidden = torch.zeros(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = torch.tanh(self.inp(x) + self.rec(self.hidden))
        return self.hidden


def test_the_attribute_that_chains_the_steps_graphs_is_named() -> None:
    """``model.hidden`` is the previous step's hidden state, graph and all: each step's
    graph reaches the one before through it, and ``backward(retain_graph=True)`` (which
    the second step needs to go back through the first's) keeps them all. Each step keeps
    its batch (saved by ``inp``) and its hidden state (saved by ``tanh``, and by ``rec``
    of the next step): 131,072 bytes. The loss reaches every step's graph too, through
    ``model.hidden``: that is named, with its fix. No optimizer: a step ends with its
    backward pass."""
    model = Recurrent()
    gc.collect()
    with torchmem.record("cpu") as rec:
        for _ in range(STEPS):
            x = torch.randn(64, 256)
            loss = model(x).square().mean()
            loss.backward(retain_graph=True)
    growth = growth_of(rec)
    assert (growth.bytes_per_step, growth.exact) == (2 * ACTIVATION, True)
    graph = "kept with the autograd graph of `model.hidden`"
    assert [(s.source, s.bytes_per_step) for s in growth.sites] == [
        ("x = torch.randn(64, 256)", ACTIVATION),
        ("self.hidden = torch.tanh(self.inp(x) + self.rec(self.hidden))", ACTIVATION),
    ]
    assert all(graph in (s.reason or "") for s in growth.sites)
    assert [(g.holder, g.steps, g.chained) for g in growth.graphs] == [
        ("`model.hidden`", STEPS, True)
    ]


class LSTMModel(nn.Module):
    """``nn.LSTM`` keeping its ``(h, c)`` across calls without detaching them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 16)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.hidden = self.lstm(x, self.hidden)
        return self.head(out)


def test_an_lstm_keeping_its_state_names_it() -> None:
    """The same with ``nn.LSTM`` (what it saves is PyTorch's own, so no bytes are claimed):
    the tuple ``model.hidden`` chains the steps' graphs, and what they saved is kept with
    its graph, not the loss's."""
    model = LSTMModel()
    gc.collect()
    with torchmem.record("cpu") as rec:
        for _ in range(STEPS):
            loss = model(torch.randn(4, 10, 16)).square().mean()
            loss.backward(retain_graph=True)
    growth = growth_of(rec)
    assert [(g.holder, g.steps, g.chained) for g in growth.graphs] == [
        ("tuple `model.hidden`", STEPS, True)
    ]
    first = growth.sites[0]
    assert first.source == "out, self.hidden = self.lstm(x, self.hidden)"
    assert "the autograd graph of a tensor in tuple `model.hidden`" in (first.reason or "")
