"""A memory snapshot's records: what PyTorch's caching allocator held, per device, in bytes
and seconds (entry numbers where a trace has no times).

Made by :mod:`torchmem.snapshot` (``torchmem snapshot``, ``torchmem.load_snapshot``); read
by the renderers in :mod:`torchmem.render.snapshot`. :meth:`SnapshotRecord.to_json` and
:meth:`SnapshotDiffRecord.to_json` are the documented JSON contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torchmem.records.run import Site
from torchmem.records.whatif import WhatIf

STATES = ("active_allocated", "active_pending_free", "inactive")
"""A block's states in a snapshot: in use, freed but still used by a stream, free."""


DEVICE_NAMES = "torchmem_device_names"
"""The key of a snapshot torchmem saved that names each device index (``["cuda:0",
"cpu"]``); PyTorch's readers ignore it. Without it, index N is ``cuda:N``."""


class Block(NamedTuple):  # a named tuple: made for each of a snapshot's thousands of blocks
    """One block of a segment."""

    address: int
    bytes: int
    state: str
    """One of :data:`STATES` (or what the snapshot says, where PyTorch adds one)."""


@dataclass(frozen=True)
class Segment:
    """One segment: memory the caching allocator reserved from the device (a cudaMalloc)."""

    device: int
    address: int
    total_bytes: int
    """Bytes reserved."""
    allocated_bytes: int
    """Bytes of its ``active_allocated`` blocks."""
    active_bytes: int
    """Bytes of its ``active_allocated`` and ``active_pending_free`` blocks."""
    largest_free_bytes: int
    """The largest ``inactive`` block: the largest request it could serve now."""
    stream: int
    segment_type: str | None
    """``"large"`` or ``"small"`` (the allocator's two pools); None where the snapshot
    does not say."""
    blocks: tuple[Block, ...]
    """In address order."""

    @property
    def free_bytes(self) -> int:
        """Bytes inside it that no block is using: :attr:`total_bytes` minus
        :attr:`active_bytes`."""
        return self.total_bytes - self.active_bytes


@dataclass(frozen=True)
class OOM:
    """An out-of-memory event of the trace: a request the allocator could not serve."""

    requested_bytes: int
    time: float
    """Seconds from the first entry of the device's trace (0.0 where it has no times)."""
    device_free_bytes: int | None
    """What the device had free then, as the allocator saw it (None where not recorded)."""
    largest_free_bytes: int
    """The largest free block in the snapshot's segments on the device."""
    entry: int = 0
    """Its entry in the device's trace, counted from 1."""


@dataclass(frozen=True)
class DeviceSnapshot:
    """What one device held when the snapshot was taken, and what its trace shows."""

    device: int
    """The device index the snapshot gives."""
    name: str
    """The device, as torchmem names devices: ``"cuda:N"`` for index N, ``"cpu"`` for the
    CPU of a recording torchmem saved (see :meth:`Recording.save_snapshot`)."""
    allocated_bytes: int
    """Bytes of ``active_allocated`` blocks."""
    active_bytes: int
    """Bytes of ``active_allocated`` and ``active_pending_free`` blocks."""
    reserved_bytes: int
    """Bytes of all segments."""
    segments: tuple[Segment, ...]
    """Largest first."""
    sites: tuple[Site, ...]
    """Allocation sites of the ``active_allocated`` blocks, largest first."""
    peak_bytes: int | None = None
    """The highest active bytes over the trace, in blocks (as ``max_memory_allocated()``
    counts, not the requests); None where the snapshot has no trace."""
    peak_time: float | None = None
    """Seconds from the first entry of the trace to the peak; None where the trace has no
    times (see :attr:`peak_entry`)."""
    duration: float = 0.0
    """Seconds from the first entry of the trace to its last (0.0 without times)."""
    timeline: tuple[tuple[float, int], ...] = ()
    """``(end of interval, highest active bytes during the interval)``: exact peaks over
    consecutive intervals of the trace, in seconds, or where the trace has no times in
    entry numbers (whole numbers, up to :attr:`entries`)."""
    sites_at_peak: tuple[Site, ...] = ()
    """Allocation sites alive at the peak, largest first."""
    oom: OOM | None = None
    """The trace's last out-of-memory event, if it has one."""
    entries: int = 0
    """Entries in the device's trace."""
    peak_entry: int | None = None
    """The entry of the trace after which the peak held, counted from 1 (0: its start);
    None where the snapshot has no trace."""
    timed: bool = True
    """Whether the trace's entries have times (``time_us``); where not, the peak is placed
    by :attr:`peak_entry` and the timeline is over entry numbers."""
    what_if: WhatIf | None = None
    """The trace replayed under other allocator settings, and the fragmentation at the
    peak (``load_snapshot(path, what_if=True)``); None where not asked for, the device
    has no trace, or it is not a GPU (the CPU of a recording torchmem saved)."""


