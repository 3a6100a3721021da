"""Stand-ins for the few ``torch.cuda`` and NVML calls torchmem makes, for machines without
a GPU (the way ``wookayin/gpustat``'s tests stand in for NVML).

* :class:`StandInGpu`: one physical GPU or MIG instance, shared by both stand-ins, so
  memory this process reserves through the CUDA stand-in shows up in what NVML reports.
* :class:`CudaStandIn`: the ``torch.cuda`` functions torchmem calls, over a model of
  PyTorch's caching allocator with exact current and peak counters per device. Which
  devices it exposes, and in which order, follows what CUDA does under
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (:func:`cuda_devices`).
* :class:`NvmlStandIn`: a ``pynvml`` module that lists every physical device in PCI
  order, with MIG instances, whatever CUDA shows.

:func:`install_gpus` installs both with pytest's ``monkeypatch``; :func:`isolated` gives
each test torchmem's meter registry and NVML cache fresh.

For tests about a machine without a GPU, on every machine: :func:`hide_gpus` makes this
process see none, :func:`environ_without_gpu` is the environment for a subprocess that
must see none, and :func:`call_in_fresh_process_without_gpu` runs a measurement in a new
interpreter where CUDA is never initialised.

:class:`TracerStandIn` stands in for another ``sys.settrace`` tracer (a debugger,
coverage.py) beside the line profiler.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch

import torchmem.meters
from torchmem.meters import allocator, nvml as torchmem_nvml

KiB = 2**10
MiB = 2**20
GiB = 2**30

SMALL_SIZE = 1 * MiB
"""Largest request served from the small pool, as in PyTorch's allocator (``kSmallSize``)."""
MIN_BLOCK = 512
"""Every request is rounded up to a multiple of this, as in PyTorch (``kMinBlockSize``)."""

_POOLS = ("all", "large_pool", "small_pool")
_BYTE_STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")
_COUNT_STATS = ("allocation", "active")

_real_empty = torch.empty


def gpu_uuid(n: int, prefix: str = "GPU") -> str:
    """A distinct, well-formed UUID as NVML spells it: ``gpu_uuid(2) == "GPU-5e1f0a3c-..."``."""
    return f"{prefix}-5e1f0a3c-{n:04x}-4a7b-9c2d-{0xE0F1A2B3C4D5 + n:012x}"


