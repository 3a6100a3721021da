"""A ``pynvml`` module that lists every physical device in PCI order, with MIG instances,
whatever CUDA shows (:class:`NvmlStandIn`)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from standins.gpu import StandInGpu
from torchmem.meters import nvml as torchmem_nvml

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
