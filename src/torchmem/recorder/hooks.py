"""What a recording learns from PyTorch's global hooks while the user's code runs.

Models and optimizers are discovered without the user naming them: a global module
forward hook sees every module called, a global optimizer step hook every optimizer
stepped, and saved-tensor hooks every tensor autograd keeps for the backward pass. Each
sighting is a :class:`Mark`: at this time, the storage at this address was a parameter,
a gradient, optimizer state or an activation. The analysis gives each allocation the
first category of :data:`~torchmem.records.run.CATEGORIES` it was marked with.

Each module's forward call is an interval; so is its backward, from the moment the
gradient of one of its outputs is ready to the last moment a gradient of one of its inputs
(or, where no input needs one, of its parameters) is.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from torchmem._compat import disable_dynamo
from torchmem.tensors import discover

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, OTHER = range(5)
"""Category indices, in the order of :data:`~torchmem.records.run.CATEGORIES`."""
PENDING = 8
"""Backward passes awaited per module at most (more forward calls than backward passes,
e.g. evaluation with gradients on, drop the oldest)."""


@dataclass(frozen=True)
class Mark:
    """At `time` (``time.monotonic_ns()``), the storage at `ptr` on `device` was in `category`."""

    time: int
    device: str
    ptr: int
    category: int
    name: tuple[Any, ...] | None
    """What names it, resolved once the run is over: ``("param", module id, attribute)``,
    ``("grad", ...)``, ``("state", optimizer class, parameter id, key)``, ``("saved",
    module id)``."""
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Interval:
    """A module's forward or backward, in ``time.monotonic_ns()`` nanoseconds."""

    module: int
    """``id()`` of the module."""
    backward: bool
    start: int
    end: int