@contextlib.contextmanager
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Give torchmem a fresh meter registry and NVML cache for one test, and clear the
    NVML cache again afterwards (use as ``with isolated(monkeypatch): yield`` in a fixture).

    ``torchmem.meters.meter()`` keeps one meter per device in ``torchmem.meters._meters``
    and ``torchmem.meters.nvml.nvml()`` caches the loaded module; both would otherwise
    carry stand-ins from one test into the next.
    """
    monkeypatch.setattr(torchmem.meters, "_meters", {})
    monkeypatch.setattr(allocator, "_watching", {})  # no window left open by another test
    torchmem_nvml.nvml.cache_clear()
    try:
        yield
    finally:
        torchmem_nvml.nvml.cache_clear()


# The shared device model ---------------------------------------------------------------


@dataclass
class _Counter:
    """One ``memory_stats`` quantity: ``.current``, ``.peak``, ``.allocated``, ``.freed``."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def add(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        self.peak = max(self.peak, self.current)

    def sub(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


@dataclass
class StandInAllocator:
    """Stand-in for PyTorch's CUDA caching allocator on one device, this process only.

    Counts exactly like the real one, in a simplified block model: a request is rounded
    up to :data:`MIN_BLOCK` bytes and served from the small pool up to :data:`SMALL_SIZE`,
    else the large pool; a freed block stays reserved in its pool's cache; a request takes
    what it can from its pool's cache and reserves the rest from the device (segments are
    exactly as large as needed); :meth:`empty_cache` gives every cached byte back.
    ``active`` equals ``allocated`` (there are no streams here).
    """

    counters: dict[str, _Counter] = field(
        default_factory=lambda: {
            f"{stat}.{pool}": _Counter() for stat in _BYTE_STATS + _COUNT_STATS for pool in _POOLS
        }
    )
    cached: dict[str, int] = field(default_factory=lambda: {"large_pool": 0, "small_pool": 0})
    num_alloc_retries: int = 0
    num_ooms: int = 0

    def current(self, key: str) -> int:
        return self.counters[key].current

    def peak(self, key: str) -> int:
        return self.counters[key].peak

    def _change(self, stat: str, pool: str, amount: int) -> None:
        for key in (f"{stat}.all", f"{stat}.{pool}"):
            if amount >= 0:
                self.counters[key].add(amount)
            else:
                self.counters[key].sub(-amount)

    def alloc(self, nbytes: int, capacity: int) -> int:
        """Allocate a block of `nbytes`; `capacity` is how much this allocator may reserve
        in all. Returns the block's size; raises ``torch.OutOfMemoryError`` like PyTorch,
        after giving back the cache and retrying once."""
        size, pool = _block(nbytes)
        if size == 0:
            return 0
        take = min(self.cached[pool], size)
        grow = size - take
        if self.current("reserved_bytes.all") + grow > capacity:
            self.num_alloc_retries += 1
            self.empty_cache()
            take, grow = 0, size
            if self.current("reserved_bytes.all") + grow > capacity:
                self.num_ooms += 1
                free = capacity - self.current("reserved_bytes.all")
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (stand-in). Tried to allocate {size} bytes; "
                    f"{free} bytes free"
                )
        self.cached[pool] -= take
        self._change("reserved_bytes", pool, grow)
        for stat in ("allocated_bytes", "active_bytes"):
            self._change(stat, pool, size)
        self._change("requested_bytes", pool, nbytes)
        for stat in _COUNT_STATS:
            self._change(stat, pool, 1)
        return size

    def free(self, nbytes: int) -> int:
        """Free a block allocated for `nbytes`: it stays reserved, cached in its pool."""
        size, pool = _block(nbytes)
        if size == 0:
            return 0
        if self.current(f"allocated_bytes.{pool}") < size:
            raise AssertionError(f"stand-in: freeing {nbytes} bytes that were never allocated")
        for stat in ("allocated_bytes", "active_bytes"):
            self._change(stat, pool, -size)
        self._change("requested_bytes", pool, -nbytes)
        for stat in _COUNT_STATS:
            self._change(stat, pool, -1)
        self.cached[pool] += size
        return size

    def empty_cache(self) -> None:
        for pool, cached in self.cached.items():
            self._change("reserved_bytes", pool, -cached)
            self.cached[pool] = 0

    def reset_peaks(self) -> None:
        """Every peak becomes its current value, as ``reset_peak_memory_stats`` does."""
        for counter in self.counters.values():
            counter.peak = counter.current

    def stats(self) -> dict[str, int]:
        """The flat dict ``torch.cuda.memory_stats`` returns, keys sorted as there."""
        flat = {"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}
        for key, counter in self.counters.items():
            for part in ("current", "peak", "allocated", "freed"):
                flat[f"{key}.{part}"] = getattr(counter, part)
        return dict(sorted(flat.items()))


def _block(nbytes: int) -> tuple[int, str]:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise AssertionError(f"stand-in: a block size must be a non-negative int, got {nbytes!r}")
    size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    return size, "small_pool" if size <= SMALL_SIZE else "large_pool"


@dataclass(eq=False)
class StandInGpu:
    """Stand-in for one GPU (or one MIG instance of a GPU), as CUDA and NVML both see it.

    NVML's ``used`` is what other processes and contexts hold (:attr:`used_elsewhere`)
    plus what this process's allocator has reserved here; ``free`` is the rest of
    :attr:`total`. ``cudaMemGetInfo`` reports the same numbers.
    """

    uuid: str
    """As NVML spells it: ``"GPU-..."``, or ``"MIG-..."`` for a MIG instance."""
    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GiB
    used_elsewhere: int = 0
    """Bytes held by other processes and CUDA contexts."""
    speed: int = 1
    """Relative speed, for ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (higher is faster)."""
    unallocatable: int = 0
    """Bytes reported free that ``cudaMalloc`` still cannot hand out."""
    mig_mode: int | None = None
    """NVML's current MIG mode (0 off, 1 on); None for a GPU without MIG support."""
    mig_slots: list[StandInGpu | None] = field(default_factory=list)
    """The MIG slots of this GPU (``nvmlDeviceGetMaxMigDeviceCount``); None is empty."""
    processes: dict[int, int | None] = field(default_factory=dict)
    """Bytes each compute process holds here, by process id, as
    ``nvmlDeviceGetComputeRunningProcesses`` lists them (None: NVML does not say)."""
    allocator: StandInAllocator = field(default_factory=StandInAllocator)

    @property
    def used(self) -> int:
        return self.used_elsewhere + self.allocator.current("reserved_bytes.all")

    @property
    def free(self) -> int:
        return self.total - self.used


def cuda_devices(
    gpus: list[StandInGpu],
    visible_devices: str | None = None,
    device_order: str = "FASTEST_FIRST",
) -> list[StandInGpu]:
    """The devices CUDA shows, in its order, for physical `gpus` listed in PCI order.

    Models the CUDA runtime: ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (the default) sorts by
    speed, ties in PCI order; ``PCI_BUS_ID`` keeps PCI order. ``CUDA_VISIBLE_DEVICES``
    then picks devices by index in that order, or by UUID (``GPU-...``, ``MIG-...``, or a
    unique prefix of one); parsing stops at the first entry that names no device. MIG
    instances are visible only when named by UUID.
    """
    if device_order == "PCI_BUS_ID":
        ordered = list(gpus)
    elif device_order == "FASTEST_FIRST":
        ordered = sorted(gpus, key=lambda gpu: -gpu.speed)  # stable: ties keep PCI order
    else:
        raise AssertionError(f"stand-in: unknown CUDA_DEVICE_ORDER {device_order!r}")
    if visible_devices is None:
        return ordered
    everything = [*gpus, *(mig for gpu in gpus for mig in gpu.mig_slots if mig is not None)]
    visible: list[StandInGpu] = []
    for entry in visible_devices.split(","):
        entry = entry.strip()
        if entry.isdigit():
            found = [ordered[int(entry)]] if int(entry) < len(ordered) else []
        elif entry.startswith(("GPU-", "MIG-")):
            found = [gpu for gpu in everything if gpu.uuid.startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in visible:
            break
        visible.append(found[0])
    return visible


# torch.cuda --------------------------------------------------------------------------


class StandInCUuuid:
    """Stand-in for torch's ``_CUuuid``: prints as the bare UUID, without ``GPU-``/``MIG-``."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text

    __repr__ = __str__


@dataclass(frozen=True)
class StandInDeviceProperties:
    """Stand-in for ``torch.cuda.get_device_properties(i)`` (the fields torchmem reads)."""

    name: str
    total_memory: int
    uuid: StandInCUuuid


class CudaStandIn:
    """Stand-in for the ``torch.cuda`` functions torchmem calls, on a machine without a GPU.

    Exposes `gpus` (physical devices in PCI order) the way CUDA would under the given
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (:func:`cuda_devices`): torch index
    ``i`` is :attr:`visible` ``[i]``. Each device has a :class:`StandInAllocator`;
    :meth:`alloc` and :meth:`free` stand for creating and dropping a tensor there.

    Every call torchmem makes is recorded in :attr:`calls` as ``(name, device index)``
    (index None where the call takes no device), so wiring can be asserted.
    """

    FUNCTIONS = (
        "is_available",
        "device_count",
        "current_device",
        "set_device",
        "init",
        "get_device_properties",
        "get_device_name",
        "memory_allocated",
        "memory_reserved",
        "max_memory_allocated",
        "memory_stats",
        "memory_stats_as_nested_dict",
        "reset_peak_memory_stats",
        "mem_get_info",
        "empty_cache",
        "synchronize",
    )
    """The ``torch.cuda`` attributes :meth:`install` replaces."""

    def __init__(
        self,
        gpus: list[StandInGpu],
        visible_devices: str | None = None,
        device_order: str = "FASTEST_FIRST",
        calls: list[tuple[str, int | None]] | None = None,
    ) -> None:
        self.gpus = gpus
        self.visible_devices = visible_devices
        self.device_order = device_order
        self.visible = cuda_devices(gpus, visible_devices, device_order)
        """The devices torch sees, by torch index."""
        self.current = 0
        """torch's current device index."""
        self.initialized = False
        self.calls: list[tuple[str, int | None]] = [] if calls is None else calls
        self.factory_calls: list[dict[str, Any]] = []
        """Arguments of each call to a :meth:`tensor_factory` stand-in."""

    def install(self, monkeypatch: pytest.MonkeyPatch, environ: bool = True) -> CudaStandIn:
        """Replace the ``torch.cuda`` functions, and ``torch._C._cuda_resetPeakMemoryStats``
        with :meth:`allocator_reset_peaks` (and, with `environ`, set the environment CUDA
        would have read) for the rest of the test."""
        for name in self.FUNCTIONS:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        # Absent from CPU builds of PyTorch: raising=False, and the undo deletes it.
        monkeypatch.setattr(
            torch._C, "_cuda_resetPeakMemoryStats", self.allocator_reset_peaks, raising=False
        )
        if not environ:
            return self
        for variable, value in (
            ("CUDA_VISIBLE_DEVICES", self.visible_devices),
            ("CUDA_DEVICE_ORDER", self.device_order),
        ):
            if value is None:
                monkeypatch.delenv(variable, raising=False)
            else:
                monkeypatch.setenv(variable, value)
        return self

    # Driving the model ------------------------------------------------------------------

    def alloc(self, device: int, nbytes: int) -> int:
        """Stand for a tensor of `nbytes` created on torch device `device`; returns the
        block size (`nbytes` rounded up to 512)."""
        self.initialized = True
        gpu = self._gpu(device)
        return gpu.allocator.alloc(nbytes, gpu.total - gpu.used_elsewhere - gpu.unallocatable)

    def free(self, device: int, nbytes: int) -> int:
        """Stand for the last reference to a tensor of `nbytes` on `device` dying."""
        return self._gpu(device).allocator.free(nbytes)

    def spike(self, device: int, nbytes: int) -> None:
        """A temporary: allocate `nbytes` on `device` and free it again."""
        self.alloc(device, nbytes)
        self.free(device, nbytes)

    def count(self, name: str) -> int:
        """How many times ``torch.cuda.<name>`` was called."""
        return sum(1 for call, _ in self.calls if call == name)

    def devices(self, name: str) -> list[int | None]:
        """The device index of each call to ``torch.cuda.<name>``, in order."""
        return [device for call, device in self.calls if call == name]

    def tensor_factory(self, real: Any) -> Any:
        """Stand-in for a tensor factory such as ``torch.empty`` (`real`): a call for a CUDA
        device is recorded as ``("torch.<name>", index)`` in :attr:`calls` and with its
        arguments in :attr:`factory_calls`, its bytes are allocated through the model
        (which may raise ``OutOfMemoryError``), and it returns a ``meta`` tensor of that
        shape and dtype. Calls for other devices go to `real` unchanged."""

        def factory(*size: Any, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
            if device is None or torch.device(device).type != "cuda":
                return real(*size, dtype=dtype, device=device, **kwargs)
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], tuple | list) else size
            self.factory_calls.append({"size": shape, "dtype": dtype, "device": device, **kwargs})
            tensor = _real_empty(shape, dtype=dtype, device="meta")  # no memory
            index = self._index(device)
            self.calls.append((f"torch.{real.__name__}", index))
            self.alloc(index, tensor.numel() * tensor.element_size())
            return tensor

        return factory

    # torch.cuda -------------------------------------------------------------------------

    def is_available(self) -> bool:
        return len(self.visible) > 0

    def device_count(self) -> int:
        return len(self.visible)

    def current_device(self) -> int:
        self._lazy_init()
        return self.current

    def set_device(self, device: Any) -> None:
        self.current = self._index(device)

    def init(self) -> None:
        self.calls.append(("init", None))
        self._lazy_init()

    def get_device_properties(self, device: Any = None) -> StandInDeviceProperties:
        index = self._index(device)
        if not 0 <= index < len(self.visible):
            raise AssertionError("Invalid device id")  # as torch says it
        gpu = self.visible[index]
        bare = gpu.uuid.split("-", 1)[1]
        return StandInDeviceProperties(gpu.name, gpu.total, StandInCUuuid(bare))

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        index = self._index(device)
        self.calls.append(("memory_stats", index))
        # As in torch: empty until CUDA is initialised in this process.
        return self._gpu(index).allocator.stats() if self.initialized else {}

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        index = self._index(device)
        self.calls.append(("memory_stats_as_nested_dict", index))
        flat = self._gpu(index).allocator.stats() if self.initialized else {}
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            *path, last = key.split(".")
            level = nested
            for part in path:
                level = level.setdefault(part, {})
            level[last] = value
        return nested

    def memory_allocated(self, device: Any = None) -> int:
        index = self._index(device)
        self.calls.append(("memory_allocated", index))
        return self._gpu(index).allocator.current("allocated_bytes.all")

    def max_memory_allocated(self, device: Any = None) -> int:
        return self._gpu(self._index(device)).allocator.peak("allocated_bytes.all")

    def memory_reserved(self, device: Any = None) -> int:
        index = self._index(device)
        self.calls.append(("memory_reserved", index))
        return self._gpu(index).allocator.current("reserved_bytes.all")

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """As in torch: ``torch._C._cuda_resetPeakMemoryStats``, looked up at each call, with
        the device's index (so torchmem's interception sees it)."""
        torch._C._cuda_resetPeakMemoryStats(self._index(device))

    def allocator_reset_peaks(self, device: int) -> None:
        """Stand-in for ``torch._C._cuda_resetPeakMemoryStats``, the allocator's own reset,
        which :meth:`install` puts there: every public reset ends here. Called directly, it
        stands for a reset nothing in Python can intercept (one made from C++). Recorded in
        :attr:`calls` as ``("reset_peak_memory_stats", device)``."""
        self.calls.append(("reset_peak_memory_stats", device))
        self._gpu(device).allocator.reset_peaks()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        index = self._index(device)
        self.calls.append(("mem_get_info", index))
        self._lazy_init()
        gpu = self._gpu(index)
        return gpu.free, gpu.total

    def empty_cache(self) -> None:
        """Gives back the cache of every device, as PyTorch's ``emptyCache`` does."""
        self.calls.append(("empty_cache", None))
        for gpu in self.visible:
            gpu.allocator.empty_cache()

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", self._index(device)))

    # Helpers ----------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        if not self.visible:
            raise RuntimeError("stand-in: no CUDA GPUs are available")
        self.initialized = True

    def _index(self, device: Any) -> int:
        """A device argument as torch.cuda takes it (None, int, str, torch.device)."""
        if device is None:
            return self.current
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"stand-in: expected a cuda device, got {device}")
            return self.current if device.index is None else device.index
        if isinstance(device, int) and not isinstance(device, bool):
            return device
        raise TypeError(f"stand-in: not a device: {device!r}")

    def _gpu(self, device: Any) -> StandInGpu:
        index = self._index(device)
        if not 0 <= index < len(self.visible):
            raise RuntimeError(f"stand-in: Invalid device argument {index}")
        return self.visible[index]


