"""The tensor meter: torchmem's own exact count of tensor storage bytes on one device.

While a window is open, a ``TorchDispatchMode`` sees every operator that runs in that
thread (and in autograd's worker threads, which inherit it). Each storage an operator
creates on the watched device is counted once, with its ``nbytes``; a weak reference on
the storage takes the bytes off when the last tensor using it dies. Views and in-place
operators create no storage, so they cost nothing; a storage that an operator resizes
(``resize_``, ``out=``) counts its growth. Composite operators (``F.cross_entropy``,
``F.normalize``) reach the mode as the operators they are made of, so a temporary freed
inside one call still shows in the peak.

Memory an operator's kernel allocates for itself without creating a tensor (scratch
space, cuDNN workspaces) and memory borrowed from elsewhere (``torch.from_numpy``,
DLPack) are not counted. Works on any device, including ``meta`` and fake tensors, which
report their fake device.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from torchmem.meters.base import Meter, Window, parse_device

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_COMPONENTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


class TensorMeter(Meter):
    """Exact bytes of tensor storages on one device, counted by torchmem itself.

    ``used()`` is the bytes of storages created on ``device`` while a window of this
    meter was open, and still alive. Works for every device PyTorch has (``"cpu"``,
    ``"cuda:0"``, ``"mps"``, ``"meta"``), for fake tensors too, so it is exact and
    deterministic on a machine without a GPU.

    Only threads with an open window of this meter (and the autograd threads they start)
    are watched: open and close a window on the same thread.

    Args:
        device: the device whose tensors are counted; an index-less ``"cuda"`` means the
            current CUDA device (device 0 where CUDA is not available, e.g. fake tensors).
    """

    stats = ("allocated_bytes.all",)

    def __init__(self, device: str | int | torch.device = "cpu") -> None:
        super().__init__()
        self._device = _with_index(parse_device(device))
        self.device = str(self._device)
        self._used = 0
        self._peak = 0
        self._allocated_total = 0
        self._freed_total = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._modes: dict[int, _WatchMode] = {}
        self._owners: dict[int, int] = {}
        self._stale: dict[int, list[_WatchMode]] = {}

    def used(self) -> int:
        return self._used

    def counters(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self._used,
            "allocated_bytes.all.allocated": self._allocated_total,
            "allocated_bytes.all.freed": self._freed_total,
        }

    def _peaks(self) -> dict[str, int]:
        return {"allocated_bytes.all": self._peak}

    def _reset_peaks(self) -> None:
        self._peak = self._used

    # Watching: one dispatch mode per thread with open windows --------------------------

    def _on_open(self, window: Window) -> None:
        thread = threading.get_ident()
        self._owners[id(window)] = thread
        for stale in self._stale.pop(thread, ()):
            _remove(stale)
        mode = self._modes.get(thread)
        if mode is None:
            mode = self._modes[thread] = _WatchMode(self)
            mode.__enter__()
        mode.windows += 1

    def _on_close(self, window: Window) -> None:
        with self._lock:
            thread = self._owners.pop(id(window))
            mode = self._modes[thread]
            mode.windows -= 1
            if mode.windows:
                return
            del self._modes[thread]
            mode.active = False
            if thread != threading.get_ident():
                # Only its own thread can take it off its stack: it stays there, inactive,
                # until that thread next opens a window here.
                self._stale.setdefault(thread, []).append(mode)
                return
        _remove(mode)

    # Counting ----------------------------------------------------------------------

    def _add(self, nbytes: int) -> None:
        """Count `nbytes` more in use (fewer, if negative). Caller holds the lock."""
        used = self._used = self._used + nbytes
        if nbytes > 0:
            self._allocated_total += nbytes
            if used > self._peak:
                self._peak = used
        else:
            self._freed_total -= nbytes

    def _count(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Count `nbytes` more on `storage`, and take them off when it dies."""
        key = storage._cdata
        with self._lock:
            if key in self._sizes:
                self._sizes[key] += nbytes
            else:
                self._sizes[key] = nbytes
                self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
            self._add(nbytes)

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self._add(-self._sizes.pop(key, 0))

    def _created(self, tensor: torch.Tensor, owned_only: bool = False) -> None:
        """An operator returned `tensor` in a storage of its own: count it if new here."""
        if tensor.device != self._device:
            return
        if tensor.layout is torch.strided and not owned_only:
            storages: Iterator[torch.UntypedStorage] | tuple = (tensor.untyped_storage(),)
        else:
            storages = _storages(tensor)
        for storage in storages:
            if storage._cdata in self._sizes or (owned_only and not storage.resizable()):
                continue
            nbytes = storage.nbytes()
            if nbytes:
                self._count(storage, nbytes)


