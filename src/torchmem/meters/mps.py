"""The MPS meter: PyTorch's allocator on Apple GPUs."""

from __future__ import annotations

import torch

from torchmem.meters.base import SampledMeter


class MpsMeter(SampledMeter):
    """Bytes in tensors on the Apple GPU (``torch.mps.current_allocated_memory``).

    The MPS backend has no peak counter, so window peaks are sampled (:attr:`exact` is
    False). For exact peaks of MPS tensors use ``TensorMeter("mps")``.
    """

    stats = ("allocated_bytes.all",)

    def __init__(self) -> None:
        super().__init__()
        self.device = "mps:0"

    def used(self) -> int:
        return torch.mps.current_allocated_memory()
