"""The allocator meter: PyTorch's caching allocator on one GPU (CUDA/ROCm, or Intel XPU)."""

from __future__ import annotations

import torch

from torchmem.meters.base import Meter

_COUNTERS = ("current", "allocated", "freed")
_SUFFIXES = tuple(f".{part}" for part in _COUNTERS)


class AllocatorMeter(Meter):
    """Bytes held by PyTorch's caching allocator on one device, this process only.

    ``used()`` is ``memory_allocated`` (bytes in tensors), :meth:`reserved` is
    ``memory_reserved`` (what the allocator holds from the driver, tensors plus cache).
    Peaks come from the allocator's own counters (``memory_stats()``'s ``*.peak``), which
    only reset as a whole: every open window gets them folded in before each
    ``reset_peak_memory_stats``, so nested windows stay exact. Code that calls
    ``reset_peak_memory_stats`` itself while a window is open lowers that window's peak.

    Windows report any ``memory_stats()`` key that has a ``.peak``, named without it;
    the default is ``"allocated_bytes.all"`` (``max_memory_allocated``).
    """

    stats = ("allocated_bytes.all", "reserved_bytes.all")

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = str(device)
        self._index = device.index
        self._backend = getattr(torch, device.type)
        self._backend.init()

    def used(self) -> int:
        return self._backend.memory_allocated(self._index)

    def reserved(self) -> int:
        """Bytes the caching allocator holds on this device (in tensors or cached)."""
        return self._backend.memory_reserved(self._index)

    def counters(self) -> dict[str, int]:
        stats = self._backend.memory_stats(self._index)
        if not stats:  # the allocator has not been used yet
            return {f"{stat}.{part}": 0 for stat in self.stats for part in _COUNTERS}
        return {key: value for key, value in stats.items() if key.endswith(_SUFFIXES)}

    def _peaks(self) -> dict[str, int]:
        peaks = {
            key[: -len(".peak")]: value
            for key, value in self._backend.memory_stats(self._index).items()
            if key.endswith(".peak")
        }
        # Before the allocator's first use memory_stats() is empty.
        return peaks or dict.fromkeys(self.stats, 0)

    def _reset_peaks(self) -> None:
        self._backend.reset_peak_memory_stats(self._index)
