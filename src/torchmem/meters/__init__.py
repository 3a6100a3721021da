"""Meters: the one way torchmem reads memory. See :class:`Meter` and :class:`Window`."""

from __future__ import annotations

import torch

from torchmem.meters.allocator import AllocatorMeter
from torchmem.meters.base import Meter, SampledMeter, Window, parse_device
from torchmem.meters.device import DeviceMeter
from torchmem.meters.mps import MpsMeter
from torchmem.meters.ram import RamMeter
from torchmem.meters.tensor import TensorMeter

__all__ = [
    "AllocatorMeter",
    "DeviceMeter",
    "Meter",
    "MpsMeter",
    "RamMeter",
    "SampledMeter",
    "TensorMeter",
    "Window",
    "device_meter",
    "meter",
]

# One meter per pool, shared by everyone in the process: a pool's peak counter is one
# per process (CUDA's, the kernel's), so its windows must all go through one registry.
_meters: dict[str, Meter] = {}


def meter(device: str | int | torch.device | None = None) -> Meter:
    """The meter for a device, the same object on every call.

    Args:
        device: ``"cpu"`` or ``"meta"`` (tensor meter: exact bytes of tensors on that
            device), ``"cuda"``/``"cuda:1"``/an index (the caching allocator of that
            GPU), ``"xpu[:n]"`` (Intel's allocator), ``"mps"`` (Apple's), ``"ram"`` (this
            process's resident memory). ``None`` means the current CUDA device where
            CUDA is available, else CPU tensors.

    Raises:
        ValueError: naming the device, if it is malformed or not available here.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "ram":
        key = "ram"
    else:
        parsed = parse_device(device)
        if parsed.type in ("cuda", "xpu"):
            parsed = torch.device(parsed.type, _index(parsed, device))
        key = str(parsed)
    if key not in _meters:
        _meters[key] = _make(key)
    return _meters[key]


def device_meter(index: int | None = None) -> DeviceMeter:
    """The whole-GPU meter (all processes) of CUDA device `index` (default: current).

    Raises:
        ValueError: naming the index, if there is no such CUDA device.
    """
    parsed = torch.device("cuda") if index is None else parse_device(index)
    if parsed.type != "cuda":
        raise ValueError(f"invalid GPU {index!r}: expected a CUDA device index")
    parsed = torch.device("cuda", _index(parsed, index))
    key = f"device:{parsed.index}"
    if key not in _meters:
        _meters[key] = DeviceMeter(parsed.index)
    return _meters[key]  # type: ignore[return-value]


def _index(device: torch.device, asked: object) -> int:
    """The index of an accelerator device, checked against what this machine has."""
    backend = getattr(torch, device.type)
    if not backend.is_available():
        raise ValueError(
            f"device {asked!r} is not available: torch.{device.type}.is_available() is False"
        )
    count = backend.device_count()
    index = backend.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"no device {asked!r}: {count} {device.type} device(s) visible")
    return index


def _make(key: str) -> Meter:
    if key == "ram":
        return RamMeter()
    device = torch.device(key)
    if device.type in ("cpu", "meta"):
        return TensorMeter(device)
    if device.type in ("cuda", "xpu"):
        return AllocatorMeter(device)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {key!r} is not available: MPS is not available here")
        return MpsMeter()
    raise ValueError(
        f"no meter for device {key!r}: use 'cpu', 'cuda[:n]', 'xpu[:n]', 'mps', 'meta' or 'ram',"
        f" or TensorMeter({key!r}) to count its tensors"
    )