@dataclass(frozen=True)
class SnapshotRecord:
    """A memory snapshot (``torch.cuda.memory._snapshot()``), analysed."""

    devices: dict[int, DeviceSnapshot]
    """Per device index, in increasing order."""
    source: str = ""
    """The file it was read from; empty for one made from a dict in memory."""

    @property
    def allocated_bytes(self) -> int:
        """Bytes of ``active_allocated`` blocks, all devices."""
        return sum(d.allocated_bytes for d in self.devices.values())

    @property
    def active_bytes(self) -> int:
        """Bytes of ``active_allocated`` and ``active_pending_free`` blocks, all devices."""
        return sum(d.active_bytes for d in self.devices.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes of all segments, all devices."""
        return sum(d.reserved_bytes for d in self.devices.values())

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (``torchmem snapshot --json``): bytes are ints, times
        seconds, device indices strings (JSON's keys). Where a device's trace has no times
        (``"timed": false``), ``peak_time_s`` and ``duration_s`` are null, ``peak_entry``
        and ``entries`` place the peak, and the timeline is over entry numbers."""
        return {
            "source": self.source,
            "allocated_bytes": self.allocated_bytes,
            "active_bytes": self.active_bytes,
            "reserved_bytes": self.reserved_bytes,
            "devices": {str(index): _device_json(d) for index, d in self.devices.items()},
        }


@dataclass(frozen=True)
class SiteChange:
    """An allocation site whose live bytes differ between two snapshots."""

    file: str
    line: int
    function: str
    before_bytes: int
    after_bytes: int

    @property
    def change_bytes(self) -> int:
        """:attr:`after_bytes` minus :attr:`before_bytes`."""
        return self.after_bytes - self.before_bytes


@dataclass(frozen=True)
class SnapshotDiffRecord:
    """How a later snapshot differs from an earlier one, all devices together."""

    before: str
    """The earlier snapshot's file (empty where it came from memory)."""
    after: str
    totals: dict[str, tuple[int, int]]
    """``"allocated"``, ``"active"``, ``"reserved"`` -> (bytes before, bytes after)."""
    sites: tuple[SiteChange, ...]
    """Sites of ``active_allocated`` blocks whose bytes changed, largest change (grown or
    shrunk) first."""

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (``torchmem snapshot diff --json``)."""
        return {
            "before": self.before,
            "after": self.after,
            "totals": {
                name: {"before_bytes": b, "after_bytes": a, "change_bytes": a - b}
                for name, (b, a) in self.totals.items()
            },
            "sites": [
                {
                    "file": s.file,
                    "line": s.line,
                    "function": s.function,
                    "before_bytes": s.before_bytes,
                    "after_bytes": s.after_bytes,
                    "change_bytes": s.change_bytes,
                }
                for s in self.sites
            ],
        }


def _device_json(device: DeviceSnapshot) -> dict[str, Any]:
    oom = device.oom
    return {
        "name": device.name,
        "allocated_bytes": device.allocated_bytes,
        "active_bytes": device.active_bytes,
        "reserved_bytes": device.reserved_bytes,
        "peak_bytes": device.peak_bytes,
        "peak_time_s": device.peak_time,
        "peak_entry": device.peak_entry,
        "entries": device.entries,
        "timed": device.timed,
        "duration_s": device.duration if device.timed else None,
        "sites": [s.to_json() for s in device.sites],
        "sites_at_peak": [s.to_json() for s in device.sites_at_peak],
        "segments": [
            {
                "address": s.address,
                "total_bytes": s.total_bytes,
                "allocated_bytes": s.allocated_bytes,
                "active_bytes": s.active_bytes,
                "free_bytes": s.free_bytes,
                "largest_free_bytes": s.largest_free_bytes,
                "stream": s.stream,
                "segment_type": s.segment_type,
                "blocks": [[b.address, b.bytes, b.state] for b in s.blocks],
            }
            for s in device.segments
        ],
        "oom": None
        if oom is None
        else {
            "requested_bytes": oom.requested_bytes,
            "time_s": oom.time,
            "device_free_bytes": oom.device_free_bytes,
            "largest_free_bytes": oom.largest_free_bytes,
            "entry": oom.entry,
        },
        "timeline": [[t, b] for t, b in device.timeline],
        "what_if": None if device.what_if is None else device.what_if.to_json(),
    }
