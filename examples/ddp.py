"""A small DistributedDataParallel job to try `torchmem run` under torchrun on: an MLP on
random data, with Adam, where rank 0 also keeps a copy of the best weights (the kind of
extra that makes one rank hold more than the others).

    torchrun --standalone --nproc-per-node 2 -m torchmem run examples/ddp.py

Each rank uses its own GPU (NCCL) where there are enough, else the CPU (gloo).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if gpus:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if gpus else "gloo")
    device = torch.device("cuda", local_rank) if gpus else torch.device("cpu")
    rank = dist.get_rank()

    torch.manual_seed(rank)
    model = nn.Sequential(
        nn.Linear(784, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if gpus else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(args.batch_size, 784, device=device)
    targets = torch.randint(0, 10, (args.batch_size,), device=device)

    best, best_loss = None, float("inf")
    for _ in range(args.steps):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and loss.item() < best_loss:
            best_loss = loss.item()
            best = {name: value.clone() for name, value in model.state_dict().items()}
    if rank == 0 and best is not None:
        print(f"best loss {best_loss:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
