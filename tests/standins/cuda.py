"""Stand-ins for the ``torch.cuda`` functions torchmem calls (:class:`CudaStandIn`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from standins.gpu import StandInGpu, cuda_devices

_real_empty = torch.empty


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
