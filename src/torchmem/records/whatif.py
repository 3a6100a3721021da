"""What other caching-allocator settings would have reserved for the same run, and how
fragmented the memory was at its peak: made by :func:`torchmem.estimator.whatif.what_if`
from an allocator history (a memory snapshot's trace), read by the snapshot renderers.
:meth:`WhatIf.to_json` is the documented JSON contract (``docs/json.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """The run's allocations and frees replayed through the model of the caching allocator
    under one setting."""

    settings: str
    """As ``PYTORCH_CUDA_ALLOC_CONF`` writes them; ``""``: PyTorch's defaults."""
    reserved_peak_bytes: int
    """The highest reserved bytes (``max_memory_reserved()``) from the trace's start on."""
    allocated_peak_bytes: int
    """The highest allocated bytes, in blocks (``max_memory_allocated()``)."""
    reserved_at_peak_bytes: int
    """Reserved bytes when the allocated bytes first reached their peak."""
    largest_free_at_peak_bytes: int
    """The largest free (cached) block then: the largest request served without
    reserving more."""
    out_of_memory: bool = False
    """The model ran out of the allowed memory (the peaks are those up to then)."""

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated at the allocated peak: :attr:`reserved_at_peak_bytes`
        minus :attr:`allocated_peak_bytes`."""
        return self.reserved_at_peak_bytes - self.allocated_peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_at_peak_bytes": self.reserved_at_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "largest_free_at_peak_bytes": self.largest_free_at_peak_bytes,
            "out_of_memory": self.out_of_memory,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        """The outcome :meth:`to_json` wrote."""
        return cls(
            data["settings"],
            int(data["reserved_peak_bytes"]),
            int(data["allocated_peak_bytes"]),
            int(data["reserved_at_peak_bytes"]),
            int(data["largest_free_at_peak_bytes"]),
            bool(data["out_of_memory"]),
        )


@dataclass(frozen=True)
class WhatIf:
    """One device's allocator history replayed under its own settings and others."""

    device: int
    """The device index of the history."""
    settings: str | None
    """The settings it was recorded under (``""``: PyTorch's defaults); None where the
    history does not record ones the model follows."""
    allocations: int
    """Allocations in the trace."""
    reserved_peak_bytes: int
    """The real highest reserved bytes over the trace: the segments at its start plus its
    segment actions."""
    allocated_peak_bytes: int
    """The real highest allocated bytes over the trace, in blocks (0 where the history is
    not replayed: see :attr:`note`)."""
    today: Outcome | None
    """The replay under :attr:`settings`; None where they are not followed."""
    alternatives: tuple[Outcome, ...]
    """The replay under each other setting asked for; empty unless :attr:`reproduced`."""
    kept: bool = False
    """How the replays start: False, the blocks in use at the trace's start are allocated
    again under each setting (as if the whole process had run under it); True, where that
    does not reproduce today's peaks (segments cached before the trace), the segments and
    blocks of the start are kept as they were (as if the setting changed at the trace's
    start)."""
    allowed_bytes: int | None = None
    """The memory the process was allowed (``set_per_process_memory_fraction``) in the
    replays; None: no fraction set, no limit."""
    note: str = ""
    """Why there is no what-if (the model does not reproduce this history), else empty."""

    @property
    def reproduced(self) -> bool:
        """Whether the replay under today's settings reserves and allocates exactly what the
        real allocator did: only then are the alternatives given."""
        return (
            self.today is not None
            and self.today.reserved_peak_bytes == self.reserved_peak_bytes
            and self.today.allocated_peak_bytes == self.allocated_peak_bytes
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "settings": self.settings,
            "allocations": self.allocations,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reproduced": self.reproduced,
            "kept": self.kept,
            "allowed_bytes": self.allowed_bytes,
            "note": self.note,
            "today": None if self.today is None else self.today.to_json(),
            "alternatives": [a.to_json() for a in self.alternatives],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WhatIf:
        """The what-if :meth:`to_json` wrote (a report saved as JSON, read back)."""
        today = data["today"]
        return cls(
            int(data["device"]),
            data["settings"],
            int(data["allocations"]),
            int(data["reserved_peak_bytes"]),
            int(data["allocated_peak_bytes"]),
            None if today is None else Outcome.from_json(today),
            tuple(Outcome.from_json(a) for a in data["alternatives"]),
            bool(data["kept"]),
            data["allowed_bytes"],
            data["note"],
        )
