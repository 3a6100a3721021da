"""A thin adapter over NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

NVML is loaded on first use, never at import, and any failure to load or initialise it
(not installed, no driver, a driver/library mismatch) means "no NVML": callers fall back
to ``torch.cuda.mem_get_info``.

Torch's device indices are not NVML's: ``CUDA_VISIBLE_DEVICES`` hides and reorders
devices (by index or UUID) and ``CUDA_DEVICE_ORDER`` changes CUDA's order, while NVML
always lists every device in PCI order. So a torch device is matched to its NVML device
by UUID, which CUDA and NVML both report, and which also names MIG instances.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch


@functools.cache
def nvml() -> Any:
    """The initialised ``pynvml`` module (untyped), or None where NVML cannot be used."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or any NVMLError: missing library, driver mismatch
        return None
    return pynvml


def handle(index: int) -> Any | None:
    """The NVML handle of torch's CUDA device `index`, or None where there is none."""
    lib = nvml()
    if lib is None:
        return None
    uuid = _normal(torch.cuda.get_device_properties(index).uuid)
    for candidate in _handles(lib):
        if _normal(lib.nvmlDeviceGetUUID(candidate)) == uuid:
            return candidate
    return None


def memory(nvml_handle: Any) -> tuple[int, int, int]:
    """``(total, free, used)`` bytes of the whole device, all processes."""
    info = nvml().nvmlDeviceGetMemoryInfo(nvml_handle)
    return int(info.total), int(info.free), int(info.used)


def process_memory(pid: int) -> dict[int, int]:
    """Bytes process `pid` holds on each of torch's CUDA devices, by torch index, as NVML
    lists compute processes: its CUDA context, what its caching allocator reserved, NCCL's
    buffers, other libraries' memory. Devices where it holds nothing are left out; so is
    everything where NVML cannot say (not installed, no driver, a container whose process
    ids NVML does not share, a driver that hides per-process numbers)."""
    lib = nvml()
    if lib is None:
        return {}
    found = {}
    for index in range(torch.cuda.device_count()):
        device = handle(index)
        if device is None:
            continue
        try:
            processes = lib.nvmlDeviceGetComputeRunningProcesses(device)
        except lib.NVMLError:
            continue
        used = sum(p.usedGpuMemory or 0 for p in processes if p.pid == pid)
        if used:
            found[index] = int(used)
    return found


def _handles(lib: ModuleType) -> Iterator[Any]:
    """Every NVML device, followed by its MIG instances where MIG is on."""
    for i in range(lib.nvmlDeviceGetCount()):
        device = lib.nvmlDeviceGetHandleByIndex(i)
        yield device
        try:
            if lib.nvmlDeviceGetMigMode(device)[0] != lib.NVML_DEVICE_MIG_ENABLE:
                continue
            count = lib.nvmlDeviceGetMaxMigDeviceCount(device)
        except lib.NVMLError:  # not a MIG-capable GPU
            continue
        for j in range(count):
            try:
                yield lib.nvmlDeviceGetMigDeviceHandleByIndex(device, j)
            except lib.NVMLError:  # an empty MIG slot
                continue


def _normal(uuid: object) -> str:
    """A UUID as CUDA or NVML spells it ("GPU-8b3c...", b"MIG-...", a CUuuid), reduced to
    its lowercase hex digits and dashes."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    for prefix in ("GPU-", "MIG-"):
        text = text.removeprefix(prefix)
    return text.lower()
