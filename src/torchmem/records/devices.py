"""Records of device memory: the seeds' ``GPUMemory`` in MB, and the ``devices`` report's
rows in bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class GPUMemory(NamedTuple):
    """Memory of one GPU in whole MB (MiB), all processes together."""

    total: int
    """Total memory, MB."""
    free: int
    """Free memory, MB."""
    used: int
    """Used memory, MB."""


@dataclass(frozen=True)
class GPUInfo:
    """One GPU as the ``devices`` report shows it. Sizes in bytes."""

    index: int
    """Torch's CUDA device index."""
    name: str
    """The device's name, e.g. ``"NVIDIA H100 80GB HBM3"``."""
    total: int
    """Total memory of the device."""
    used: int
    """Used memory of the whole device, all processes."""
    free: int
    """Free memory of the whole device."""
    allocated: int
    """Bytes in this process's tensors (``torch.cuda.memory_allocated``)."""
    reserved: int
    """Bytes this process's caching allocator holds (``torch.cuda.memory_reserved``)."""
    source: str
    """Where total, used and free come from: ``"nvml"`` or ``"cuda"`` (``mem_get_info``)."""


@dataclass(frozen=True)
class RAMInfo:
    """Host memory. Sizes in bytes."""

    process: int
    """Resident memory of this process (RSS)."""
    total: int
    """Total memory of the machine."""
    available: int
    """Memory available to new processes without swapping."""


@dataclass(frozen=True)
class CPUInfo:
    """How this process counts CPU tensor memory."""

    backend: str
    """``"allocator"`` (torchmem's counting CPU allocator) or ``"dispatch"`` (the fallback)."""
    used: int
    """Bytes of live CPU tensor storages now."""
    detail: str
    """The counting allocator's library file, or why it is not used."""
