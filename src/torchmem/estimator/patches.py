"""What a fake run (:mod:`torchmem.estimator.fake`) changes in PyTorch while it runs, each
undone when its block ends."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchmem._compat.fake import forget_converted
from torchmem._compat.fsdp import sharding_propagation
from torchmem.errors import EstimateError
from torchmem.estimator.autocast import CudaRules
from torchmem.estimator.placement import GPU_AS_CPU


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` turns on CPU autocast with `dtype` (float16 where
    none is given, CUDA's default), casting GPU tensors by CUDA's rules
    (:class:`~torchmem.estimator.autocast.CudaRules`, put in place at the first such
    block), until the block ends."""
    original = torch.autocast.__init__
    rules = CudaRules(lambda tensor: tensor.device is GPU_AS_CPU)
    used = False

    def init(
        self: torch.autocast,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        nonlocal used
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
            if not used:
                used = True
                rules.__enter__()
        original(self, device_type, dtype, enabled, cache_enabled)

    torch.autocast.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autocast.__init__ = original  # type: ignore[method-assign]
        if used:
            rules.__exit__()


@contextlib.contextmanager
def compiles_seen(seen: list[bool]) -> Iterator[None]:
    """``torch.compile`` appends True to `seen` at each call, until the block ends."""
    original = torch.compile

    def compile(*args: Any, **kwargs: Any) -> Any:
        seen.append(True)
        return original(*args, **kwargs)

    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def swaps_forgetting(mode: Any) -> Iterator[None]:
    """``module.to()`` and ``module.half()`` swap each fake parameter with its converted
    self (``torch.utils.swap_tensors``), which fails while `mode` holds a weak reference
    to either: it drops them first, until the block ends."""
    original = torch.utils.swap_tensors

    def swap(first: torch.Tensor, second: torch.Tensor) -> None:
        forget_converted(mode)
        original(first, second)  # type: ignore[no-untyped-call]

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def foreach_optimizers() -> Iterator[None]:
    """Optimizers left to choose their implementation take the one they take on CUDA
    (``foreach``: whole lists of tensors per operator, with their temporaries), not the
    CPU's one tensor at a time, until the block ends."""
    chosen: list[dict[str, Any]] = []

    def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
                chosen.append(group)

    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        while chosen:
            chosen.pop()["foreach"] = None

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def rng_states_counted() -> Iterator[None]:
    """``torch.get_rng_state()`` (as ``torch.utils.checkpoint`` keeps it for each call, to
    run the forward again alike) makes its real state, which no operator makes, and a
    fake tensor of its bytes beside it, which the run counts, living as long as the state,
    until the block ends."""
    original = torch.get_rng_state
    kept: dict[int, torch.Tensor] = {}

    def get_rng_state() -> torch.Tensor:
        state = original()
        counted = torch.empty(state.shape, dtype=state.dtype)
        kept[id(counted)] = counted
        weakref.finalize(state.untyped_storage(), kept.pop, id(counted), None)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def storage_resizes_counted(meter: Any) -> Iterator[None]:
    """``UntypedStorage.resize_``, which no operator sees, told to `meter`'s ``resized``
    until the block ends: FSDP2 frees each unsharded parameter with ``resize_(0)`` after
    the forward and the backward of its module, and brings it back with ``resize_(n)``
    before the next all-gather."""
    original = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        nbytes = self.nbytes()
        out = original(self, size)
        meter.resized(self, nbytes)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def global_shapes_unlogged(meter: Any) -> Iterator[Callable[[], None]]:
    """Yields what to call once DTensor is in use: from then until the block ends, `meter`
    logs nothing while DTensor's sharding propagation runs an operator on fake tensors of
    the whole tensors' shapes, which only tell it the output's shape."""
    patched: list[tuple[type, str, Any]] = []

    def install() -> None:
        found = sharding_propagation()
        if patched or found is None:
            return
        kind, name = found
        original = getattr(kind, name)

        def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
            meter.paused += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                meter.paused -= 1

        setattr(kind, name, propagate)
        patched.append((kind, name, original))

    try:
        yield install
    finally:
        for kind, name, original in patched:
            setattr(kind, name, original)


@contextlib.contextmanager
def ddp_refused() -> Iterator[None]:
    """``DistributedDataParallel(...)`` raises an :class:`EstimateError` that says why,
    until the block ends: its reducer, in C++, checks the parameters' values across ranks
    and needs real results from its collectives, which a run on fake tensors has not."""
    kind = torch.nn.parallel.DistributedDataParallel
    original = kind.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise EstimateError(
            "DistributedDataParallel cannot run in an estimate: its reducer needs the"
            " values of real collectives. Estimate the step without it: DDP adds its"
            " gradient buckets (about the gradients' bytes, bucket_cap_mb at a time) to"
            " each rank"
        )

    kind.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        kind.__init__ = original  # type: ignore[method-assign]