# pynvml ------------------------------------------------------------------------------


class NVMLError(Exception):
    """Stand-in for ``pynvml.NVMLError``."""


@dataclass(frozen=True, eq=False)
class StandInNvmlHandle:
    """Stand-in for an NVML device handle; :attr:`gpu` is the device it points at."""

    gpu: StandInGpu


@dataclass(frozen=True)
class StandInNvmlProcess:
    """Stand-in for an entry of ``nvmlDeviceGetComputeRunningProcesses``."""

    pid: int
    usedGpuMemory: int | None  # pynvml's name


@dataclass(frozen=True)
class StandInNvmlMemory:
    """Stand-in for ``nvmlDeviceGetMemoryInfo``'s ``c_nvmlMemory_t``."""

    total: int
    free: int
    used: int


class NvmlStandIn(types.ModuleType):
    """Stand-in for the ``pynvml`` module (``nvidia-ml-py``), installed in ``sys.modules``.

    Lists every physical device of `gpus` in PCI order, whatever CUDA shows, and the
    instances of MIG-enabled ones. Calls before ``nvmlInit`` raise :class:`NVMLError`, as
    NVML does; with ``init_error`` set, ``nvmlInit`` itself raises (no driver, or a
    driver/library mismatch). With ``uuid_bytes``, UUIDs come back as ``bytes``, as in old
    ``pynvml`` releases.
    """

    NVMLError = NVMLError
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(
        self,
        gpus: list[StandInGpu],
        init_error: str | None = None,
        uuid_bytes: bool = False,
        calls: list[tuple[str, int | None]] | None = None,
    ) -> None:
        super().__init__("pynvml", "Stand-in for pynvml (tests/standins.py).")
        self.gpus = gpus
        self.init_error = init_error
        self.uuid_bytes = uuid_bytes
        self.initialized = False
        self.calls: list[tuple[str, int | None]] = [] if calls is None else calls
        self._handles: dict[int, StandInNvmlHandle] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> NvmlStandIn:
        """Make ``import pynvml`` return this module for the rest of the test."""
        monkeypatch.setitem(sys.modules, "pynvml", self)
        torchmem_nvml.nvml.cache_clear()
        return self

    @staticmethod
    def hide(monkeypatch: pytest.MonkeyPatch) -> None:
        """Make ``import pynvml`` fail, as where ``nvidia-ml-py`` is not installed."""
        monkeypatch.setitem(sys.modules, "pynvml", None)
        torchmem_nvml.nvml.cache_clear()

    def handle_of(self, gpu: StandInGpu) -> StandInNvmlHandle:
        """The one handle this NVML gives out for `gpu`."""
        return self._handles.setdefault(id(gpu), StandInNvmlHandle(gpu))

    def _check(self, name: str) -> None:
        self.calls.append((f"nvml.{name}", None))
        if not self.initialized:
            raise NVMLError("Uninitialized")

    def nvmlInit(self) -> None:
        self.calls.append(("nvml.nvmlInit", None))
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> StandInNvmlHandle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return self.handle_of(self.gpus[index])

    def nvmlDeviceGetUUID(self, handle: StandInNvmlHandle) -> str | bytes:
        self._check("nvmlDeviceGetUUID")
        return handle.gpu.uuid.encode() if self.uuid_bytes else handle.gpu.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: StandInNvmlHandle) -> StandInNvmlMemory:
        self._check("nvmlDeviceGetMemoryInfo")
        gpu = handle.gpu
        return StandInNvmlMemory(total=gpu.total, free=gpu.free, used=gpu.used)

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: StandInNvmlHandle
    ) -> list[StandInNvmlProcess]:
        self._check("nvmlDeviceGetComputeRunningProcesses")
        return [StandInNvmlProcess(pid, used) for pid, used in handle.gpu.processes.items()]

    def nvmlDeviceGetMigMode(self, handle: StandInNvmlHandle) -> tuple[int, int]:
        self._check("nvmlDeviceGetMigMode")
        if handle.gpu.mig_mode is None:
            raise NVMLError("Not Supported")
        return handle.gpu.mig_mode, handle.gpu.mig_mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: StandInNvmlHandle) -> int:
        self._check("nvmlDeviceGetMaxMigDeviceCount")
        if handle.gpu.mig_mode is None:
            raise NVMLError("Not Supported")
        return len(handle.gpu.mig_slots)

    def nvmlDeviceGetMigDeviceHandleByIndex(
        self, handle: StandInNvmlHandle, index: int
    ) -> StandInNvmlHandle:
        self._check("nvmlDeviceGetMigDeviceHandleByIndex")
        slots = handle.gpu.mig_slots
        if not 0 <= index < len(slots) or slots[index] is None:
            raise NVMLError("Not Found")
        return self.handle_of(slots[index])