class _WatchMode(TorchDispatchMode):
    """Sees every operator in its thread and reports new storages to the meter."""

    def __init__(self, meter: TensorMeter) -> None:
        super().__init__()
        self.meter = meter
        self.active = True
        self.windows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        fresh, mutated = _schema(func)
        before = list(_sized(_arguments(mutated, args, kwargs))) if mutated else ()
        out = func(*args, **kwargs)
        meter = self.meter
        # A storage that an operator grew in place (resize_, out= into a small tensor).
        for tensor, storage, nbytes in before:
            grown = tensor.untyped_storage()
            same = grown._cdata == storage._cdata and tensor.device == meter._device
            if same and grown.nbytes() > nbytes:
                meter._count(grown, grown.nbytes() - nbytes)
        returns = (out,) if len(fresh) == 1 else out if fresh else ()
        for is_fresh, value in zip(fresh, returns, strict=False):
            for tensor in _tensors(value):
                if is_fresh:
                    if not any(tensor is arg for arg in args):
                        meter._created(tensor)
                elif func is _LIFT_FRESH:
                    # torch.tensor(data) builds its storage before dispatch and only
                    # lifts it here; from_numpy lifts memory it borrowed (not resizable).
                    meter._created(tensor, owned_only=True)
        return out


@functools.cache
def _schema(func: Any) -> tuple[tuple[bool, ...], tuple[tuple[int, str], ...]]:
    """For an operator: which returns are new tensors (not aliases of an argument), and
    the position and name of each argument it writes to."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return (), ()
    fresh = tuple(r.alias_info is None for r in schema.returns)
    mutated = tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    return fresh, mutated


def _arguments(
    positions: tuple[tuple[int, str], ...], args: tuple, kwargs: dict
) -> Iterator[torch.Tensor]:
    for i, name in positions:
        value = args[i] if i < len(args) else kwargs.get(name)
        yield from _tensors(value)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _sized(
    tensors: Iterator[torch.Tensor],
) -> Iterator[tuple[torch.Tensor, torch.UntypedStorage, int]]:
    """Each strided tensor with its storage and the storage's size now."""
    for tensor in tensors:
        if tensor.layout is torch.strided:
            for storage in _storages(tensor):
                yield tensor, storage, storage.nbytes()


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding a tensor's memory: one for a strided tensor, one for each
    component (indices, values) of a sparse one, none where PyTorch exposes none."""
    components = _COMPONENTS.get(tensor.layout)
    if components is not None:
        for name in components:
            yield from _storages(getattr(tensor, name)())
        return
    try:
        yield tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # mkldnn, some subclasses: no storage
        return


def _with_index(device: torch.device) -> torch.device:
    """Give an index-less accelerator device its index: the current device where the
    backend is available, else 0 (what fake tensors on that device report)."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is not None and available() and hasattr(backend, "current_device"):
        return torch.device(device.type, backend.current_device())
    return torch.device(device.type, 0)


def _remove(mode: _WatchMode) -> None:
    """Take `mode` off this thread's dispatch-mode stack, wherever it is in it."""
    stack = _get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return
    # Modes the user entered after ours stay, in their order.
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for other in reversed(above):
        _push_mode(other)
