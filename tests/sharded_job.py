"""A training step under each of PyTorch's ways of spreading a model over ranks, run by
``tests/test_sharded.py`` under ``torchrun`` on CPU ranks (gloo). ``MODES`` (a comma-separated
list of :data:`STEPS`' keys) chooses which; every model and optimizer stays alive to the
end, where each rank writes what its local shards of parameters, gradients and optimizer
state hold (``truth<rank>.json``: bytes of each distinct storage, summed), and the peak of
each mode's step above its start, as a recording measured it (``peaks``)."""

import json
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

WIDTH = 256


def layers() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def fsdp2(reshard: bool, mixed: bool) -> nn.Module:
    model = layers()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)


def ddp(bucket_view: bool) -> nn.Module:
    return DistributedDataParallel(layers(), gradient_as_bucket_view=bucket_view)


def tensor_parallel() -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


STEPS: dict[str, Callable[[], nn.Module]] = {
    "fsdp2": lambda: fsdp2(reshard=True, mixed=False),
    "fsdp2-kept-bf16": lambda: fsdp2(reshard=False, mixed=True),
    "ddp": lambda: ddp(bucket_view=False),
    "ddp-bucket-view": lambda: ddp(bucket_view=True),
    "tp": tensor_parallel,
}


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {
        local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in tensors
    }
    return sum(storages.values())


def train(modes: str) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """A step of each of `modes`; every model and optimizer kept."""
    kept = []
    for mode in modes.split(","):
        model = STEPS[mode]()
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, WIDTH)).sum().backward()
        optimizer.step()
        kept.append((model, optimizer))
    return kept


if __name__ == "__main__":
    import torchmem

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    kept, peaks = [], {}
    for mode in os.environ["MODES"].split(","):
        with torchmem.record("cpu") as recording:
            kept += train(mode)
        cpu = recording.report().devices["cpu"]
        peaks[mode] = cpu.peak_bytes - cpu.start_bytes
    params = [p for model, _ in kept for p in model.parameters()]
    truth = {
        "parameters": nbytes(params),
        "gradients": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": nbytes(
            value
            for _, optimizer in kept
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    }
    with open(f"truth{dist.get_rank()}.json", "w") as file:
        json.dump({**truth, "peaks": peaks}, file)
    dist.destroy_process_group()
