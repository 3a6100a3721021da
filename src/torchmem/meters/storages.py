"""CPU storages that PyTorch's CPU allocator does not make, counted by the CPU meter.

Shared memory (a DataLoader worker's batch, which this process unpickles as a storage in
shared memory; ``share_memory_()``, which moves a storage there), files mapped into memory
(``torch.from_file``, ``UntypedStorage.from_file``, ``torch.load(mmap=True)``) and pinned
memory (``Tensor.pin_memory()``, where an accelerator is available) come from other
allocators than the one torchmem's counting allocator replaces.

While something measures CPU memory (a recording, or a window open on ``meter("cpu")``),
the functions through which they come into the process are wrapped. Each wrapper calls
PyTorch's own function with the same arguments, returns what it returns and raises what it
raises, then counts the new storage in: an allocation at the calling thread's line, in the
meter's counters and the recording's log. A finalizer on the storage's Python object counts
it off when it dies: PyTorch keeps that object alive as long as the storage lives (C++
holding the storage holds it), and the finalizer runs before the memory is unmapped. The
storage's deleter is left alone (PyTorch finds a storage's MapAllocator from it).

A storage that came in while nothing measured is never counted, nor is its end; one that
came in while something measured is counted until it dies, whatever measures then.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchmem._compat import RECEIVED_STORAGES, SHARED_STORAGES, STORAGE_MOVES, storage_key

if TYPE_CHECKING:
    from torchmem.meters.native import CpuAllocatorLibrary

_ABSENT = object()
"""What an owner's namespace held under a name it did not define itself."""


class _Held(weakref.ref[torch.UntypedStorage]):
    """A counted storage's weak reference: what its finalizer counts off."""

    __slots__ = ("key", "nbytes", "ptr")
    key: int
    ptr: int
    nbytes: int


