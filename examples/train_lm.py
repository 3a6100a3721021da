"""A long training run to try `torchmem run` on: a small transformer language model (token
and position embeddings, 2 blocks of causal self-attention and an MLP with LayerNorm,
d_model 32) learning to recite a random phrase, with fused AdamW; a fresh batch of 4
sequences of 16 tokens each step.

    torchmem run examples/train_lm.py --steps 2000

Each step is small (a few milliseconds on one CPU core), so thousands of them make a long
recording quickly; the options make the model larger. It runs on the GPU when there is
one, else on the CPU (``--device`` picks). The benchmarks run it for 2,000 and 20,000
steps on the CPU.
"""

import argparse
import time

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
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda when there is one)")
    args = parser.parse_args()

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = LM(args.vocab, args.context, args.d_model, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    # The text: a random phrase of 61 tokens, over and over; the model learns to recite it.
    phrase = torch.randint(0, args.vocab, (61,), device=device)
    text = phrase.repeat(args.context * 4)
    offsets = torch.arange(args.context + 1, device=device)

    started = time.perf_counter()
    every = max(1, args.steps // 10)
    for step in range(args.steps):
        starts = torch.randint(0, len(text) - args.context - 1, (args.batch_size, 1), device=device)
        batch = text[starts + offsets]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % every == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}")
    seconds = time.perf_counter() - started
    each = seconds / max(args.steps, 1) * 1e3
    print(f"{args.steps} steps in {seconds:.1f} s ({each:.2f} ms a step)")


if __name__ == "__main__":
    main()
