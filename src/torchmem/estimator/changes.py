"""Changes to a training step made while it runs, without editing its code, and what the
step does that a change would alter.

:func:`applied` puts the changes of a :class:`Changes` in place for as long as its block
runs and takes every one away when it ends, also on error: the same block serves the
estimate of a changed step (inside the function an estimate runs on fake tensors) and a
real run of it, which is how advice is checked.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.checkpoint import checkpoint

from torchmem._objects import class_name


@dataclass(frozen=True)
class Changes:
    """Which changes to make to a step."""

    device_type: str = "cuda"
    """Where the step runs: ``"cuda"`` or ``"cpu"`` (the autocast's device)."""
    checkpoint: frozenset[str] = frozenset()
    """Names of modules (as an estimate's modules are named: dotted from the outermost
    module called, prefixed with its class's name where several were) whose forward calls
    run under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while
    gradients are on."""
    autocast: bool = False
    """Whether each outermost module's forward runs under ``torch.autocast(device_type,
    dtype=torch.bfloat16)``."""
    set_to_none: bool = False
    """Whether ``zero_grad(set_to_none=False)`` (of an optimizer or a module) sets the
    gradients to None instead."""
    no_foreach: bool = False
    """Whether each optimizer step runs with ``foreach=False`` in the parameter groups that
    would use the ``foreach`` implementation (not fused ones)."""


@dataclass
class Seen:
    """What a step did that a change would alter, counted while :func:`applied` ran."""

    autocast: int = 0
    """Forward calls of outermost modules that ran with autocast already on."""
    kept_gradients: int = 0
    """Calls of ``zero_grad(set_to_none=False)``."""
    foreach_steps: int = 0
    """Optimizer steps with at least one parameter group that uses ``foreach``."""


@contextlib.contextmanager
def applied(changes: Changes, seen: Seen | None = None) -> Iterator[Seen]:
    """Make `changes` to every step that runs inside the block, counting in `seen` (a new
    :class:`Seen` where None is given, yielded) what the step did. Patches
    ``torch.nn.Module.__call__``, ``torch.nn.Module.zero_grad`` and
    ``torch.optim.Optimizer.zero_grad`` and adds global optimizer step hooks, all undone
    when the block ends, however it ends."""
    seen = Seen() if seen is None else seen
    calls = _Calls(changes, seen)
    module_call = torch.nn.Module.__call__
    zeroes = {cls: cls.zero_grad for cls in (torch.nn.Module, torch.optim.Optimizer)}
    groups = _Groups(changes, seen)
    handles = [
        register_optimizer_step_pre_hook(groups.before),
        register_optimizer_step_post_hook(groups.after),
    ]
    torch.nn.Module.__call__ = calls.wrapped(module_call)  # type: ignore[method-assign]
    for cls, original in zeroes.items():
        cls.zero_grad = _zero_grad(original, changes, seen)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.nn.Module.__call__ = module_call  # type: ignore[method-assign]
        for cls, original in zeroes.items():
            cls.zero_grad = original  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()
        groups.restore()


class _Calls:
    """Module calls: the names of the modules (from the outermost ones called, as an
    estimate names them), autocast around the outermost calls, checkpoints around the
    chosen modules' calls."""

    def __init__(self, changes: Changes, seen: Seen) -> None:
        self.changes = changes
        self.seen = seen
        self.names: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = (
            weakref.WeakKeyDictionary()
        )
        self.roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.depth = 0
        """Forward calls running now (none in a backward pass's recomputation)."""

    def named(self, root: torch.nn.Module) -> None:
        """Name `root`, an outermost module, and the modules in it: each by its dotted name,
        and by that name prefixed with the root's class's name (as where several
        outermost modules ran)."""
        self.roots.add(root)
        kind = class_name(root)
        for name, module in root.named_modules(remove_duplicate=False):
            prefixed = f"{kind}.{name}" if name else kind
            self.names[module] = self.names.get(module, frozenset()) | {name, prefixed}

    def wrapped(self, original: Any) -> Any:
        def call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.depth == 0 and module not in self.names:
                self.named(module)
            outermost = self.depth == 0 and module in self.roots
            self.depth += 1
            try:
                with contextlib.ExitStack() as stack:
                    if outermost:
                        self.around_root(stack)
                    if self.chosen(module):
                        return checkpoint(original, module, *args, use_reentrant=False, **kwargs)
                    return original(module, *args, **kwargs)
            finally:
                self.depth -= 1

        return call

    def around_root(self, stack: contextlib.ExitStack) -> None:
        if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
            self.seen.autocast += 1
        elif self.changes.autocast:
            stack.enter_context(torch.autocast(self.changes.device_type, dtype=torch.bfloat16))

    def chosen(self, module: torch.nn.Module) -> bool:
        """Whether `module`'s call runs checkpointed."""
        if not self.changes.checkpoint or not torch.is_grad_enabled():
            return False
        return bool(self.names.get(module, frozenset()) & self.changes.checkpoint)


def _zero_grad(original: Any, changes: Changes, seen: Seen) -> Any:
    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        if not set_to_none:
            seen.kept_gradients += 1
            set_to_none = changes.set_to_none
        original(self, set_to_none)

    return zero_grad


class _Groups:
    """Optimizer steps: count those that use ``foreach``; with
    :attr:`Changes.no_foreach`, set their groups' ``foreach`` to False for the step."""

    def __init__(self, changes: Changes, seen: Seen) -> None:
        self.changes = changes
        self.seen = seen
        self.changed: list[tuple[dict[str, Any], Any]] = []

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        using = [group for group in optimizer.param_groups if _uses_foreach(group)]
        if using:
            self.seen.foreach_steps += 1
        if self.changes.no_foreach:
            for group in using:
                self.changed.append((group, group.get("foreach")))
                group["foreach"] = False

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back each group's ``foreach`` where it is still the False set here (another
        hook may have put its own value back since)."""
        while self.changed:
            group, value = self.changed.pop()
            if group.get("foreach") is False:
                group["foreach"] = value


def _uses_foreach(group: dict[str, Any]) -> bool:
    """Whether an optimizer's parameter group steps with the ``foreach`` implementation:
    ``foreach=True``, or None (the default) with every parameter on a GPU, where PyTorch
    picks it; never with ``fused``."""
    if "foreach" not in group or group.get("fused"):  # LBFGS has no foreach
        return False
    foreach = group.get("foreach")
    if foreach is None:
        params = group.get("params", ())
        return bool(params) and all(p.is_cuda for p in params)
    return bool(foreach)
