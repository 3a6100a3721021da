"""How much GPU memory there is: the seeds' device queries and allocation helpers.

fastai's ``gpu_mem_get*`` and ipyexperiments' ``gpu_mem_*_mbs`` answer in whole MB (MiB,
via :func:`~torchmem.units.b2mb`), for the whole device (all processes), as NVML reports
it. Unlike the originals, the torch device index is matched to the right NVML device
(``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``), only visible devices are listed, and
nothing fails without a GPU: the queries answer zeros, ``[]`` or ``(None, 0)``.
"""

from __future__ import annotations

import gc
import numbers
import operator
import reprlib
from typing import Any, SupportsIndex, cast

import psutil
import torch

from torchmem.errors import TorchmemError
from torchmem.meters import device_meter, meter, nvml
from torchmem.meters.cpu import CPU_METER_VARIABLE, CpuAllocatorMeter, unavailable
from torchmem.records.devices import CPUInfo, GPUInfo, GPUMemory, RAMInfo
from torchmem.resolve import resolve_device
from torchmem.units import MB, b2mb


def gpu_mem_get(id: int | None = None) -> GPUMemory:
    """Total, free and used memory of GPU `id` (default: the current torch device), in MB.

    Returns ``GPUMemory(0, 0, 0)`` where there is no GPU or no device `id`.
    """
    info = _device_bytes(id)
    if info is None:
        return GPUMemory(0, 0, 0)
    total, free, used = info
    return GPUMemory(b2mb(total), b2mb(free), b2mb(used))


def gpu_mem_get_all() -> list[GPUMemory]:
    """:func:`gpu_mem_get` of every GPU visible to torch, in torch's order; ``[]`` without."""
    return [gpu_mem_get(i) for i in range(_gpu_count())]


def gpu_mem_get_total_mbs(id: int | None = None) -> int:
    """Total memory of GPU `id` (default: current), in MB; 0 without a GPU."""
    return gpu_mem_get(id).total


def gpu_mem_get_free(id: int | None = None) -> int:
    """Free memory of GPU `id` (default: current), in MB, leaving PyTorch's cache as it is.

    Memory cached by PyTorch's allocator counts as used; see
    :func:`gpu_mem_get_free_no_cache`. 0 without a GPU.
    """
    return gpu_mem_get(id).free


def gpu_mem_get_free_no_cache(id: int | None = None) -> int:
    """Free memory of GPU `id` (default: current), in MB, after ``gc.collect()`` and
    emptying PyTorch's allocator cache; 0 without a GPU."""
    _flush()
    return gpu_mem_get(id).free


def gpu_mem_get_used(id: int | None = None) -> int:
    """Used memory of GPU `id` (default: current), all processes, in MB, cache included;
    0 without a GPU."""
    return gpu_mem_get(id).used


def gpu_mem_get_used_no_cache(id: int | None = None) -> int:
    """Used memory of GPU `id` (default: current), in MB, after ``gc.collect()`` and
    emptying PyTorch's allocator cache; 0 without a GPU."""
    _flush()
    return gpu_mem_get(id).used


def gpu_mem_get_used_fast(gpu_handle: Any) -> int:
    """Used memory, in MB, of the device behind an NVML handle (see :func:`nvml_handle`).

    The cheapest query, for polling: no cache flush, no index mapping. Returns 0 for a
    ``None`` handle (no GPU, or no NVML).

    Raises:
        TypeError: naming the value, for anything but a handle or None (a device index,
            a string; any value where NVML is not available).
    """
    if gpu_handle is None:
        return 0
    _check_handle(gpu_handle)
    return b2mb(nvml.memory(gpu_handle)[2])


def nvml_handle(id: int | None = None) -> Any | None:
    """The NVML handle of torch's GPU `id` (default: current), matched by UUID, for
    :func:`gpu_mem_get_used_fast`; None without a GPU or without ``nvidia-ml-py``."""
    index = _valid_index(id)
    return None if index is None else device_meter(index).nvml_handle


def gpu_with_max_free_mem() -> tuple[int | None, int]:
    """``(id, free MB)`` of the first GPU with the most free memory; ``(None, 0)`` without."""
    free = [mem.free for mem in gpu_mem_get_all()]
    if not free:
        return None, 0
    best = free.index(max(free))
    return best, free[best]


def preload_pytorch(device_id: int | None = None) -> None:
    """Create PyTorch's CUDA context on GPU `device_id` (default: current) now.

    The first CUDA operation costs about 0.5 GB of device memory for the context; do it
    before measuring so that the context is not charged to the code measured. Does
    nothing without a GPU.
    """
    if torch.cuda.is_available():
        torch.ones((1, 1), device=resolve_device(device_id))


