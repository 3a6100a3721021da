"""The allocator meter: PyTorch's caching allocator on one GPU (CUDA/ROCm, or Intel XPU)."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from torchmem._compat import (
    intercept_peak_resets,
    lock_is_owned,
    peak_reset,
    stop_intercepting_peak_resets,
)
from torchmem.errors import TorchmemWarning
from torchmem.meters.base import Meter, WindowRef

_COUNTERS = ("current", "allocated", "freed")


class AllocatorMeter(Meter):
    """Bytes held by PyTorch's caching allocator on one device, this process only.

    ``used()`` is ``memory_allocated`` (bytes in tensors), :meth:`reserved` is
    ``memory_reserved`` (what the allocator holds from the driver, tensors plus cache).
    Peaks come from the allocator's own counters (``memory_stats()``'s ``*.peak``), which
    only reset as a whole: every open window gets them folded in before each
    ``reset_peak_memory_stats``, so nested windows stay exact.

    Other code may reset the counters too (DeepSpeed's ``see_memory_usage`` does after
    every print). While any window is open, every reset made from Python
    (``torch.cuda.reset_peak_memory_stats``, ``reset_max_memory_allocated``, ...) first
    folds the counters into the open windows of its device, so they stay exact; the
    caller's own reading (``max_memory_allocated``) is reset as it asked. A reset that
    cannot be seen (from C++, or through the function as it was before the first window
    opened) makes a window's peak count only from that reset: where the meter can tell
    (a peak lower than one it read since its last reset), it sets
    :attr:`~torchmem.meters.base.Window.missed_reset` on each open window and warns
    (``TorchmemWarning``) once per window. Where PyTorch has no
    ``torch._C._<backend>_resetPeakMemoryStats`` to intercept, every reset is of that kind.

    Windows report any ``memory_stats()`` key that has a ``.peak``, named without it;
    the default is ``"allocated_bytes.all"`` (``max_memory_allocated``).
    """

    stats = ("allocated_bytes.all", "reserved_bytes.all")

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = str(device)
        self._kind = device.type
        self._index = device.index
        self._backend = getattr(torch, device.type)
        self._backend.init()
        self._floor: dict[str, int] = {}
        """The least each peak (``stat.pool``) can be until the next reset the meter knows
        of: the highest value it read under its lock since the last one, in bytes (or a
        count). A lower peak means a reset it did not see."""

    def used(self) -> int:
        used = int(self._backend.memory_allocated(self._index))
        if lock_is_owned(self._lock):  # no reset the meter knows of can come in between
            self._raise_floor(used)
        return used

    def reserved(self) -> int:
        """Bytes the caching allocator holds on this device (in tensors or cached)."""
        return int(self._backend.memory_reserved(self._index))

    def counters(self) -> dict[str, int]:
        flat = self._flat(_COUNTERS) or {f"{s}.{p}": 0 for s in self.stats for p in _COUNTERS}
        if lock_is_owned(self._lock):  # the line profiler, at each line: see used()
            self._raise_floor(flat.get(f"{self.stats[0]}.current", 0))
        return flat

    def _raise_floor(self, used: int) -> None:
        """Bytes in use now (read under the lock) are a least value of the peak: only the
        default stat's, which costs one step (the line profiler reads at each line)."""
        stat = self.stats[0]
        if used > self._floor.get(stat, -1):
            self._floor[stat] = used

    def _peaks(self) -> dict[str, int]:
        # Before the allocator's first use there are no stats.
        peaks = self._flat(("peak",), suffix=False) or dict.fromkeys(self.stats, 0)
        floor = self._floor
        self._floor = dict(peaks)
        if any(peaks.get(stat, least) < least for stat, least in floor.items()):
            self._missed_reset(floor)
            return {stat: max(value, floor.get(stat, value)) for stat, value in peaks.items()}
        return peaks

    def _missed_reset(self, floor: dict[str, int]) -> None:
        """The counters went down below `floor`: other code reset them. Every open window
        was open when the floor was read, so it keeps that much; mark it."""
        marked = 0
        for ref in self._windows.values():
            window = ref()
            if window is not None:
                window._fold(floor)
                if not window.missed_reset:
                    window.missed_reset = True
                    marked += 1
        if marked:
            warnings.warn(
                f"the peak counters of {self.device} were reset by code torchmem could not"
                f" intercept (C++, or a reset function kept from before): the peaks of"
                f" {marked} open window(s) count from that reset only",
                TorchmemWarning,
                stacklevel=4,
            )

    def _flat(self, parts: tuple[str, ...], suffix: bool = True) -> dict[str, int]:
        """``memory_stats()``'s `parts` of every stat, keyed ``stat.pool[.part]``.

        Read nested, which skips the flattening that makes ``memory_stats()`` cost ~135 µs:
        the line profiler reads twice per line.
        """
        flat = {}
        for stat, pools in self._backend.memory_stats_as_nested_dict(self._index).items():
            if isinstance(pools, dict):
                for pool, values in pools.items():
                    if isinstance(values, dict):
                        for part in parts:
                            if part in values:
                                key = f"{stat}.{pool}.{part}" if suffix else f"{stat}.{pool}"
                                flat[key] = values[part]
        return flat

    def _reset_peaks(self) -> None:
        # PyTorch's own reset, not the interceptor: the windows were just folded.
        reset = peak_reset(self._kind)
        if reset is None:
            self._backend.reset_peak_memory_stats(self._index)
        else:
            reset(int(self._backend.current_device()) if self._index is None else self._index)
        self._floor = {}

    def _on_open(self, ref: WindowRef) -> None:
        with _watching_lock:
            _watching.setdefault(self._kind, set()).add(self)
            # After the add: a window dropped open, released here by a garbage collection,
            # then never sees this backend with no meter watching.
            intercept_peak_resets(self._kind, partial(_fold_before_reset, self._kind))

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        with self._lock:
            if self._windows:
                return
            with _watching_lock:
                watching = _watching.get(self._kind, set())
                watching.discard(self)
                if not watching:
                    stop_intercepting_peak_resets(self._kind)


