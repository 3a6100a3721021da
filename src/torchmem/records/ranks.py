"""The records of a multi-process run: one :class:`~torchmem.records.run.RunRecord` per
rank, gathered through ``torch.distributed``, and how unevenly the ranks used memory.

Made by :mod:`torchmem.ranks` (``torchmem run`` under ``torchrun``, :func:`torchmem.gather`);
read by :mod:`torchmem.render.ranks`. :meth:`RanksRecord.to_json` is the documented JSON
contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchmem.records.run import RunRecord


@dataclass(frozen=True)
class RankRun:
    """One rank's report."""

    rank: int
    """Its global rank."""
    host: str
    """The name of the machine it ran on (``socket.gethostname()``)."""
    report: RunRecord
    """What it recorded, as in a single process."""
    error: str | None = None
    """The last line of its script's traceback (``"ValueError: boom"``) where the script
    raised; the whole traceback is in that rank's own output."""
    gpu_process_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes its process held on each GPU (``"cuda:0"``, ...) when it sent its report, as
    NVML lists the GPU's processes: the CUDA context, what the caching allocator
    reserved, NCCL's buffers, other libraries'. Empty where NVML cannot say."""


@dataclass(frozen=True)
class Imbalance:
    """How unevenly the ranks peaked on their main devices (:attr:`RunRecord.main_device`)."""

    kind: str
    """The kind of device compared: ``"cuda"``, ``"cpu"``, ..."""
    highest_rank: int
    """The rank with the highest peak."""
    highest_bytes: int
    """Its peak, in bytes."""
    lowest_rank: int
    """The rank with the lowest peak."""
    lowest_bytes: int
    """Its peak, in bytes."""
    category: str | None
    """The category (parameters, gradients, ...) whose bytes at the peak differ most
    between ranks; None where no rank's device has an event log."""
    category_high_rank: int | None = None
    """The rank with the most bytes of :attr:`category` at its peak."""
    category_high_bytes: int = 0
    """Those bytes."""
    category_low_rank: int | None = None
    """The rank with the fewest bytes of :attr:`category` at its peak."""
    category_low_bytes: int = 0
    """Those bytes."""

    @property
    def ratio(self) -> float:
        """The highest peak over the lowest; ``inf`` where the lowest is 0 bytes."""
        if self.lowest_bytes <= 0:
            return float("inf") if self.highest_bytes > 0 else 1.0
        return self.highest_bytes / self.lowest_bytes

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "kind": self.kind,
            "ratio": ratio if ratio != float("inf") else None,
            "highest_rank": self.highest_rank,
            "highest_bytes": self.highest_bytes,
            "lowest_rank": self.lowest_rank,
            "lowest_bytes": self.lowest_bytes,
            "category": self.category,
            "category_high_rank": self.category_high_rank,
            "category_high_bytes": self.category_high_bytes,
            "category_low_rank": self.category_low_rank,
            "category_low_bytes": self.category_low_bytes,
        }


@dataclass(frozen=True)
class Elsewhere:
    """Memory a rank's process held on a GPU that is not its own (not its main device):
    a CUDA context, or tensors, made there by a missing ``torch.cuda.set_device``, or a
    ``torch.load`` without ``map_location``."""

    rank: int
    device: str
    """The other GPU, ``"cuda:0"``, ..."""
    bytes: int
    """What NVML says the process held there."""


@dataclass(frozen=True)
class RanksRecord:
    """Every rank's report, in rank order."""

    ranks: tuple[RankRun, ...]
    """The reports that arrived, by rank."""
    world_size: int
    """How many ranks the job has."""
    missing: tuple[int, ...] = ()
    """Ranks whose report never arrived (the process died before it could send one)."""
    imbalance: Imbalance | None = None
    """Across the ranks' main devices; None with fewer than two reports."""
    elsewhere: tuple[Elsewhere, ...] = ()
    """Memory ranks held on GPUs that are not theirs, by rank."""

    @property
    def exit_code(self) -> int:
        """0 where every rank's script exited 0; else the first non-zero exit code (1
        for a missing rank)."""
        for run in self.ranks:
            if run.report.exit_code:
                return run.report.exit_code
        return 1 if self.missing else 0

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (``torchmem run --json`` on rank 0): each rank is the
        single-process report with ``rank``, ``host`` and ``error`` added."""
        return {
            "world_size": self.world_size,
            "exit_code": self.exit_code,
            "ranks": [
                {
                    "rank": run.rank,
                    "host": run.host,
                    "error": run.error,
                    "gpu_process_bytes": run.gpu_process_bytes,
                    **run.report.to_json(),
                }
                for run in self.ranks
            ],
            "missing_ranks": list(self.missing),
            "imbalance": None if self.imbalance is None else self.imbalance.to_json(),
            "elsewhere": [
                {"rank": e.rank, "device": e.device, "bytes": e.bytes} for e in self.elsewhere
            ],
        }
