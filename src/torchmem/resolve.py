"""Which device a user means: the one place where ``None``, ``"cuda"``, ``1`` or
``torch.device("cuda", 1)`` become a concrete device of this machine.

Every torchmem feature takes its device through :func:`resolve_device`, so they all
default alike (the current GPU where CUDA is available, else CPU tensors) and refuse a
device this machine does not have with the same clear error.
"""

from __future__ import annotations

import operator
from typing import TypeAlias

import torch

DeviceLike: TypeAlias = str | int | torch.device
"""A device as PyTorch users write it: ``"cuda:1"``, ``"cpu"``, ``1`` (CUDA device 1),
``torch.device("meta")``."""

RAM = "ram"
"""What torchmem measures besides PyTorch's devices: the process's resident memory."""

_INDEXED = ("cuda", "xpu")
"""Device types whose backend module (``torch.cuda``, ``torch.xpu``) says which devices
exist and which one is current."""


def parse_device(device: DeviceLike) -> torch.device:
    """`device` as a ``torch.device``, its spelling checked but nothing about this machine.

    A whole number (an ``int``, or anything with ``__index__`` such as a NumPy integer) is a
    CUDA device index, as in ``torch.cuda``.

    Raises:
        ValueError: naming the value, if PyTorch does not know it as a device.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {device!r}: {exc}") from None
    if not isinstance(device, bool):
        try:
            index = operator.index(device)
        except TypeError:
            pass
        else:
            if index < 0:
                raise ValueError(f"invalid device {device!r}: a device index cannot be negative")
            return torch.device("cuda", index)
    raise ValueError(
        f"invalid device {device!r}: expected a string like 'cuda:0', an index or a torch.device"
    )


def default_device() -> torch.device:
    """Every feature's default device, without its index: ``cuda`` where CUDA is
    available, else ``cpu`` (CPU tensors). Does not initialise CUDA; see
    :func:`resolve_device` for the index."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: DeviceLike | None = None) -> torch.device:
    """The device `device` means on this machine, with its index where it has one.

    ``None`` is every feature's default (:func:`default_device`): the current CUDA device
    where CUDA is available, else ``cpu`` (CPU tensors). An index-less ``"cuda"`` or
    ``"xpu"`` is that backend's current device, and an index must be one of the devices
    the backend shows (under ``CUDA_VISIBLE_DEVICES``, the visible ones). ``"mps"`` is
    ``mps:0`` where MPS is available. ``"cpu:0"`` is ``"cpu"``, as PyTorch's tensors
    report it. ``"meta"`` and other device types come back as parsed.

    Raises:
        ValueError: naming the value, if it is not a device, its backend is not available
            here, or there is no device with that index.
    """
    parsed = default_device() if device is None else parse_device(device)
    if parsed.type in _INDEXED:
        backend = getattr(torch, parsed.type)
        if not backend.is_available():
            raise ValueError(
                f"device {device!r} is not available: torch.{parsed.type}.is_available() is False"
            )
        count = backend.device_count()
        index = backend.current_device() if parsed.index is None else parsed.index
        if not 0 <= index < count:
            raise ValueError(
                f"no device {device!r}: {count} {parsed.type.upper()} device(s) visible"
            )
        return torch.device(parsed.type, index)
    if parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {device!r} is not available: MPS is not available here")
        if parsed.index not in (None, 0):
            raise ValueError(f"no device {device!r}: there is one MPS device, mps:0")
        return torch.device("mps", 0)
    if parsed.type == "cpu":
        # PyTorch puts a tensor made on cpu:0 on cpu, and has no other CPU device.
        if parsed.index not in (None, 0):
            raise ValueError(f"no device {device!r}: there is one CPU device, cpu (or cpu:0)")
        return torch.device("cpu")
    return parsed


def measured(device: DeviceLike | None = None) -> str:
    """What torchmem measures for `device`, as every meter and record names it:
    :data:`RAM` (``"ram"``) for the process's resident memory, else
    :func:`resolve_device`'s device as a string (``"cuda:0"``, ``"cpu"``).

    Raises:
        ValueError: naming the value, as :func:`resolve_device` does.
    """
    return RAM if device == RAM else str(resolve_device(device))
