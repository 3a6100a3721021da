"""The CPU estimate against every CPU tensor of the real run (the CPU meter), to the byte,
where the real kernels allocate what the fake run's do not (:mod:`torchmem.estimator.kernels`):
a Python number given for a tensor, the CPU kernels' casts, a transposed matrix copied
through a block, and backward formulas that write in place on real tensors only."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchmem
import transformer_lm as lm
from torchmem.estimator import estimate

pytestmark = pytest.mark.integration


def measured(step: Callable[[], Any]) -> int:
    """The peak of a real run of `step` above the memory in use before it, by the CPU meter
    (after one run first: a kernel's first use may fill caches)."""
    step()
    gc.collect()
    with torchmem.meter("cpu").window() as window:
        step()
        return window.peak() - window.start


def estimated(step: Callable[[], Any]) -> int:
    return estimate(step, device="cpu").peak_bytes


def mlp() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    return model, lambda model: F.cross_entropy(model(x), y)


def transformer() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """tests/transformer_lm.py's model at its tiny size: an embedding and cross-entropy by
    indexing, RMSNorm dividing by Python numbers, a product's transposed gradient."""
    config = lm.TINY
    shape = (config.batch, config.context)
    tokens, targets = torch.randint(config.vocab, shape), torch.randint(config.vocab, shape)
    return lm.TransformerLM(config), lambda model: lm.cross_entropy(model(tokens), targets)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"foreach": False}),
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adam": (torch.optim.Adam, {"foreach": False}),
    "adam-foreach": (torch.optim.Adam, {"foreach": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    "sgd-momentum-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", [mlp, transformer])
def test_two_training_steps_are_estimated_to_the_byte(
    model: Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]], optimizer: str
) -> None:
    """Adam's and AdamW's steps peak at ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` (or
    its foreach form): 12 bytes the fake run did not make, the divisor as a double and as
    a float; SGD's steps peak in the backward pass, where the transformer's indexing
    backward writes in place and its weights' transposed gradients are copied through a
    block of 60 x 60 floats."""
    kind, options = OPTIMIZERS[optimizer]

    def step() -> None:
        torch.manual_seed(0)
        built, loss = model()
        chosen = kind(built.parameters(), **options)
        for _ in range(2):
            chosen.zero_grad()
            loss(built).backward()
            chosen.step()

    assert estimated(step) == measured(step)


def test_a_number_given_for_a_tensor_is_a_double_cast_to_the_tensors_dtype() -> None:
    def step() -> None:
        x = torch.zeros(1024)
        y = x / 2.0  # noqa: F841 (4,096 bytes, and 2.0 as an 8-byte double and a 4-byte float)

    assert estimated(step) == measured(step) == 4096 + 4096 + 8 + 4


def test_a_bool_mask_times_floats_is_cast_to_floats_first() -> None:
    def step() -> None:
        x = torch.zeros(1024)
        mask = torch.zeros(1024, dtype=torch.bool)
        y = x * mask  # noqa: F841 (the mask as 1,024 floats while the product is made)

    assert estimated(step) == measured(step) == 4096 + 1024 + 4096 + 4096


def test_autograd_keeps_a_number_it_multiplied_by_until_the_backward_pass() -> None:
    def step() -> None:
        x = torch.zeros(1024, requires_grad=True)
        (x * 0.5).sum().backward()

    # At the gradient's product: x and its gradient (4,096 bytes each); 0.5, kept as a
    # double (8 bytes) since the forward pass; the sum, the backward pass's seed and 0.5
    # cast to a float for the product (4 bytes each).
    assert estimated(step) == measured(step) == 2 * 4096 + 8 + 3 * 4


def test_mean_divides_by_the_count_made_a_tensor() -> None:
    def step() -> None:
        x = torch.zeros(1024)
        x.mean()

    assert estimated(step) == measured(step) == 4096 + 4 + 8 + 4


def test_a_transposed_gradient_is_copied_through_a_block() -> None:
    def step() -> None:
        weight = torch.zeros(512, 64, requires_grad=True)
        x = torch.ones(32, 64)
        # The weight's gradient is made transposed (as grad.T @ x): copied into .grad
        # through a block of 60 x 60 floats (14,400 bytes), at the step's peak.
        torch.einsum("bi,oi->bo", x, weight).square().sum().backward()

    assert estimated(step) == measured(step) == 415_816


INDEXING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "index": lambda w: w[torch.arange(0, 1000, 8)],
    "gather": lambda w: w.gather(1, torch.zeros(1000, 4, dtype=torch.long)),
    "index_select": lambda w: w.index_select(0, torch.arange(0, 1000, 8)),
    "max": lambda w: w.max(-1).values,
    "topk": lambda w: w.topk(4, -1).values,
}


@pytest.mark.parametrize("select", INDEXING)
def test_a_selections_gradient_is_written_in_place_into_zeros(select: str) -> None:
    """Real tensors' backward formulas write the selected gradients into new zeros in
    place; the fake run's would make a second tensor as large as the weight."""

    def step() -> None:
        weight = torch.zeros(1000, 64, requires_grad=True)
        INDEXING[select](weight).square().sum().backward()

    assert estimated(step) == measured(step)
