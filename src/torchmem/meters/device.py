"""The device meter: a whole GPU, all processes and CUDA contexts together."""

from __future__ import annotations

import torch

from torchmem.meters import nvml
from torchmem.meters.base import SampledMeter


class DeviceMeter(SampledMeter):
    """Used memory of a whole CUDA GPU, every process included (what ``nvidia-smi`` shows).

    Read through NVML when ``nvidia-ml-py`` is installed (the ``nvml`` extra), else
    through ``torch.cuda.mem_get_info``, which creates a CUDA context on the device if
    this process has none there yet. Neither has a peak counter, so window peaks are
    sampled (:attr:`exact` is False); for this process's own tensors use the allocator
    meter, whose peaks are exact.
    """

    stats = ("used",)

    def __init__(self, index: int) -> None:
        super().__init__()
        self.device = f"cuda:{index}"
        self.index = index
        """The torch CUDA device index."""
        self.nvml_handle = nvml.handle(index)
        """The NVML handle of this device, or None where NVML is not used."""

    def info(self) -> tuple[int, int, int]:
        """``(total, free, used)`` bytes of the whole device."""
        if self.nvml_handle is not None:
            return nvml.memory(self.nvml_handle)
        free, total = torch.cuda.mem_get_info(self.index)
        return total, free, total - free

    def used(self) -> int:
        return self.info()[2]