_watching: dict[str, set[AllocatorMeter]] = {}
"""The allocator meters with an open window, by backend (``"cuda"``, ``"xpu"``): while
there is one, resets of that backend's peak counters are intercepted."""
_watching_lock = threading.RLock()


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """For tests: inside the block no window opened before it is watched, and after it
    none opened inside is (see :func:`torchmem.meters.isolated`)."""
    global _watching
    with _watching_lock:
        kept, _watching = _watching, {}
    try:
        yield
    finally:
        with _watching_lock:
            _watching = kept


def _device_index(kind: str, device: object) -> int | None:
    """The index of `device` as ``torch.<kind>`` takes it (None: the current device; an
    index; ``"cuda:1"``; a ``torch.device``), or None if it names no device of `kind`."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return None
    if isinstance(device, torch.device):
        if device.type != kind:
            return None
        device = device.index
    if device is None:
        return int(getattr(torch, kind).current_device())
    return device if isinstance(device, int) and not isinstance(device, bool) else None


def _fold_before_reset(kind: str, device: object, reset: Callable[[Any], Any]) -> Any:
    """Other code's reset of `kind`'s peak counters on `device`, intercepted: fold the
    counters into the open windows of that device first. The meters' locks are held until
    the reset is done, so that none of their reads comes in between."""
    index = _device_index(kind, device)
    with _watching_lock:
        meters = [m for m in _watching.get(kind, ()) if _device_index(kind, m._index) == index]
    with contextlib.ExitStack() as held:
        try:
            try:
                for meter in sorted(meters, key=id):
                    held.enter_context(meter._lock)
                    meter._collect()
                    meter._fold()
            except Exception as exc:  # ours must not replace what the caller's reset does
                warnings.warn(
                    f"torchmem could not read the peak counters of {kind} before other code"
                    f" reset them ({exc}): open windows may miss the peak before the reset",
                    TorchmemWarning,
                    stacklevel=4,
                )
        finally:  # the caller's reset happens whatever folding did
            result = reset(device)
            for meter in meters:
                meter._floor = {}
    return result


def _after_fork_in_child() -> None:
    global _watching_lock
    _watching_lock = threading.RLock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
