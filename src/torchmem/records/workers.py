"""The DataLoader workers of a recorded run: each one's peak RSS, in bytes and seconds.

Made by :mod:`torchmem.events.workers` where a recording measures process RAM
(``torchmem run``, ``torchmem.record()``); part of :class:`~torchmem.records.run.RunRecord`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Worker:
    """One DataLoader worker process seen while the run was recorded."""

    pid: int
    peak_rss_bytes: int
    """Its highest resident set size since it started (the kernel's ``VmHWM``), at the
    last reading before it ended: a rise after that reading is missed. Pages it shares
    with the main process count (those it inherited at fork, batches in shared memory)."""
    first_seen: float
    """Seconds from the start of the recording to the first reading that saw it."""
    last_seen: float
    """Seconds from the start of the recording to the last reading that saw it alive."""

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "peak_rss_bytes": self.peak_rss_bytes,
            "first_seen_s": self.first_seen,
            "last_seen_s": self.last_seen,
        }


@dataclass(frozen=True)
class Workers:
    """The DataLoader workers of a run, read from ``/proc`` every :attr:`interval`."""

    processes: tuple[Worker, ...]
    """In the order they were first seen."""
    interval: float
    """Seconds between two readings: the peaks are sampled."""

    def to_json(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval,
            "exact": False,
            "processes": [worker.to_json() for worker in self.processes],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workers:
        processes = tuple(
            Worker(w["pid"], w["peak_rss_bytes"], w["first_seen_s"], w["last_seen_s"])
            for w in data["processes"]
        )
        return cls(processes, data["interval_s"])
