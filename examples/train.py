"""A small training script to try `torchmem run` on: an MLP on random data, with Adam.

    torchmem run examples/train.py --steps 20

It runs on the GPU when there is one, else on the CPU in a few seconds.
"""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(args.batch_size, 784, device=device)
    targets = torch.randint(0, 10, (args.batch_size,), device=device)

    for step in range(args.steps):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")

    with torch.no_grad():
        accuracy = (model(inputs).argmax(1) == targets).float().mean().item()
    print(f"training accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
