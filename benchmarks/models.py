"""Models the estimator benchmarks measure: a GPT-2-small-sized transformer (124M
parameters, sequence 1024) with scaled-dot-product attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 50257, context: int = 1024, dim: int = 768, layers: int = 12
    ) -> None:
        heads = dim // 64
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt2_step(
    batch: int, sequence: int = 1024, layers: int = 12, dim: int = 768, device: str = "cuda"
) -> None:
    """One training step of GPT-2 small (smaller with fewer `layers` or a smaller `dim`):
    forward, cross-entropy, backward, AdamW."""
    model = GPT(context=sequence, dim=dim, layers=layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 50257, (batch, sequence), device=device)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), idx.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
