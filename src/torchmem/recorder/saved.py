"""Our saved-tensor hooks beside the program's and PyTorch's own: taken off the stack
wherever they are (:func:`remove`), and stepping aside where PyTorch forbids such hooks
(:data:`step_aside`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.autograd.graph

from torchmem._compat import (
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    saved_tensors_hooks_readable,
    top_saved_tensors_hooks,
)


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
    transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``) enter
    :func:`torch.autograd.graph.disable_saved_tensors_hooks`, which raises while any are
    installed. While a watcher records, that function is replaced by one that lifts this
    thread's hooks of ours off the top of its stack, runs PyTorch's, and puts them back;
    the last watcher to stop puts PyTorch's function back. The activations such a region
    saves are not marked (they count as other memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packs: set[Callable[..., Any]] = set()
        self._original: Callable[[str], contextlib.AbstractContextManager[None]] | None = None

    def watch(self, pack: Callable[..., Any]) -> None:
        with self._lock:
            if not self._packs:
                self._original = torch.autograd.graph.disable_saved_tensors_hooks
                torch.autograd.graph.disable_saved_tensors_hooks = self._disable
            self._packs.add(pack)

    def forget(self, pack: Callable[..., Any]) -> None:
        with self._lock:
            self._packs.discard(pack)
            if not self._packs and self._original is not None:
                torch.autograd.graph.disable_saved_tensors_hooks = self._original  # type: ignore[assignment]
                self._original = None

    @contextlib.contextmanager
    def _disable(self, error_message: str) -> Generator[None, None, None]:
        lifted = []
        while (top := top_saved_tensors_hooks()) and top[0] in self._packs:
            pop_saved_tensors_hooks()
            lifted.append(top)
        original = self._original
        try:
            if original is None:  # the last watcher stopped in between (another thread)
                yield
            else:
                with original(error_message):
                    yield
        finally:
            for pack, unpack in reversed(lifted):
                push_saved_tensors_hooks(pack, unpack)


step_aside = StepAside()
"""The one in the process: every watcher registers with it."""
