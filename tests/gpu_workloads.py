"""Training steps whose real GPU memory is recorded by ``scripts/gpu_truth.py`` and
checked by the CPU tests (``tests/data/gpu_truth/recorded/``).

Each is built first (model, optimizer, inputs on the device), then one step runs; only the
step is inside the recorded history, as in PyTorch's own snapshot recipes. ``step(build(d))``
is also what the estimator is given, on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Workload:
    description: str
    build: Callable[[str], Any]
    """Makes what the step needs on a device (``"cuda"``)."""
    step: Callable[[Any], None]


def _mlp(device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(256, 784, device=device)
    targets = torch.randint(0, 10, (256,), device=device)
    return model, optimizer, inputs, targets


def _train_step(state: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]) -> None:
    model, optimizer, inputs, targets = state
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    optimizer.step()


def _gpt(device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    from benchmarks.models import GPT

    torch.manual_seed(0)
    model = GPT(context=512, layers=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 50257, (4, 512), device=device)
    return model, optimizer, idx, idx


def _lm_step(state: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]) -> None:
    model, optimizer, idx, targets = state
    optimizer.zero_grad(set_to_none=True)
    logits = model(idx)
    F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1)).backward()
    optimizer.step()


LM = dict(vocab=10_000, context=256, d_model=512, d_ff=2048, layers=4, heads=8, batch=4)
"""A small configuration of :mod:`transformer_lm` (the model of ../shared/gpu-truth)."""


def _lm(device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    import transformer_lm

    torch.manual_seed(0)
    config = transformer_lm.Config(**LM)
    model = transformer_lm.TransformerLM(config).to(device)
    optimizer = transformer_lm.AdamW(model.parameters())
    shape = (config.batch, config.context)
    tokens = torch.randint(config.vocab, shape, device=device)
    return model, optimizer, tokens, torch.randint(config.vocab, shape, device=device)


def _lm_xl(device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    import transformer_lm

    torch.manual_seed(0)
    config = transformer_lm.XL
    with torch.device(device):  # 13.6 GB of parameters: made where they live
        model = transformer_lm.TransformerLM(config)
    optimizer = transformer_lm.AdamW(model.parameters())
    shape = (config.batch, config.context)
    tokens = torch.randint(config.vocab, shape, device=device)
    return model, optimizer, tokens, torch.randint(config.vocab, shape, device=device)


def _lm_fullstep(
    state: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor],
) -> None:
    import transformer_lm

    model, optimizer, tokens, targets = state
    optimizer.zero_grad()
    transformer_lm.cross_entropy(model(tokens), targets).backward()
    optimizer.step()


def _lm_forward_bf16(
    state: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor],
) -> None:
    model, _, tokens, _ = state
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens)


WORKLOADS: dict[str, Workload] = {
    "mlp-adam-step": Workload(
        "MLP 784-1024-1024-10 (ReLU), batch 256, fp32: zero_grad, forward, cross-entropy,"
        " backward, Adam's first step (its state made in it)",
        _mlp,
        _train_step,
    ),
    "gpt2-2layers-adamw-step": Workload(
        "GPT-2-small-wide, 2 blocks (scaled_dot_product_attention, tied head), batch 4,"
        " sequence 512, fp32: zero_grad, forward, cross-entropy, backward, AdamW's first step",
        _gpt,
        _lm_step,
    ),
    "lm-small-fullstep-fp32": Workload(
        "tests/transformer_lm.py (the ../shared/gpu-truth model) at d_model 512, d_ff 2048,"
        " 4 layers, 8 heads, vocabulary 10000, batch 4, context 256, fp32: zero_grad,"
        " forward, cross-entropy, backward, AdamW's first step",
        _lm,
        _lm_fullstep,
    ),
    "lm-small-forward-bf16autocast": Workload(
        "the same model's forward with autograd on, under CUDA autocast to bfloat16",
        _lm,
        _lm_forward_bf16,
    ),
    "lm-2.7b-ctx128-fullstep-fp32": Workload(
        "the ../shared/gpu-truth workload itself: tests/transformer_lm.py at its 2.7B"
        " configuration (3,406,809,600 parameters), batch 4, context 128, fp32: zero_grad,"
        " forward, cross-entropy, backward, AdamW's first step",
        _lm_xl,
        _lm_fullstep,
    ),
}
