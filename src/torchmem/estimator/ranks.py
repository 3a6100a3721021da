"""An estimate of every rank of a job, without its processes or GPUs: the function runs once
as each rank, on PyTorch's fake process group.

Collectives on the fake group return at once and move nothing, and the run is on fake
tensors anyway: what each rank allocates (its shards, the buffers FSDP2 all-gathers into,
what it computes) is what a real rank allocates. ``torch.distributed`` is initialised as
the rank before the function runs, with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` set as torchrun sets them on one node, and destroyed after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from torchmem._compat.fsdp import fake_process_group
from torchmem.errors import EstimateError
from torchmem.records.estimate import EstimateRecord

Estimate = TypeVar("Estimate", bound=EstimateRecord)
_ENVIRON = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def checked_world_size(world_size: object) -> int:
    """`world_size` if it is a whole number of ranks (1 or more); a ValueError naming it
    otherwise."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks, 1 or more: {world_size!r}")
    return world_size


def each_rank(one: Callable[[], Estimate], world_size: int, ranks: Sequence[int] = ()) -> Estimate:
    """`one()` run as each rank of `world_size` (only the `ranks` given, if any); the
    estimate of the rank with the highest peak (the lowest such rank), with every rank's
    in its ``ranks``. CPU estimates only, for now."""
    if not torch.distributed.is_available():
        raise EstimateError("estimates of ranks need torch.distributed, which this PyTorch lacks")
    if torch.distributed.is_initialized():
        raise EstimateError(
            "estimate(world_size=...) initialises torch.distributed as each rank in turn, but"
            " a process group is initialised already: estimate where there is none (and let"
            " fn use the one it finds, not initialise its own)"
        )
    found = []
    for rank in ranks or range(world_size):
        with _as_rank(rank, world_size):
            estimate = one()
        if estimate.device != "cpu":
            raise EstimateError(
                "estimates of ranks are of CPU tensors for now: pass device='cpu' (their"
                " bytes are what a GPU rank allocates, before the caching allocator rounds"
                " them). On a machine without a GPU, FSDP2 and DTensor put each shard on"
                " the CPU, where a GPU estimate sees none of it"
            )
        found.append(dataclasses.replace(estimate, rank=rank, world_size=world_size))
    seconds = sum(e.seconds for e in found)
    highest = max(found, key=lambda e: (e.peak_bytes, -e.rank))
    return dataclasses.replace(highest, ranks=tuple(found), seconds=seconds)


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int) -> Iterator[None]:
    """The process as `rank` of `world_size`: its environment, and its process group."""
    saved = {name: os.environ.get(name) for name in _ENVIRON}
    values = (rank, rank, world_size, world_size)
    os.environ.update({name: str(value) for name, value in zip(_ENVIRON, values, strict=True)})
    try:
        with fake_process_group(rank, world_size):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
