"""Our saved-tensor hooks beside the program's and PyTorch's own: taken off the stack
wherever they are (:func:`remove`), and stepping aside where PyTorch forbids such hooks
(:data:`step_aside`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torchmem._compat import lookup
from torchmem._compat.autograd import (
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    saved_tensors_hooks_readable,
    top_saved_tensors_hooks,
)

_AUTOGRAD = lookup("torch._C._autograd")
_BINDING = "_saved_tensors_hooks_disable"
_DISABLE = lookup(f"torch._C._autograd.{_BINDING}")
if "fail_if_non_empty" not in (getattr(_DISABLE, "__doc__", None) or ""):
    _DISABLE = None  # a PyTorch whose binding always refuses: torch.func raises under us


def remove(pack: Callable[..., Any]) -> None:
    """Take the saved-tensor hooks whose pack hook is `pack` off this thread's stack,
    wherever they are on it: hooks the program pushed above ours (a ``saved_tensors_hooks``
    scope entered inside a recording and left after it) stay, in their order. Where this
    PyTorch cannot read the stack, the top ones go."""
    if not saved_tensors_hooks_readable():
        pop_saved_tensors_hooks()
        return
    above = []
    while (top := top_saved_tensors_hooks()) is not None:
        pop_saved_tensors_hooks()
        if top[0] is pack:
            break
        above.append(top)
    for found, unpack in reversed(above):
        push_saved_tensors_hooks(found, unpack)


class StepAside:
    """Our saved-tensor hooks step aside where PyTorch forbids such hooks: torch.func's
    transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``) disable saved-tensor hooks
    (:func:`torch.autograd.graph.disable_saved_tensors_hooks`), which raises while any are
    on the thread's stack. While a watcher records, the binding that function calls,
    ``torch._C._autograd._saved_tensors_hooks_disable``, is wrapped: where every hook on the
    stack is ours, it disables them without raising (PyTorch's own ``fail_if_non_empty=False``,
    as its compiled autograd does), so the hooks are not called inside the region and
    come back at its end; where the program's own hooks are there, it raises as PyTorch
    does. The public function is untouched, so ``torch.compile`` still recognises it
    (``fullgraph=True`` of a transform compiled inside a recording). The last watcher to
    stop puts the binding back. The activations such a region saves are not marked (they
    count as other memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packs: set[Callable[..., Any]] = set()
        self._original: Callable[..., None] | None = None

    def watch(self, pack: Callable[..., Any]) -> None:
        with self._lock:
            if not self._packs and _DISABLE is not None:
                self._original = getattr(_AUTOGRAD, _BINDING)
                setattr(_AUTOGRAD, _BINDING, self._disable)
            self._packs.add(pack)

    def forget(self, pack: Callable[..., Any]) -> None:
        with self._lock:
            self._packs.discard(pack)
            if not self._packs and self._original is not None:
                setattr(_AUTOGRAD, _BINDING, self._original)
                self._original = None

    def _disable(self, message: str, fail_if_non_empty: bool = True) -> None:
        # _DISABLE where the last watcher stopped after the caller looked the binding up.
        original = self._original or _DISABLE
        assert original is not None  # installed only where the binding exists
        original(message, fail_if_non_empty and not self._only_ours())

    def _only_ours(self) -> bool:
        """Whether every hook on this thread's stack is ours (none is too). Where this
        PyTorch cannot read the stack, False: PyTorch's own check decides."""
        if not saved_tensors_hooks_readable():
            return False
        found = []
        while (top := top_saved_tensors_hooks()) is not None:
            pop_saved_tensors_hooks()
            found.append(top)
        for pack, unpack in reversed(found):
            push_saved_tensors_hooks(pack, unpack)
        return all(pack in self._packs for pack, _ in found)


step_aside = StepAside()
"""The one in the process: every watcher registers with it."""