class Storages:
    """The storages of this process that other allocators made, counted in and out through
    the counting allocator's library while :meth:`watch` is in force. One per process."""

    def __init__(self, library: CpuAllocatorLibrary) -> None:
        # The loaded library again (the loader gives the same one): its functions that
        # count such storages, called with the GIL held (a site is read from this thread).
        lib = ctypes.PyDLL(str(library.path))
        for function in (lib.torchmem_foreign_in, lib.torchmem_foreign_out):
            function.restype = None
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._in: Callable[[int, int], None] = lib.torchmem_foreign_in
        self._out: Callable[[int, int], None] = lib.torchmem_foreign_out
        self._held: dict[int, _Held] = {}
        """Each counted storage alive, by :func:`~torchmem._compat.storage_key`."""
        self._watchers = 0
        self._lock = threading.RLock()  # a finalizer may close a window inside watch()
        self._undo: list[tuple[object, str, object, object]] = []
        """(owner, name, what it held, the wrapper put there), in the order installed."""
        self._targets: list[tuple[object, str, Callable[[Any], Any]]] | None = None
        self._made: dict[tuple[int, str], tuple[object, object]] = {}
        """(id of the owner, name) -> (PyTorch's function, its wrapper)."""
        self.received = 0
        """Storages that another process put in shared memory and this one mapped (a
        DataLoader worker's batch), counted since the process started."""
        os.register_at_fork(after_in_child=self._forget)

    def watch(self) -> None:
        """Count the storages that come in from now on, until as many :meth:`unwatch`;
        the first wraps PyTorch's functions."""
        with self._lock:
            self._watchers += 1
            if self._watchers == 1:
                self._install()

    def unwatch(self) -> None:
        """End one :meth:`watch`; the last puts PyTorch's functions back."""
        with self._lock:
            self._watchers = max(self._watchers - 1, 0)
            if not self._watchers:
                self._uninstall()

    def _install(self) -> None:
        if self._targets is None:
            self._targets = self._wrappers()
        for owner, name, wrap in self._targets:
            if not self._watchers:  # an unwatch came in between (a finalizer, this thread)
                return
            original = getattr(owner, name)
            made = self._made.get((id(owner), name))
            if made is None or made[0] is not original:  # made once: windows come and go
                made = self._made[id(owner), name] = (original, wrap(original))
            self._undo.append((owner, name, vars(owner).get(name, _ABSENT), made[1]))
            setattr(owner, name, made[1])

    def _uninstall(self) -> None:
        """Put back what each name held, unless the program has put something else there
        since: that stays."""
        while self._undo:
            owner, name, old, mine = self._undo.pop()
            if vars(owner).get(name) is not mine:
                continue
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def _wrappers(self) -> list[tuple[object, str, Callable[[Any], Any]]]:
        """What is wrapped (owner, name, wrapper of the original), in the order it is."""
        storage = torch.UntypedStorage
        found: list[tuple[object, str, Callable[[Any], Any]]] = [
            (storage, name, lambda f: staticmethod(self._returns_storage(f, received=True)))
            for name in RECEIVED_STORAGES
        ]
        found += [
            (storage, name, lambda f: staticmethod(self._returns_storage(f, received=False)))
            for name in (*SHARED_STORAGES, "from_file")
        ]
        found += [(storage, name, self._moves) for name in STORAGE_MOVES]
        found.append((torch, "from_file", lambda f: self._returns_tensor(f, method=False)))
        if torch.accelerator.is_available():  # pinned memory needs one
            found.append((torch.Tensor, "pin_memory", lambda f: self._returns_tensor(f, True)))
        return found

    def _returns_storage(self, original: Callable[..., Any], received: bool) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            storage = original(*args, **kwargs)
            if self._watchers and self._came_in(storage) and received:
                self.received += 1
            return storage

        return wrapper

    def _returns_tensor(self, original: Callable[..., Any], method: bool) -> Callable[..., Any]:
        """`original` returns a tensor; a method (``pin_memory``) may return its tensor
        itself, which is no new storage."""

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = original(*args, **kwargs)
            if self._watchers and not (method and tensor is args[0]):
                try:
                    storage = tensor.untyped_storage()
                except (NotImplementedError, RuntimeError):  # a subclass without storage
                    return tensor
                self._came_in(storage)
            return tensor

        return wrapper

    def _moves(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """`original` moves its storage into shared memory, unless it is there already:
        the copy there is made and filled before the storage's memory is freed, so both
        are in use meanwhile, and counted so (in the name of the storage's
        :func:`~torchmem._compat.storage_key`, which no memory of a storage has)."""

        @functools.wraps(original)
        def wrapper(storage: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._watchers or storage.device.type != "cpu" or storage.is_shared():
                return original(storage, *args, **kwargs)
            key, before, n = storage_key(storage), storage.data_ptr(), storage.nbytes()
            self._in(key, n)
            try:
                result = original(storage, *args, **kwargs)
            finally:
                self._out(key, n)
            if storage.data_ptr() != before:
                self._came_in(storage)
            return result

        return wrapper

    def _came_in(self, storage: torch.UntypedStorage) -> bool:
        """Count `storage` in, unless it is counted already, empty or not on the CPU;
        whether it was counted now."""
        n = storage.nbytes()
        if not n or storage.device.type != "cpu":
            return False
        key = storage_key(storage)
        if key in self._held:  # the same storage again (one another process sent back)
            return False
        ref = _Held(storage, self._died)
        ref.key, ref.ptr, ref.nbytes = key, storage.data_ptr(), n
        if self._held.setdefault(key, ref) is not ref:
            return False
        self._in(ref.ptr, n)
        return True

    def _died(self, ref: _Held) -> None:
        if self._held.get(ref.key) is ref:
            del self._held[ref.key]
            self._out(ref.ptr, ref.nbytes)

    def _forget(self) -> None:
        """In a child made by fork (a DataLoader worker): nothing measures, PyTorch's
        functions are its own, and the parent's storages are not counted off here."""
        self._lock = threading.RLock()
        self._watchers = 0
        self._uninstall()
        self._held.clear()
