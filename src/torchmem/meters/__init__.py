"""Meters: the one way torchmem reads memory. See :class:`Meter` and :class:`Window`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from torchmem.meters import allocator, nvml
from torchmem.meters.allocator import AllocatorMeter
from torchmem.meters.base import Meter, SampledMeter, Window
from torchmem.meters.cpu import CpuAllocatorMeter, CpuDispatchMeter, cpu_meter
from torchmem.meters.device import DeviceMeter
from torchmem.meters.mps import MpsMeter
from torchmem.meters.ram import RamMeter
from torchmem.meters.tensor import TensorMeter
from torchmem.resolve import DeviceLike, measured, resolve_device

__all__ = [
    "AllocatorMeter",
    "CpuAllocatorMeter",
    "CpuDispatchMeter",
    "DeviceMeter",
    "Meter",
    "MpsMeter",
    "RamMeter",
    "SampledMeter",
    "TensorMeter",
    "Window",
    "device_meter",
    "isolated",
    "meter",
]

# One meter per pool, shared by everyone in the process: a pool's peak counter is one
# per process (CUDA's, the kernel's), so its windows must all go through one registry.
_meters: dict[str, Meter] = {}
_meters_lock = threading.Lock()
"""Held while a meter is made, so that threads asking for it first, at once, get one."""


def meter(device: DeviceLike | None = None) -> Meter:
    """The meter for a device, the same object on every call, in every thread.

    Args:
        device: ``"cpu"`` (every CPU tensor storage of the process, see
            :mod:`torchmem.meters.cpu`), ``"meta"`` (tensor meter: exact bytes of tensors
            made there while a window is open), ``"cuda"``/``"cuda:1"``/an index (the
            caching allocator of that GPU), ``"xpu[:n]"`` (Intel's allocator), ``"mps"``
            (Apple's), ``"ram"`` (this process's resident memory). ``None`` means the
            current CUDA device where CUDA is available, else CPU tensors (see
            :func:`torchmem.resolve_device`).

    Raises:
        ValueError: naming the device, if it is malformed or not available here.
    """
    key = measured(device)
    found = _meters.get(key)
    if found is None:
        with _meters_lock:
            found = _meters.get(key)
            if found is None:
                found = _meters[key] = _make(key)
    return found


def device_meter(index: int | None = None) -> DeviceMeter:
    """The whole-GPU meter (all processes) of CUDA device `index` (default: current).

    Raises:
        ValueError: naming the index, if there is no such CUDA device.
    """
    try:
        device = resolve_device("cuda" if index is None else index)
    except ValueError as exc:
        raise ValueError(f"invalid GPU {index!r}: {exc}") from None
    if device.type != "cuda":
        raise ValueError(f"invalid GPU {index!r}: expected a CUDA device index")
    key = f"device:{device.index}"
    with _meters_lock:
        meter = _meters.get(key)
        if not isinstance(meter, DeviceMeter):
            meter = _meters[key] = DeviceMeter(device.index)
    return meter


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """For tests: inside the block, :func:`meter` and :func:`device_meter` make new meters
    (over the CUDA or NVML stand-ins the test installed, on the CPU backend
    ``$TORCHMEM_CPU_METER`` asks for), NVML is loaded anew and no window opened before is
    watched; after it, the process's own meters are back. Windows opened inside must be
    closed inside."""
    global _meters
    with _meters_lock:
        kept, _meters = _meters, {}
    nvml.nvml.cache_clear()
    try:
        with allocator.isolated():
            yield
    finally:
        nvml.nvml.cache_clear()
        with _meters_lock:
            _meters = kept


def _make(key: str) -> Meter:
    if key == "ram":
        return RamMeter()
    device = torch.device(key)
    if device.type == "cpu":
        return cpu_meter()
    if device.type == "meta":
        return TensorMeter(device)
    if device.type in ("cuda", "xpu"):
        return AllocatorMeter(device)
    if device.type == "mps":
        return MpsMeter()
    raise ValueError(
        f"no meter for device {key!r}: use 'cpu', 'cuda[:n]', 'xpu[:n]', 'mps', 'meta' or 'ram',"
        f" or TensorMeter({key!r}) to count its tensors"
    )
