"""The tensor meter: torchmem's own exact count of tensor storage bytes on one device.

While a window is open, a ``TorchDispatchMode`` sees every operator that runs in that
thread (and in autograd's worker threads, which inherit it). Each storage an operator
creates on the watched device is counted once, with its ``nbytes``; a weak reference on
the storage takes the bytes off when the last tensor using it dies. Both only append to a
log, which the meter folds into its totals in one step that a Ctrl-C cannot split; the
weak reference's callback is the log's own ``append``, so no Python code runs when a
storage dies, and a Ctrl-C then reaches the user's code instead of being lost in a
callback. Views and in-place operators create no storage, so they cost nothing; a storage
that an operator resizes (``resize_``, ``out=``) counts its growth. Composite operators
(``F.cross_entropy``, ``F.normalize``) reach the mode as the operators they are made of,
so a temporary freed inside one call still shows in the peak.

Memory an operator's kernel allocates for itself without creating a tensor (scratch
space, cuDNN workspaces) and memory borrowed from elsewhere (``torch.from_numpy``,
DLPack) are not counted. Works on any device, including ``meta`` and fake tensors, which
report their fake device.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from torchmem._compat import (
    DispatchMode,
    disable_dynamo,
    dispatch_mode_stack,
    keep_dynamo_out,
    lock_is_owned,
    op_callable,
    pop_mode,
    push_mode,
    storage_key,
    wraps_tensors,
)
from torchmem.meters.base import Meter, Window, WindowRef
from torchmem.resolve import DeviceLike, parse_device, resolve_device

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_SET_STORAGE = frozenset(
    (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset)
)
SPARSE_COMPONENTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
"""For each sparse layout, the methods giving its component tensors (indices, values),
each with a storage of its own."""


class TensorMeter(Meter):
    """Exact bytes of tensor storages on one device, counted by torchmem itself.

    ``used()`` is the bytes of storages created on ``device`` while a window of this
    meter was open, and still alive. Works for every device PyTorch has (``"cpu"``,
    ``"cuda:0"``, ``"mps"``, ``"meta"``), for fake tensors too, so it is exact and
    deterministic on a machine without a GPU.

    Only threads with an open window of this meter (and the autograd threads they start)
    are watched. A window closed from another thread, or dropped without closing, stops
    the counting at once; its dispatch mode leaves the opening thread's stack the next
    time that thread uses the meter (only its own thread can take it off, and only
    where PyTorch is not dispatching).

    Args:
        device: the device whose tensors are counted; an index-less ``"cuda"`` means the
            current CUDA device (device 0 where CUDA is not available, e.g. fake tensors).
    """

    backend = "dispatch"
    """How it counts: a dispatch mode (see :mod:`torchmem.meters.cpu` for the other)."""
    stats = ("allocated_bytes.all",)
    _log_limit = 4096
    """Fold the log in when it grows longer than this between readings."""

    def __init__(self, device: DeviceLike = "cpu") -> None:
        super().__init__()
        self._device = _with_index(device)
        self.device = str(self._device)
        self._used = 0
        self._peak = 0
        self._allocated_total = 0
        self._freed_total = 0
        # Counted storages by key; a dead one stays until the next fold (its key may be
        # another's by then: check the reference is alive).
        self._live: dict[int, _Ref] = {}
        self._log: list[int | _Ref] = []  # bytes counted, or a counted storage that died
        self._on_freed = self._log.append  # one bound method, shared by every weak reference
        self._modes: dict[int, _WatchMode] = {}
        self._stale: dict[int, list[_WatchMode]] = {}

    def used(self) -> int:
        self._settle()
        self._drop_stale()
        return self._used

    def counters(self) -> dict[str, int]:
        if lock_is_owned(self._lock):  # inside a step of the meter, which folded the log
            return self._counters()
        self._drop_stale()
        with self._lock:
            self._fold_log()
            return self._counters()

    def _counters(self) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self._used,
            "allocated_bytes.all.allocated": self._allocated_total,
            "allocated_bytes.all.freed": self._freed_total,
        }

    def _peaks(self) -> dict[str, int]:
        return {"allocated_bytes.all": self._peak}

    def _reset_peaks(self) -> None:
        self._peak = self._used

    # Each step on windows folds the log in once, first, and then sees one moment: what
    # other threads log meanwhile waits for the next step, as they once waited for the lock.

    def window(self) -> Window:
        self._drop_stale()
        with self._lock:
            self._fold_log()
            return super().window()

    def _restart(self, window: Window) -> None:
        self._drop_stale()
        with self._lock:
            self._fold_log()
            super()._restart(window)

    def _close(self, window: Window) -> None:
        with self._lock:
            self._fold_log()
            super()._close(window)
        self._drop_stale()

    def _lap(self, window: Window) -> tuple[dict[str, int], dict[str, int]]:
        self._drop_stale()
        with self._lock:
            self._fold_log()
            return super()._lap(window)

    def _window_peaks(self, window: Window) -> dict[str, int]:
        self._drop_stale()
        with self._lock:
            self._fold_log()
            return super()._window_peaks(window)

    def _after_fork(self) -> None:
        super()._after_fork()
        # The other threads, and their dispatch-mode stacks, are not in the child.
        me = threading.get_ident()
        self._modes = {me: self._modes[me]} if me in self._modes else {}
        self._stale = {me: self._stale[me]} if me in self._stale else {}

    # Watching: one dispatch mode per thread with open windows --------------------------

    def _on_open(self, ref: WindowRef) -> None:
        thread = ref.thread
        mode = self._modes.get(thread)
        if mode is None:
            mode = self._modes[thread] = _WatchMode(self)
            mode.__enter__()
        mode.windows += 1

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        with self._lock:
            thread = ref.thread
            mode = self._modes.get(thread)
            if mode is None:  # its thread is not in this process (a child made by fork)
                return
            mode.windows -= 1
            if mode.windows:
                return
            del self._modes[thread]
            mode.active = False
            if dropped or thread != threading.get_ident() or not _remove(mode):
                # Only its own thread can take it off its stack, and only where PyTorch is
                # not dispatching (a garbage collection inside an operator is): it stays
                # there, inactive, until that thread next uses the meter.
                self._stale.setdefault(thread, []).append(mode)

    def _drop_stale(self) -> None:
        """Take this thread's inactive modes off its dispatch-mode stack."""
        if self._stale:
            for mode in self._stale.pop(threading.get_ident(), ()):
                _remove(mode)

    # Counting ----------------------------------------------------------------------

    def _counted(self, key: int) -> _Ref | None:
        """The reference of the live counted storage with `key`, if there is one."""
        ref = self._live.get(key)
        return None if ref is None or ref() is None else ref

    def _count(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Count `nbytes` more on `storage`, and take them off when it dies."""
        key = storage_key(storage)
        ref = self._live.get(key)
        if ref is None or ref() is None:
            ref = _Ref(storage, self._on_freed)
            ref.key = key
            ref.nbytes = nbytes
            self._live[key] = ref
        else:
            ref.nbytes += nbytes
        # No call or loop between the counting above and this append: a KeyboardInterrupt
        # (raised only at those) cannot leave one without the other.
        self._log.append(nbytes)
        if len(self._log) > self._log_limit:
            self._settle()

    def _settle(self) -> None:
        """Fold the log in, unless this thread is inside a step of the meter (which holds
        the lock, and folded the log when it began)."""
        if not lock_is_owned(self._lock):
            with self._lock:
                self._fold_log()
                self._collect()

    def _fold_log(self) -> None:
        """Fold the changes logged since the last call into the counters, in order; with
        the lock held.

        Counting and freeing only append to the log (one atomic step, in any thread; a
        counted storage's weak reference appends itself when the storage dies), so neither
        needs the lock. A storage freed while this runs (a garbage collection can start at
        any allocation) is appended after the changes taken here, and folded next time.

        Everything is computed first; then the counters and the log change in plain
        stores, with no call or loop between them: a KeyboardInterrupt (raised only at
        those) or a fork leaves either all of it done or none of it."""
        log = self._log
        n = len(log)
        if not n:
            return
        entries = log[:n]
        changes = [-e.nbytes if isinstance(e, _Ref) else e for e in entries]
        live = self._live
        for entry in entries:
            if type(entry) is _Ref:
                key = entry.key
                # No call between test and deletion: no thread counting a new storage
                # at this key, nor an interrupt, can come in between.
                if key in live and live[key] is entry:
                    del live[key]
        used = list(itertools.accumulate(changes, initial=self._used))
        net = used[-1] - used[0]
        moved = sum(map(abs, changes))
        now, peak = used[-1], max(self._peak, max(used))
        allocated = self._allocated_total + (moved + net) // 2
        freed = self._freed_total + (moved - net) // 2
        self._used = now
        self._peak = peak
        self._allocated_total = allocated
        self._freed_total = freed
        del log[:n]

    def _created(self, tensor: torch.Tensor, owned_only: bool = False) -> None:
        """An operator returned `tensor` in a storage of its own: count it if new here."""
        if tensor.device != self._device:
            return
        if tensor.layout is torch.strided and not owned_only:
            storages: Iterable[torch.UntypedStorage] = (tensor.untyped_storage(),)
        else:
            storages = storages_of(tensor)
        for storage in storages:
            if self._counted(storage_key(storage)) or (owned_only and not storage.resizable()):
                continue
            nbytes = storage.nbytes()
            if nbytes:
                self._count(storage, nbytes)

    def _returned(self, fresh: tuple[bool, ...], out: Any, args: tuple[Any, ...]) -> None:
        """Count the new storages of the returns flagged in `fresh`."""
        for is_fresh, value in zip(fresh, (out,) if len(fresh) == 1 else out, strict=False):
            if is_fresh:
                for tensor in _tensors(value):
                    if not any(tensor is arg for arg in args):
                        self._created(tensor)

    def _grown(self, tensor: torch.Tensor, storage: torch.UntypedStorage, nbytes: int) -> None:
        """`storage` held `nbytes` before an operator that wrote to `tensor` (resize_, out=)
        made it larger: count the growth if `tensor` still uses it."""
        grown = tensor.untyped_storage()
        if storage_key(grown) == storage_key(storage) and tensor.device == self._device:
            self._count(grown, grown.nbytes() - nbytes)


class _Ref(weakref.ref[torch.UntypedStorage]):
    """A weak reference to a counted storage, with its key and its counted bytes."""

    __slots__ = ("key", "nbytes")
    key: int
    nbytes: int


class _WatchMode(DispatchMode):
    """Sees every operator in its thread and reports new storages to the meter."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles under an open window (not skipping every frame) and
        # runs the compiled code with the mode on.
        return True

    def __init__(self, meter: TensorMeter) -> None:
        super().__init__()
        self.meter = meter
        self.active = True
        self.windows = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        facts = _FACTS.get(id(func))
        if facts is None or facts[0] is not func:
            facts = _learn(func)
        _, call, fresh, mutated = facts
        if not self.active:
            return call(*args, **kwargs) if kwargs else call(*args)
        if types and wraps_tensors(types):
            return NotImplemented  # seen again as the operators on its inner tensors
        before: Sequence[tuple[torch.Tensor, torch.UntypedStorage, int]] | None = None
        if mutated:
            first = args[0] if args else None
            if mutated is _SELF and isinstance(first, torch.Tensor) and first.layout is _STRIDED:
                # An in-place operator (add_, uniform_), the usual case: made quick.
                try:
                    storage = first.untyped_storage()
                    before = ((first, storage, storage.nbytes()),)
                except (NotImplementedError, RuntimeError):  # a subclass with no storage
                    pass
            else:
                before = _sizes(mutated, args, kwargs)
        out = call(*args, **kwargs) if kwargs else call(*args)
        meter = self.meter
        if before:
            for tensor, storage, nbytes in before:
                if storage.nbytes() > nbytes:
                    meter._grown(tensor, storage, nbytes)
        if fresh is _ONE_FRESH and isinstance(out, torch.Tensor):
            # Most operators return one new strided tensor: counted right here.
            if out.layout is not _STRIDED:
                meter._returned(fresh, out, args)
            elif out.device == meter._device:
                storage = out.untyped_storage()
                ref = meter._live.get(storage_key(storage))
                if ref is not None and ref() is not None:  # counted, and alive
                    return out
                if any(arg is out for arg in args):
                    return out
                nbytes = storage.nbytes()
                if nbytes:
                    meter._count(storage, nbytes)
        elif fresh:
            meter._returned(fresh, out, args)
        elif func in _SET_STORAGE:
            # torch.load, unpickling and deepcopy make a storage without an operator, then
            # set_ a tensor to it (share_memory_ too, to shared memory: not the allocator's).
            if not args[0].untyped_storage().is_shared():
                meter._created(args[0])
        elif func is _LIFT_FRESH:
            # torch.tensor(data) builds its storage before dispatch and only lifts it
            # here; from_numpy lifts memory it borrowed (not resizable).
            for tensor in _tensors(out):
                meter._created(tensor, owned_only=True)
        return out


_STRIDED = torch.strided
_ONE_FRESH = (True,)
_SELF = ((0, "self"),)
_Facts = tuple[Any, Callable[..., Any], tuple[bool, ...], tuple[tuple[int, str], ...]]
_FACTS: dict[int, _Facts] = {}
"""Per operator, by id: the operator, what to call, `fresh` and `mutated` (see _learn)."""


def _learn(func: Any) -> _Facts:
    """For an operator: the callable that runs it (an OpOverload's own ``_op``, one Python
    call less), which returns are new tensors (not aliases of an argument), and the
    position and name of each argument it writes to."""
    schema = getattr(func, "_schema", None)
    fresh: tuple[bool, ...] = ()
    mutated: tuple[tuple[int, str], ...] = ()
    if schema is not None:
        fresh = tuple(r.alias_info is None for r in schema.returns)
        mutated = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    if mutated == _SELF:
        mutated = _SELF
    if fresh == _ONE_FRESH:
        fresh = _ONE_FRESH
    elif not any(fresh):
        fresh = ()
    call = op_callable(func)
    facts: _Facts = (func, call, fresh, mutated)
    _FACTS[id(func)] = facts
    return facts


def _sizes(
    mutated: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> list[tuple[torch.Tensor, torch.UntypedStorage, int]]:
    """Each strided tensor among the arguments an operator writes to, with its storage
    and the storage's size now."""
    found = []
    for i, name in mutated:
        value = args[i] if i < len(args) else kwargs.get(name) if kwargs else None
        tensors = (value,) if isinstance(value, torch.Tensor) else _tensors(value)
        for tensor in tensors:
            if tensor.layout is _STRIDED:
                try:
                    storage = tensor.untyped_storage()
                except (NotImplementedError, RuntimeError):  # a subclass with no storage
                    continue
                found.append((tensor, storage, storage.nbytes()))
    return found


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def storages_of(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding a tensor's memory: one for a strided tensor, one for each
    component (indices, values) of a sparse one, none where PyTorch exposes none."""
    components = SPARSE_COMPONENTS.get(tensor.layout)
    if components is not None:
        for name in components:
            yield from storages_of(getattr(tensor, name)())
        return
    try:
        yield tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # mkldnn, some subclasses: no storage
        return


def _with_index(device: DeviceLike) -> torch.device:
    """`device` with its index, as :func:`~torchmem.resolve_device` gives it where the
    device exists here; else as written, an index-less one meaning index 0 (what fake
    tensors on a device this machine lacks report)."""
    try:
        return resolve_device(device)
    except ValueError:
        parsed = parse_device(device)
        if parsed.type == "cpu":  # cpu:1: no such device, even for fake tensors
            raise
        if parsed.index is not None or parsed.type == "meta":
            return parsed
        return torch.device(parsed.type, 0)


def _remove(mode: _WatchMode) -> bool:
    """Take `mode` off this thread's dispatch-mode stack, wherever it is in it; False if it
    is not there (or, while it handles an operator, not there for now)."""
    stack = dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return False
    if stack[-1] is mode:
        mode.__exit__(None, None, None)
        return True
    # Modes the user entered after ours stay, in their order.
    above = []
    while (top := pop_mode()) is not mode:
        above.append(top)
    for other in reversed(above):
        push_mode(other)
    return True


# __torch_dispatch__ runs inside compiled code (a compiled function's operators reach it).
if not keep_dynamo_out(_WatchMode.__torch_dispatch__):
    _WatchMode.__torch_dispatch__ = disable_dynamo(  # type: ignore[method-assign]
        _WatchMode.__dict__["__torch_dispatch__"]
    )