def gpu_mem_allocate_mbs(n: int, fatal: bool = False) -> torch.Tensor | None:
    """Allocate `n` MB on the current GPU, directly on the device.

    Returns the tensor holding the memory (``del`` it to free the memory), or None if
    the allocation failed or there is no GPU.

    Args:
        n: whole MB (MiB) to allocate.
        fatal: raise instead of returning None: ``torch.OutOfMemoryError`` saying how
            much was asked and how much was free, or :class:`TorchmemError` without a GPU.

    Raises:
        ValueError: if `n` is not a non-negative whole number.
    """
    _check_mbs("gpu_mem_allocate_mbs", n)
    if not torch.cuda.is_available():
        if fatal:
            raise TorchmemError(f"cannot allocate {n} MB: no CUDA GPU is available")
        return None
    try:
        return torch.empty(n * MB, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        if not fatal:
            return None
        device = torch.cuda.current_device()
        raise torch.OutOfMemoryError(
            f"could not allocate {n} MB on cuda:{device}: {gpu_mem_get_free(device)} MB free"
        ) from exc


def gpu_mem_leave_free_mbs(n: int) -> torch.Tensor | None:
    """Allocate whatever leaves only `n` MB free on the current GPU, to reproduce an
    out-of-memory error on any card.

    Returns the tensor holding the memory: keep it alive as long as it should stay used.
    The driver often cannot hand out all memory it reports free, so leave a margin.
    Returns None without a GPU.

    Raises:
        ValueError: if `n` is not a non-negative whole number.
        TorchmemError: if less than `n` MB is free already, or the allocation fails.
    """
    _check_mbs("gpu_mem_leave_free_mbs", n)
    if not torch.cuda.is_available():
        return None
    free = gpu_mem_get_free()
    if free < n:
        raise TorchmemError(f"already have less available mem than desired {n}MBs: {free} MB free")
    consume = free - n
    buffer = gpu_mem_allocate_mbs(consume)
    if buffer is None:
        raise TorchmemError(f"failed to allocate {consume}MB to leave {n} MB free")
    return buffer


# The ipyexperiments names of the same queries.
gpu_mem_get_free_mbs = gpu_mem_get_free
gpu_mem_get_free_no_cache_mbs = gpu_mem_get_free_no_cache
gpu_mem_get_used_mbs = gpu_mem_get_used
gpu_mem_get_used_no_cache_mbs = gpu_mem_get_used_no_cache


# The devices report ---------------------------------------------------------------------


def gpu_info() -> list[GPUInfo]:
    """Every GPU visible to torch, with its memory and this process's share of it."""
    infos = []
    for index in range(_gpu_count()):
        dev = device_meter(index)
        total, free, used = dev.info()
        infos.append(
            GPUInfo(
                index=index,
                name=torch.cuda.get_device_name(index),
                total=total,
                used=used,
                free=free,
                allocated=torch.cuda.memory_allocated(index),
                reserved=torch.cuda.memory_reserved(index),
                source="cuda" if dev.nvml_handle is None else "nvml",
            )
        )
    return infos


def cpu_info() -> CPUInfo:
    """Which backend counts CPU tensor memory here (starting it), and what it counts now."""
    cpu = meter("cpu")
    if isinstance(cpu, CpuAllocatorMeter):
        return CPUInfo(backend="allocator", used=cpu.used(), detail=str(cpu.library.path))
    detail = unavailable() or f"chosen by {CPU_METER_VARIABLE}"
    return CPUInfo(backend="dispatch", used=cpu.used(), detail=detail)


def ram_info() -> RAMInfo:
    """This process's resident memory and the machine's total and available memory."""
    system = psutil.virtual_memory()
    return RAMInfo(process=meter("ram").used(), total=system.total, available=system.available)


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _valid_index(id: object) -> int | None:
    """`id` as a visible CUDA device index (None means current), or None if invalid."""
    if not torch.cuda.is_available() or isinstance(id, bool):
        return None
    try:  # ints, and numpy ints as older code passes them; no device strings
        device = resolve_device(None if id is None else operator.index(cast(SupportsIndex, id)))
    except (TypeError, ValueError):
        return None
    return device.index


def _device_bytes(id: object) -> tuple[int, int, int] | None:
    index = _valid_index(id)
    return None if index is None else device_meter(index).info()


def _flush() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _check_handle(handle: object) -> None:
    """Refuse what cannot be an NVML device handle, before NVML reads it as a pointer."""
    lib = nvml.nvml()
    kind = getattr(lib, "c_nvmlDevice_t", None)  # pynvml's handle type
    if (
        lib is None
        or isinstance(handle, (str, bytes, bytearray, numbers.Number))
        or (isinstance(kind, type) and not isinstance(handle, kind))
    ):
        why = "" if lib is not None else "; NVML is not available here, so there are none"
        raise TypeError(
            "gpu_mem_get_used_fast: gpu_handle must be an NVML device handle from"
            f" nvml_handle(), or None, not {reprlib.repr(handle)} ({type(handle).__name__}){why}"
        )


def _check_mbs(function: str, n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{function}: n must be a non-negative whole number of MB, got {n!r}")