class StandIns(NamedTuple):
    """The stand-ins :func:`install_gpus` installed (``nvml`` is None where it is missing)."""

    cuda: CudaStandIn
    nvml: NvmlStandIn | None


def install_gpus(
    monkeypatch: pytest.MonkeyPatch,
    gpus: list[StandInGpu],
    visible_devices: str | None = None,
    device_order: str = "FASTEST_FIRST",
    nvml: str = "present",
    uuid_bytes: bool = False,
) -> StandIns:
    """Install :class:`CudaStandIn` over `gpus` and, per `nvml`, an :class:`NvmlStandIn`
    (``"present"``), one whose ``nvmlInit`` fails (``"broken"``), or none at all, so that
    ``import pynvml`` fails (``"missing"``). Both record into the same ``calls`` list."""
    cuda = CudaStandIn(gpus, visible_devices, device_order).install(monkeypatch)
    if nvml == "missing":
        NvmlStandIn.hide(monkeypatch)
        return StandIns(cuda, None)
    if nvml not in ("present", "broken"):
        raise AssertionError(f"stand-in: nvml must be present, broken or missing, not {nvml!r}")
    init_error = "Driver/library version mismatch" if nvml == "broken" else None
    lib = NvmlStandIn(gpus, init_error, uuid_bytes, calls=cuda.calls).install(monkeypatch)
    return StandIns(cuda, lib)