class Watcher:
    """Installs the global hooks on :meth:`start` and removes every one on :meth:`stop`.

    Use from the thread that will run the user's code: saved-tensor hooks are per thread.

    Args:
        address: what a mark's ``ptr`` is for a tensor (default: its storage's
            ``data_ptr()``, the address an allocator's log has).
    """

    def __init__(self, address: Callable[[torch.Tensor], int] | None = None) -> None:
        self._address = address or _data_ptr
        self.marks: list[Mark] = []
        self.intervals: list[Interval] = []
        self.modules: dict[int, torch.nn.Module] = {}
        """Every module called, by id, in the order of first call."""
        self.roots: list[torch.nn.Module] = []
        """Modules called while no other module's forward ran, in order."""
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.calls: dict[int, int] = {}
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        self._pending: dict[int, list[_Backward]] = {}
        self._saved: saved_tensors_hooks | None = None
        self._roots: set[int] = set()
        self._known: dict[int, torch.nn.Module] = {}  # modules seen, or alive at the end

    # Installing ------------------------------------------------------------------------

    def start(self) -> None:
        modules = torch.nn.modules.module
        # Dynamo must not trace the hooks (it fails on them): they run eagerly, and a
        # compiled module breaks its graph around them.
        self._handles = [
            modules.register_module_forward_pre_hook(_opaque(self._forward_pre)),
            modules.register_module_forward_hook(_opaque(self._forward), always_call=True),
            register_optimizer_step_pre_hook(_opaque(self._step_pre)),
            register_optimizer_step_post_hook(_opaque(self._step)),
        ]
        self._saved = saved_tensors_hooks(_opaque(self._pack), _opaque(_unpack))
        self._saved.__enter__()

    def stop(self, held: Iterable[object] = ()) -> None:
        """Remove every hook, then mark what the modules and optimizers hold: those seen,
        and those alive now that never ran while the hooks watched. Of the latter, the
        outermost modules among `held` (the recorded code's variables) name their
        parameters, as those that ran do."""
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None
        for handle in self._handles:
            handle.remove()
        for pending in self._pending.values():
            for backward in pending:
                self._close(backward)
        self._handles, self._pending = [], {}
        roots, optimizers = discover(gc.get_objects())
        held_ids = {id(value) for value in held}
        for root in roots:
            if id(root) in held_ids and id(root) not in self._roots:
                self.roots.append(root)
                self._roots.add(id(root))
            for module in root.modules():
                self._known.setdefault(id(module), module)
        for optimizer in optimizers:
            self.optimizers.setdefault(id(optimizer), optimizer)
        for module in self._known.values():
            self._mark_parameters(module)
        for optimizer in self.optimizers.values():
            self._mark_optimizer(optimizer)

    # Marks -----------------------------------------------------------------------------

    def mark(self, tensor: torch.Tensor, category: int, name: tuple[Any, ...] | None) -> None:
        try:
            ptr = self._address(tensor)
        except Exception:  # no storage (sparse, wrapper subclasses): nothing to attribute
            return
        if ptr:
            self.marks.append(
                Mark(
                    time.monotonic_ns(),
                    str(tensor.device),
                    ptr,
                    category,
                    name,
                    tuple(tensor.shape),
                    str(tensor.dtype),
                )
            )

    def _mark_parameters(self, module: torch.nn.Module) -> None:
        for attribute, param in module._parameters.items():
            if param is not None:
                self.mark(param, PARAMETERS, ("param", id(module), attribute))
                if param.grad is not None:
                    self.mark(param.grad, GRADIENTS, ("grad", id(module), attribute))

    def _mark_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        kind = type(optimizer).__name__
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.mark(param.grad, GRADIENTS, ("grad-of", id(param)))
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.mark(value, OPTIMIZER_STATE, ("state", kind, id(param), key))

    # Hooks ---------------------------------------------------------------------------

    def _stack(self) -> list[tuple[int, int]]:
        stack: list[tuple[int, int]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        key = id(module)
        if key not in self.modules:
            self.modules[key] = self._known[key] = module
            self.calls[key] = 0
        self.calls[key] += 1
        stack = self._stack()
        if not stack and key not in self._roots:
            self._roots.add(key)
            self.roots.append(module)
        self._mark_parameters(module)
        pending = self._pending.get(key)
        if pending:  # the backward passes done since its last call (never inside autograd)
            for backward in [b for b in pending if b.last is not None]:
                pending.remove(backward)
                self._close(backward)
        stack.append((key, time.monotonic_ns()))

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if not stack or stack[-1][0] != id(module):
            return
        key, started = stack.pop()
        self.intervals.append(Interval(key, False, started, time.monotonic_ns()))
        if not torch.is_grad_enabled():
            return
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if not outputs:
            return
        ends = [t for t in _tensors(args) if t.requires_grad]
        if not ends:
            ends = [p for p in module.parameters() if p.requires_grad]
        if not ends:
            return
        backward = _Backward(key)
        backward.handles = [register_multi_grad_hook(outputs, backward.begin, mode="any")]
        # One hook per tensor, not a multi-grad hook in mode "all": that one raises inside
        # torch.autograd.grad() for leaf tensors (parameters, inputs).
        backward.handles += [t.register_hook(backward.end) for t in ends]  # type: ignore[no-untyped-call]
        pending = self._pending.setdefault(key, [])
        pending.append(backward)
        if len(pending) > PENDING:
            self._close(pending.pop(0))

    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.setdefault(id(optimizer), optimizer)
        self._mark_optimizer(optimizer)

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._mark_optimizer(optimizer)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        stack = getattr(self._local, "stack", None)
        self.mark(tensor, ACTIVATIONS, ("saved", stack[-1][0]) if stack else None)
        # Not the tensor itself: a saved output (relu's, softmax's) would then hold its own
        # graph, a cycle through C++ that gc cannot break, and a forward pass without a
        # backward pass would never be freed. A detached alias shares storage and version.
        return tensor.detach()

    def _close(self, backward: _Backward) -> None:
        """Remove `backward`'s hooks; keep its interval if it ran."""
        for handle in backward.handles:
            handle.remove()
        if backward.started is not None and backward.last is not None:
            self.intervals.append(Interval(backward.key, True, backward.started, backward.last))


def _opaque(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` in a function Dynamo never traces (a bound method cannot carry the mark)."""

    def call(*args: Any) -> Any:
        return hook(*args)

    return disable_dynamo(call)


def _data_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Backward:
    """One forward call's backward: from the gradient of one of its outputs to the last
    gradient of its inputs (or parameters) seen before the module's next call."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.started: int | None = None
        self.last: int | None = None
        self.handles: list[RemovableHandle] = []

    def begin(self, grad: Any) -> None:
        if self.started is None:
            self.started = time.monotonic_ns()

    def end(self, grad: Any) -> None:
        if self.started is not None:
            self.last = time.monotonic_ns()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's arguments or output: tensors, tuples, lists, dict values."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
