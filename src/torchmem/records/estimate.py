"""An estimate's record: a step's memory on a device, from a run on fake tensors.

Made by :func:`torchmem.estimate`; read by :mod:`torchmem.render.estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchmem.records.run import DeviceRun, ModulePeak, RunRecord


@dataclass(frozen=True)
class EstimateRecord:
    """The memory a function needs on a device, estimated without that device."""

    device: str
    """The target: ``"cpu"`` (CPU tensors) or ``"cuda"`` (PyTorch's caching allocator)."""
    peak_bytes: int
    """The highest bytes allocated (``torch.cuda.max_memory_allocated()`` on CUDA: blocks
    rounded as the caching allocator rounds them)."""
    reserved_bytes: int
    """CUDA: the caching allocator's highest reserved bytes (whole segments); CPU: the peak."""
    categories: dict[str, int]
    """Bytes of parameters, gradients, optimizer state, buffers, activations and other at the peak
    (:data:`~torchmem.records.run.CATEGORIES`)."""
    modules: tuple[ModulePeak, ...]
    """Each module's highest bytes allocated during its forward calls and backward passes."""
    run: DeviceRun
    """The step on the target, as a recording shows it: the timeline (seconds of the run
    on fake tensors), the lines and the largest allocations alive at the peak."""
    context_bytes: int = 0
    """CUDA: an allowance for the CUDA context (outside the allocator), which
    :meth:`~torchmem.Estimate.fits` adds to the reserved bytes."""
    workspace_bytes: int = 0
    """CUDA: bytes of each cuBLAS workspace (one per thread that multiplies matrices:
    the forward's and the backward's)."""
    expandable_segments: bool = False
    """CUDA: whether the model used expandable segments (``PYTORCH_CUDA_ALLOC_CONF``)."""
    modelled: tuple[str, ...] = ()
    """What the estimate accounts for, one phrase each."""
    not_modelled: tuple[str, ...] = ()
    """What it leaves out, one phrase each."""
    notes: tuple[str, ...] = ()
    """What the run on fake tensors could not do as on the device, one sentence each."""
    seconds: float = 0.0
    """How long the estimate took."""
    function: str = ""
    """The qualified name of the function estimated."""
    world_size: int = 1
    """The ranks estimated (:func:`torchmem.estimate`'s `world_size`)."""
    rank: int = 0
    """The rank this estimate is of: with :attr:`ranks`, the one with the highest peak."""
    ranks: tuple[EstimateRecord, ...] = ()
    """With a `world_size` above 1, each rank's own estimate, by rank; else empty."""

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (docs/json.md): the estimate's own figures, and under
        ``"run"`` the step on fake tensors in the form of a recording's JSON."""
        run = RunRecord({self.device: self.run}, self.modules, self.seconds, notes=self.notes)
        return {
            "function": self.function,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "context_bytes": self.context_bytes,
            "workspace_bytes": self.workspace_bytes,
            "expandable_segments": self.expandable_segments,
            "categories_at_peak": dict(self.categories),
            "modelled": list(self.modelled),
            "not_modelled": list(self.not_modelled),
            "seconds": self.seconds,
            "world_size": self.world_size,
            "rank": self.rank,
            "ranks": [
                {
                    "rank": each.rank,
                    "peak_bytes": each.peak_bytes,
                    "reserved_bytes": each.reserved_bytes,
                    "categories_at_peak": dict(each.categories),
                }
                for each in self.ranks
            ],
            "run": run.to_json(),
        }
