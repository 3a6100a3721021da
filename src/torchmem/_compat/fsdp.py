"""The private parts of PyTorch's distributed training that torchmem uses.

FSDP2's, for a recording to tell its communication buffers apart from the parameters and
gradients they hold for a while: a ``fully_shard`` module's parameter group, the modules
whose parameters it manages, and the buffers its collectives use. Every look-up is
guarded: where a release moved one, those buffers count as whatever else they are seen
as, and nothing fails. DTensor's sharding propagation and the fake process group, for
estimates of each rank."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from torchmem._compat import is_traceable_wrapper_subclass


def param_group(module: torch.nn.Module) -> Any | None:
    """The parameter group of a module that ``fully_shard`` made; None for any other module
    (and without importing FSDP where the program did not)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    if kind is None or not isinstance(module, kind):
        return None
    try:
        return module._get_fsdp_state()._fsdp_param_group
    except (AttributeError, AssertionError):
        return None


def managed_modules(group: Any) -> list[torch.nn.Module]:
    """The modules whose parameters `group` shards (each parameter's module, and the other
    modules that share it)."""
    found: list[torch.nn.Module] = []
    for param in getattr(group, "fsdp_params", ()):
        info = getattr(param, "_module_info", None)
        if info is not None:
            found += [info.module, *getattr(info, "shared_modules", ())]
    return found


Owner = tuple[torch.nn.Module, str, str]
"""The module and attribute of the parameter a buffer is of, and what the buffer is:
``"gathered"`` (the parameter all-gathered whole) or ``"unsharded-grad"`` (its whole
gradient, before the reduce-scatter)."""


def buffers(group: Any) -> list[tuple[torch.Tensor, Owner | None]]:
    """The buffers of `group`'s collectives that hold memory now, each with its
    :data:`Owner` (None for one the group's parameters share): the unsharded parameters,
    their all-gather outputs and their whole gradients, the all-gather output not yet
    copied out, and the reduce-scatter and all-reduce inputs FSDP keeps until the next
    collective. None (a group that died) has none."""
    found: list[tuple[Any, Owner | None]] = []
    for param in getattr(group, "fsdp_params", ()):
        info = getattr(param, "_module_info", None)
        unsharded = getattr(param, "_unsharded_param", None)
        gathered = (
            unsharded,
            *getattr(param, "all_gather_outputs", ()),
            *getattr(param, "_unsharded_inner_tensors", ()),
        )
        grads = (
            getattr(unsharded, "grad", None),
            getattr(param, "unsharded_accumulated_grad", None),
        )
        for kind, tensors in (("gathered", gathered), ("unsharded-grad", grads)):
            for tensor in tensors:
                owner = None if info is None else (info.module, info.param_name, kind)
                found.append((tensor, owner))
    context = getattr(group, "comm_ctx", None)
    states = getattr(context, "reduce_scatter_states", None) or ()
    shared = [getattr(state, "reduce_scatter_input", None) for state in states]
    state = getattr(context, "all_gather_state", None)
    pending = getattr(group, "_all_gather_result", None)
    for result in (getattr(state, "all_gather_result", None), pending):
        shared.append(getattr(result, "all_gather_output", None))
    shared.append(getattr(getattr(group, "_all_reduce_state", None), "all_reduce_input", None))
    found += [(tensor, None) for tensor in shared]
    return [
        (tensor, owner)
        for tensor, owner in found
        if isinstance(tensor, torch.Tensor)
        and not is_traceable_wrapper_subclass(tensor)
        and tensor.untyped_storage().nbytes()
    ]


def sharding_propagation() -> tuple[type, str] | None:
    """DTensor's sharding propagator and the name of its method that runs an operator on
    fake tensors of the whole (unsharded) shapes to learn its output's (once per operator
    and shapes: DTensor caches it); None where DTensor is not imported or has moved it."""
    module = sys.modules.get("torch.distributed.tensor._sharding_prop")
    kind = getattr(module, "ShardingPropagator", None)
    name = "_propagate_tensor_meta_non_cached"
    return (kind, name) if isinstance(kind, type) and hasattr(kind, name) else None


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """``torch.distributed`` initialised as `rank` of `world_size` on PyTorch's fake
    process group (its test backend ``"fake"``: collectives return at once and move no
    data; no process, no network), and destroyed when the block ends."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    torch.distributed.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=world_size
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def wait_tensor() -> Any | None:
    """The functional collectives' ``wait_tensor`` operator (it returns its input, done
    with); None where this PyTorch has no functional collectives."""
    namespace = getattr(torch.ops, "_c10d_functional", None)
    return getattr(getattr(namespace, "wait_tensor", None), "default", None)