# No GPU ------------------------------------------------------------------------------


def hide_gpus(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    """Make this process see no GPU for the rest of the test, whatever the machine has:
    ``torch.cuda.is_available()`` is False and ``device_count()`` is 0 (a
    :class:`CudaStandIn` over no devices).

    The environment is left alone: were some real CUDA call to initialise CUDA during the
    test, a ``CUDA_VISIBLE_DEVICES`` changed here would stay in force for the rest of the
    process, and the tests after this one that need the real GPU would not see it.
    """
    return CudaStandIn([]).install(monkeypatch, environ=False)


def environ_without_gpu() -> dict[str, str]:
    """This process's environment with every GPU hidden (``CUDA_VISIBLE_DEVICES=""``), for
    a subprocess that must see no GPU, whatever the machine has."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


_FRESH_PROCESS = """\
import importlib.util, json, os, sys
path, qualname, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, os.path.dirname(path))
spec = importlib.util.spec_from_file_location("_fresh_process_module", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
function = module
for name in qualname.split("."):
    function = getattr(function, name)
result = function(*args)
import torch
print(json.dumps({"result": result, "cuda_initialized": torch.cuda.is_initialized()}))
"""


def call_in_fresh_process_without_gpu(function: Callable[..., Any], *args: Any) -> Any:
    """Call `function` (module level, in a test module) with `args` in a new Python process
    that sees no GPU (:func:`environ_without_gpu`), and return its result; arguments and
    result travel as JSON.

    For measurements of the whole process, such as its resident memory: there, nothing
    but the code measured runs. The test process, once earlier tests have run, has dozens
    of threads (CUDA's, PyTorch's CPU thread pool, an allocator's background purge thread)
    that fault in and free pages on their own schedule, and Linux counts resident pages
    per CPU in batches: its resident size moves by a MiB or more that no code under test
    caused. The new process imports the test module afresh and never initialises CUDA
    (this is checked).
    """
    qualname = function.__qualname__
    if "<locals>" in qualname:
        raise AssertionError(f"stand-in: {qualname} must be defined at module level")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_PROCESS,
            inspect.getfile(function),
            qualname,
            json.dumps(args),
        ],
        env=environ_without_gpu(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise AssertionError(f"{qualname} failed in a fresh process:\n{result.stderr}")
    answer = json.loads(result.stdout.splitlines()[-1])
    if answer["cuda_initialized"]:
        raise AssertionError(f"{qualname} initialised CUDA in a process meant to have no GPU")
    return answer["result"]


class TracerStandIn:
    """Another tracer (a debugger, coverage) for the line profiler's tests: records the
    events of some functions, as ``sys.settrace`` hands them."""

    def __init__(self, *functions: Callable[..., object]) -> None:
        self.codes = {f.__code__ for f in functions}
        self.events: list[tuple[str, str, int]] = []

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> TracerStandIn | None:
        if frame.f_code not in self.codes:
            return None
        self.events.append((frame.f_code.co_name, event, frame.f_lineno))
        return self


# CUDA allocator history ---------------------------------------------------------------


class HistoryStandIn:
    """Stand-in for PyTorch's one CUDA allocator history per process
    (``torch.cuda.memory._record_memory_history`` and ``_snapshot``), behaving as measured
    on an H100 with PyTorch 2.11: enabling it again keeps what it holds unless
    ``clear_history``; turning it off (``enabled=None``) discards it; a smaller
    ``max_entries`` drops the oldest entries. :meth:`alloc` stands for the program making
    a tensor on GPU 0 (a trace entry when enabled, with a frame when the context records
    allocation stacks)."""

    def __init__(self) -> None:
        self.enabled: str | None = None
        self.settings: dict[str, Any] = {}
        """The last call's settings (``context``, ``stacks``, ``max_entries``, ...)."""
        self.trace: list[dict[str, Any]] = []
        self.calls: list[tuple[str | None, dict[str, Any]]] = []
        """Every call of the stand-in ``_record_memory_history`` that reached it."""

    def _record_memory_history(
        self,
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        skip_actions: list[str] | None = None,
    ) -> None:
        settings = {"context": context, "stacks": stacks, "max_entries": max_entries}
        if skip_actions is not None:
            settings["skip_actions"] = skip_actions
        self.calls.append((enabled, {**settings, "clear_history": clear_history}))
        self.enabled = enabled
        if enabled is None:
            self.settings, self.trace = {}, []
            return
        self.settings = settings
        if clear_history:
            self.trace = []
        del self.trace[: max(0, len(self.trace) - max_entries)]

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        return {"segments": [], "device_traces": [list(self.trace)]}

    def alloc(self, address: int, size: int, action: str = "alloc") -> None:
        """The program allocates (or, with `action`, frees) `size` bytes at `address`."""
        if self.enabled != "all" or action in (self.settings.get("skip_actions") or ()):
            return
        entry: dict[str, Any] = {
            "action": action,
            "addr": address,
            "size": size,
            "time_us": time.time_ns() // 1000,
            "frames": [],
        }
        if self.settings["context"] in ("alloc", "all") and action == "alloc":
            entry["frames"] = [{"filename": "/home/me/train.py", "line": 7, "name": "step"}]
        self.trace.append(entry)
        del self.trace[: max(0, len(self.trace) - self.settings["max_entries"])]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HistoryStandIn:
        monkeypatch.setattr(
            torch.cuda.memory, "_record_memory_history", self._record_memory_history
        )
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self._snapshot)
        monkeypatch.setattr(
            torch._C, "_cuda_isHistoryEnabled", lambda: self.enabled is not None, raising=False
        )
        return self
