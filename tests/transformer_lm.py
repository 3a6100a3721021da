"""A decoder-only Transformer language model and its training step, as the real GPU
snapshots in ``../shared/gpu-truth`` describe their workload (a "2.7B" model: d_model 2560,
d_ff 10240, 32 layers, 32 heads, vocabulary 10000; batch 4, context 128 or 512).

Written for the estimator's ground-truth tests: each line makes the temporaries the real
run's allocations show (RMSNorm through ``vector_norm`` and a square root, RoPE writing
into an empty tensor from tables indexed per position, attention and linear layers as
``einsum``, a softmax and a cross-entropy written out, AdamW's state made in its first
step), so that a difference from the real peak is the estimator's, not the model's. Each
size is a field of :class:`Config`: :data:`TINY` runs in a second, :data:`XL` is the real
one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 10_000
    context: int = 128
    d_model: int = 2560
    d_ff: int = 10_240
    layers: int = 32
    heads: int = 32
    theta: float = 10_000.0
    batch: int = 4


XL = Config()
"""The real workload's model (3,406,809,600 parameters), at context 128."""
TINY = Config(vocab=500, context=16, d_model=64, d_ff=256, layers=2, heads=4, batch=2)
"""The same shape of model, small enough for every test run."""


def parameters(config: Config) -> int:
    """The number of parameters of a :class:`TransformerLM` of `config`."""
    d, f = config.d_model, config.d_ff
    layer = 4 * d * d + 3 * d * f + 2 * d
    return 2 * config.vocab * d + config.layers * layer + d


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d_model))
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rms = torch.sqrt(norm**2 / self.d_model + self.eps)
        normed = x / rms
        scaled = torch.einsum("...d,d->...d", normed, self.weight)
        return scaled.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        b = self.w3(x)
        gated = a * torch.sigmoid(a)
        both = gated * b
        return self.w2(both)


class Rope(nn.Module):
    """Rotary position embedding: cosines and sines of each position, in one table."""

    def __init__(self, d_head: int, context: int, theta: float) -> None:
        super().__init__()
        frequencies = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), frequencies)
        self.register_buffer("table", torch.stack([angles.cos(), angles.sin()]), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.table[0][positions]
        sin = self.table[1][positions]
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # the same for every head
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.empty_like(x)
        rotated[..., 0::2] = even * cos - odd * sin
        rotated[..., 1::2] = even * sin + odd * cos
        return rotated


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    biggest = x.max(dim=dim, keepdim=True).values
    exps = torch.exp(x - biggest)
    total = exps.sum(dim=dim, keepdim=True)
    return exps / total


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    scores = torch.einsum("...qd,...kd->...qk", q, k)
    scores = scores / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask == 0, float("-inf"))
    probabilities = softmax(scores, dim=-1)
    return torch.einsum("...qk,...kd->...qd", probabilities, v)


class SelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        d = config.d_model
        self.heads = config.heads
        self.q = Linear(d, d)
        self.k = Linear(d, d)
        self.v = Linear(d, d)
        self.output = Linear(d, d)
        self.rope = Rope(d // config.heads, config.context, config.theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d = x.shape
        h = self.heads
        q = self.q(x).view(batch, length, h, d // h).transpose(1, 2)
        k = self.k(x).view(batch, length, h, d // h).transpose(1, 2)
        v = self.v(x).view(batch, length, h, d // h).transpose(1, 2)
        positions = torch.arange(length, device=x.device).expand(batch, length)
        q_turned = self.rope(q, positions)
        k_turned = self.rope(k, positions)
        causal = torch.triu(torch.ones(length, length, device=x.device), diagonal=1).bool()
        causal = ~causal
        heads = attention(q_turned, k_turned, v, causal.expand(batch, h, length, length))
        joined = heads.transpose(1, 2).reshape(batch, length, d)
        return self.output(joined)


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln1 = RMSNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.ln2 = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        h = self.attn(h)
        x = x + h
        h = self.ln2(x)
        h = self.ffn(h)
        return x + h


class TransformerLM(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = Embedding(config.vocab, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.d_model)
        self.lm_head = Linear(config.d_model, config.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.lm_head(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over positions of ``-log softmax(logits)[target]``."""
    biggest = logits.max(dim=-1, keepdim=True).values
    shifted = logits - biggest
    exps = torch.exp(shifted)
    total = exps.sum(dim=-1)
    rows = torch.arange(targets.shape[0])[:, None]
    columns = torch.arange(targets.shape[1])[None, :]
    picked = shifted[rows, columns, targets]
    loss = torch.log(total) - picked
    return loss.mean()


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay; its two moments are made in the first step."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["m"], state["v"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                rate = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                update = m / torch.sqrt(v).add_(group["eps"])
                p.sub_(update, alpha=rate)
                p.mul_(1 - group["lr"] * group["weight_decay"])


def built(config: Config) -> tuple[TransformerLM, torch.Tensor, torch.Tensor]:
    """The model, built on the CPU and moved to the GPU, its input tokens on the GPU and
    the targets on the CPU, as the real run had them before its memory history began."""
    model = TransformerLM(config).to("cuda")
    shape = (config.batch, config.context)
    tokens = torch.randint(config.vocab, shape, device="cuda")
    targets = torch.randint(config.vocab, shape)
    return model, tokens, targets


def forward(config: Config, autocast: torch.dtype | None = None) -> None:
    """The forward pass with autograd on (under CUDA autocast to `autocast`, if given)."""
    model, tokens, _ = built(config)
    if autocast is None:
        model(tokens)
    else:
        with torch.autocast("cuda", dtype=autocast):
            model(tokens)


def fullstep(config: Config) -> None:
    """One training step of a fresh model: the optimizer's state is made in it."""
    model, tokens, targets = built(config)
    optimizer = AdamW(model.parameters())
    optimizer.zero_grad()
    logits = model(tokens)
    loss = cross_entropy(logits, targets)
    loss.backward()
    optimizer.step()
