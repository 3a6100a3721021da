"""What a fake run (:mod:`torchmem.estimator.fake`) changes in PyTorch while it runs, each
undone when its block ends."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchmem._compat.fake import forget_converted
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
