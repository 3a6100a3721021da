"""How many ranks a step needs: the fewest across which it fits a device's memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchmem.estimator import gpus
from torchmem.estimator.api import estimate
from torchmem.estimator.ranks import each_rank

MAX_WORLD_SIZE = 2**14
"""The most ranks :func:`min_world_size` tries."""


def min_world_size(
    fn: Callable[..., Any],
    *args: Any,
    capacity: int | float | str,
    device: str = "cpu",
    **kwargs: Any,
) -> int | None:
    """The fewest ranks, a power of two, across which ``fn(*args, **kwargs)`` fits
    `capacity` (bytes, a size string like ``"80 GiB"``, or a GPU's name, ``"H100-80GB"``)
    on every rank; None where no number of ranks does: what sharding does not divide (the
    activations) outgrows it.

    `fn` shards its model over the ranks it finds (``fully_shard``, tensor parallelism),
    as for :func:`torchmem.estimate` with a `world_size`; CPU tensors only, for now. Each
    world size tried is estimated as its rank 0 (with FSDP2's and DTensor's chunks, rank 0
    holds the most), and the first whose rank 0 fits, as every rank: the answer is where
    they all fit. A peak that sharding divides falls as ``floor + shared / ranks``: two
    world sizes give the floor, and where it is above the capacity no more are tried.
    """
    limit = gpus.capacity(capacity)

    def one() -> Any:
        return estimate(fn, *args, device=device, **kwargs)

    world_size, before = 1, None
    while world_size <= MAX_WORLD_SIZE:
        peak = each_rank(one, world_size, ranks=(0,)).needed_bytes
        if peak <= limit and (world_size == 1 or each_rank(one, world_size).fits(limit)):
            return world_size
        if before is not None and 2 * peak - before >= limit:
            return None  # the floor that no number of ranks divides is above the capacity
        world_size, before = world_size * 2, peak
    return None
