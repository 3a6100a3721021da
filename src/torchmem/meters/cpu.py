"""The CPU meter: every CPU tensor storage of the process, the way the CUDA allocator
meter sees every tensor of a GPU.

Two backends, chosen once per process at the first use of ``meter("cpu")``:

- ``"allocator"``: PyTorch's default CPU allocator made to count by torchmem's counting
  allocator (C++, built on first use, see :mod:`torchmem.meters.native`). Every storage of every
  thread, operators' temporaries and ``torch.tensor`` included, at no cost per operator.
- ``"dispatch"``: the tensor meter's dispatch mode, made absolute by walking the live
  tensors (through ``gc``) when a thread opens its first window and closes its last,
  and on readings outside any window. Used where the allocator cannot be built or
  trusted (one warning says why), or when ``TORCHMEM_CPU_METER=dispatch``.

Storages alive before the meter started are adopted once, so freeing them later shows
as a negative change, as on a GPU. The allocator's backend also counts the storages that
come into the process through other allocators while a window is open or a recording
runs: shared memory (DataLoader workers' batches, ``share_memory_()``), mapped files
(``torch.from_file``, ``torch.load(mmap=True)``) and pinned memory (see
:mod:`torchmem.meters.storages`). Neither backend sees memory borrowed from another
library (``torch.from_numpy``, DLPack), nor memory C++ code holds without a tensor.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchmem._compat import storage_key
from torchmem._objects import subclasses, tracked
from torchmem.errors import BuildError, TorchmemError, TorchmemWarning
from torchmem.meters import native
from torchmem.meters.base import Meter, Window, WindowRef, in_background
from torchmem.meters.storages import Storages
from torchmem.meters.tensor import TensorMeter, storages_of

BACKENDS = ("allocator", "dispatch")
CPU_METER_VARIABLE = "TORCHMEM_CPU_METER"
"""The environment variable that chooses the backend."""


class CpuAllocatorMeter(Meter):
    """Bytes of every live CPU tensor storage of the process, counted by torchmem's
    counting CPU allocator: ``used()`` means what the CUDA allocator's
    ``memory_allocated`` means on a GPU. Exact in every thread; windows cost nothing per
    operator. One per process (the allocator's counters are)."""

    backend = "allocator"
    """Which backend counts: ``"allocator"`` here, ``"dispatch"`` for the fallback."""
    stats = ("allocated_bytes.all",)

    def __init__(self, library: native.CpuAllocatorLibrary) -> None:
        super().__init__()
        self.device = "cpu"
        self.library = library
        """The loaded counting allocator (its :attr:`~native.CpuAllocatorLibrary.path`)."""
        self._values = library.counters
        # The same int64s, read and written in one step: a ctypes array is read item by
        # item (0.25 µs each), and a foreign call costs 0.3 µs (several on a cold cache).
        self._items = memoryview(library.counters).cast("B").cast("q")
        self.counts: Callable[[], list[int]] = self._items.tolist
        """The library's counters now, in :data:`~torchmem.meters.native.COUNTERS` order
        (:data:`COUNTS` names them): what :meth:`counters` reads, as one list read at once,
        for callers that read them on every line (the line profiler)."""
        self._reset_peak = library.reset_peak
        self.storages = Storages(library)
        """The storages other allocators make (shared memory, mapped files, pinned
        memory): counted while a window is open here or a recording runs."""
        for storage in live_storages():
            library.adopt(storage_key(storage))

    def used(self) -> int:
        return int(self._values[0])

    def counters(self) -> dict[str, int]:
        return counters_of(self.counts())

    def lap_counts(self, window: Window, counts: list[int] | None = None) -> tuple[int, list[int]]:
        """:meth:`Window.lap_with_counters` on one of this meter's windows, without the
        dicts, for callers that lap on every line (the line profiler): the window's peak
        over the period that ended, and :attr:`counts` at the restart, where the peak
        counter (index 1) has started over from the bytes in use (index 0). The same
        values, and the same effect on every window. `counts` are the counts the caller
        has just read, if it has (to see whether they moved), else they are read here.

        Until the counts move again (an allocation, a free, an adoption), the window
        stays at those bytes: a lap then would find the same peak and counts.

        Raises:
            TorchmemError: if `window` is closed.
        """
        if window._final is not None:
            raise TorchmemError(f"cannot restart a closed window on {self!r}")
        with self._lock:
            if self._dropped:
                self._collect()
            if len(self._windows) > 1:
                self._fold()  # the others keep the peak that the reset below starts over
            if counts is None:
                counts = self.counts()
            current = peak = counts[0]
            if counts[1] != current:  # else the reset changes nothing
                peak = counts[1]
                # The library's reset: storing `current` from here would lose a rise that
                # another thread made since it was read.
                self._reset_peak()
                counts[1] = current
            folded = window._folded
            if folded:
                window._folded = {}
                before = folded.get(_STAT)
                if before is not None and before > peak:
                    peak = before
            window.start = current
        return peak, counts

    def _on_open(self, ref: WindowRef) -> None:
        self.storages.watch()

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        self.storages.unwatch()

    def _peaks(self) -> dict[str, int]:
        return {"allocated_bytes.all": int(self._values[1])}

    def _reset_peaks(self) -> None:
        self._reset_peak()


_STAT = CpuAllocatorMeter.stats[0]

COUNTS = (
    "allocated_bytes.all.current",
    _STAT,
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.freed",
    "allocation.all.allocated",
    "allocation.all.freed",
)
"""What :attr:`CpuAllocatorMeter.counts` holds at each index, as :meth:`Meter.counters`
keys; index 1 is the peak counter, named by the stat (as in a window's peaks), and any
index past these is not reported."""


def counters_of(counts: list[int]) -> dict[str, int]:
    """:meth:`CpuAllocatorMeter.counters` from its :attr:`~CpuAllocatorMeter.counts`."""
    return {
        COUNTS[0]: counts[0],
        COUNTS[2]: counts[2],
        COUNTS[3]: counts[3],
        COUNTS[4]: counts[4],
        COUNTS[5]: counts[5],
    }


class CpuDispatchMeter(TensorMeter):
    """The CPU meter where the counting allocator is not available: the tensor meter,
    made absolute. It counts new storages per operator in threads with an open window,
    and adopts every live CPU storage it has not counted (made outside a window, in
    another thread, by ``torch.load``, resized in place) when a thread opens its first
    window or closes its last one, and on readings outside any window. A walk costs
    about 0.15 µs per live Python object."""

    backend = "dispatch"

    def __init__(self) -> None:
        super().__init__("cpu")

    def used(self) -> int:
        if self._may_walk():
            with self._lock:
                self._adopt_live()
        return super().used()

    def counters(self) -> dict[str, int]:
        if self._may_walk():
            with self._lock:
                self._adopt_live()
        return super().counters()

    def _may_walk(self) -> bool:
        """A reading walks the live storages in a thread without windows of its own, but
        never in torchmem's threads (their readings count what was seen)."""
        return threading.get_ident() not in self._modes and not in_background()

    def _on_open(self, ref: WindowRef) -> None:
        if ref.thread not in self._modes:
            self._adopt_live()
        super()._on_open(ref)

    def _closing(self, ref: WindowRef) -> None:
        mode = self._modes.get(ref.thread)
        if ref.thread == threading.get_ident() and mode is not None and mode.windows == 1:
            self._adopt_live()
        super()._closing(ref)

    def _adopt_live(self) -> None:
        """Count what the dispatch mode did not see; with the lock held."""
        for storage in live_storages():
            key = storage_key(storage)
            ref = self._counted(key)
            if ref is None and not storage.resizable():
                continue  # borrowed (from_numpy, mmap), or torch.load's, seen by the mode
            # Shared memory (share_memory_ moves a storage there) is not the allocator's.
            nbytes = 0 if storage.is_shared() else storage.nbytes()
            counted = 0 if ref is None else ref.nbytes
            if nbytes != counted:
                self._count(storage, nbytes - counted)
        self._fold_log()


def live_storages() -> list[torch.UntypedStorage]:
    """Every CPU storage that Python objects (tensors, storages) reach now, once each.

    A walk of every Python object: about 0.2 µs each, half to list them, half to read
    their classes; the few tensors and storages among them cost little more."""
    tensors = subclasses(torch.Tensor)
    untyped = subclasses(torch.UntypedStorage)
    found = tracked(torch.Tensor, torch.UntypedStorage, torch.TypedStorage)
    storages: dict[int, torch.UntypedStorage] = {}
    obj: Any
    for obj in found:
        kind = type(obj)
        if kind in _PLAIN and obj.layout is torch.strided:  # nearly every tensor
            try:
                if not obj.is_cpu:
                    continue
                storage = obj.untyped_storage()
                storage.data_ptr()
            except (NotImplementedError, RuntimeError):  # no storage, or a gone one
                continue
            storages.setdefault(storage_key(storage), storage)
            continue
        if kind in tensors:
            try:
                if obj.device.type != "cpu":
                    continue
                candidates = list(storages_of(obj))
            except (NotImplementedError, RuntimeError):  # subclasses without storage
                continue
        else:
            candidates = [obj if kind in untyped else obj.untyped()]
        for storage in candidates:
            try:
                if storage.device.type != "cpu":
                    continue
                storage.data_ptr()
            except RuntimeError:  # a Python storage whose C++ storage is gone (null, invalid)
                continue
            storages.setdefault(storage_key(storage), storage)
    return list(storages.values())


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
"""Tensor classes whose ``layout``, ``is_cpu`` and ``untyped_storage()`` are PyTorch's
own: a strided one has one storage, on its device."""


_allocator_meter: CpuAllocatorMeter | None = None
_unavailable: str | None = None


def cpu_meter() -> Meter:
    """A new CPU meter on the backend ``$TORCHMEM_CPU_METER`` asks for (``"allocator"``,
    the default, or ``"dispatch"``); the allocator's meter is one per process.

    Raises:
        ValueError: naming the variable's value, if it is neither.
    """
    global _allocator_meter, _unavailable
    choice = os.environ.get(CPU_METER_VARIABLE, "") or "allocator"
    if choice not in BACKENDS:
        raise ValueError(f"{CPU_METER_VARIABLE}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "allocator" and _unavailable is None:
        if _allocator_meter is None:
            try:
                _allocator_meter = CpuAllocatorMeter(native.load())
            except BuildError as exc:
                _unavailable = str(exc)
                warnings.warn(
                    f"torchmem: the counting CPU allocator is not available ({exc}); CPU"
                    " memory is counted by the dispatch-mode meter, at a cost per operator."
                    f" Set {CPU_METER_VARIABLE}=dispatch to choose it without trying.",
                    TorchmemWarning,
                    stacklevel=4,  # cpu_meter, _make, meter: the caller of meter()
                )
        if _allocator_meter is not None:
            return _allocator_meter
    return CpuDispatchMeter()


def unavailable() -> str | None:
    """Why the counting allocator could not be used in this process, if it was tried and
    could not."""
    return _unavailable
