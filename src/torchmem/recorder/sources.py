"""Where a recording's numbers come from, per device.

- CPU tensors: the counting CPU allocator's event log (every allocation and free, with
  the allocating line of the user's code and its stack), see :mod:`torchmem.meters.native`.
- CUDA: PyTorch's own allocator history (``torch.cuda.memory._record_memory_history``),
  which records the Python stack of each allocation inside the caching allocator, at a
  lower cost than anything done from outside it.
- Process RAM, and CPU tensors where the counting allocator is not available: a peak
  window lapped by a thread, an exact peak per interval but no event log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch

from torchmem.meters import Meter, Window, meter
from torchmem.meters.cpu import CpuAllocatorMeter, live_storages
from torchmem.meters.native import NO_FRAME_SITE, NO_PYTHON_SITE
from torchmem.recorder import history
from torchmem.records.caching import KINDS, trace_blocks
from torchmem.records.frames import (
    BACKWARD,
    ENGINE,
    SiteKey,
    code_name,
    kind,
    own_file,
    stack_site,
)

NO_SITE = -1
"""A site index for an allocation whose site was not recorded."""
INTERVAL = 0.02
"""Seconds between two laps of a lapped meter, at first."""
MAX_POINTS = 2000
"""A lapped timeline keeps at most this many intervals: past it, neighbours merge."""
CUDA_ENTRIES = 1_000_000
"""How many allocator actions PyTorch's CUDA history keeps (its ring buffer)."""


@dataclass
class Log:
    """Every allocation and free on one device during a recording."""

    device: str
    base: int
    """Bytes in use when the recording started."""
    start: int
    """``time.monotonic_ns()`` at the start."""
    events: torch.Tensor
    """int64, one row per event: time (``time.monotonic_ns()``), address, bytes (negative:
    a free), site index (negative: none), index of the matching free or allocation (-1:
    none; a free of memory allocated before the recording)."""
    sites: dict[int, SiteKey]
    """Site index -> (file, line, function), carrying the Python stack first seen there
    (:mod:`torchmem.records.frames`); :data:`~torchmem.records.frames.BACKWARD` for
    allocations autograd's engine made. Index :data:`NO_PYTHON_SITE`: no Python frame (a thread
    Python does not know: intra-op workers)."""
    baseline: dict[int, int] = field(default_factory=dict)
    """Address -> bytes of the storages Python could see when the recording started."""
    reserved_peak: int | None = None
    """CUDA: the caching allocator's highest reserved bytes."""


class CpuLog:
    """The counting CPU allocator's event log. :attr:`available` is False on the
    fallback meter, which keeps no log."""

    device = "cpu"

    def __init__(self, sites: bool) -> None:
        cpu = meter("cpu")
        self.meter = cpu
        self.available = isinstance(cpu, CpuAllocatorMeter)
        self.records_sites = isinstance(cpu, CpuAllocatorMeter) and cpu.library.records_sites
        self.sites = sites
        self._base = 0
        self._start = 0
        self._baseline: dict[int, int] = {}
        self._first = 0

    def start(self) -> None:
        assert isinstance(self.meter, CpuAllocatorMeter)
        self._baseline = {s.data_ptr(): s.nbytes() for s in live_storages()}
        library = self.meter.library
        self._first = library.record_start(self.sites and library.records_sites)
        self._base = self.meter.used()
        self._start = time.monotonic_ns()

    def stop(self) -> Log:
        assert isinstance(self.meter, CpuAllocatorMeter)
        library = self.meter.library
        events = library.record_stop(self._first)
        sites = {}
        for index in torch.unique(events[:, 3]).tolist() if len(events) else []:
            if index >= 0:
                found = library.record_site(index)
                if found is not None:
                    sites[index] = _site(*found)
        events[:, 3][events[:, 3] == NO_FRAME_SITE] = NO_PYTHON_SITE
        library.record_clear()
        return Log("cpu", self._base, self._start, events, sites, self._baseline)


def _site(code: CodeType, line: int, stack: tuple[tuple[CodeType, int], ...]) -> SiteKey:
    """A site of the CPU log: its frame, :data:`BACKWARD` where that is autograd engine's
    entry point; torchmem's own frames are left out of its stack."""
    frames = tuple((c.co_filename, n, code_name(c)) for c, n in stack)
    kept = tuple(f for f in frames if not own_file(f[0]))
    if kind(code.co_filename, code.co_name) == ENGINE:
        return SiteKey((BACKWARD, 0, ""), kept)
    return SiteKey((code.co_filename, line, code_name(code)), kept)


class CudaLog:
    """PyTorch's allocator history of some GPUs (one history serves them all), turned
    into one :class:`Log` per GPU."""

    def __init__(self, indices: list[int], sites: bool) -> None:
        self.indices = indices
        self.meters = [meter(torch.device("cuda", i)) for i in indices]
        self.sites = sites
        self._windows: list[Window] = []
        self._bases: list[int] = []
        self._start = 0
        self._wall = 0
        self.history: dict[str, Any] | None = None
        """PyTorch's allocator history at the stop (``_snapshot()``'s dictionary), kept
        for :meth:`Recording.save_snapshot`."""
        self.notes: list[str] = []
        """What the history could not tell, in sentences for the report."""
        self._lease: history.HistoryLease | None = None

    def start(self) -> None:
        self._windows = [m.window() for m in self.meters]  # for the reserved peak
        self._bases = [m.used() for m in self.meters]
        self._start, self._wall = time.monotonic_ns(), time.time_ns()
        self._lease = history.acquire(self.sites, CUDA_ENTRIES)

    def stop(self) -> list[Log]:
        assert self._lease is not None
        snapshot = self._lease.release()
        self.history = snapshot
        self.notes = self._lease.notes
        traces = snapshot.get("device_traces", [])
        for index, gap in self._lease.lost.items():
            if index in self.indices:
                self.notes.append(
                    f"PyTorch's CUDA memory history kept only its last"
                    f" {len(traces[index]):,} actions on cuda:{index}: the first {gap:.2f}s"
                    " of the recording are missing from it, so its peak and sites there may"
                    " be low."
                )
        logs = []
        for index, window, base in zip(self.indices, self._windows, self._bases, strict=True):
            window.close()
            trace = traces[index] if index < len(traces) else []
            own = [s for s in snapshot.get("segments", []) if s.get("device") == index]
            expandable = any(s.get("is_expandable") for s in own)
            events, sites = cuda_events(trace, self._start, self._wall, own, expandable)
            reserved = window.peak("reserved_bytes.all")
            logs.append(Log(f"cuda:{index}", base, self._start, events, sites, {}, reserved))
        return logs


def cuda_events(
    trace: list[dict[str, Any]],
    start: int,
    wall: int,
    segments: Sequence[dict[str, Any]] = (),
    expandable: bool = False,
) -> tuple[torch.Tensor, dict[int, SiteKey]]:
    """A CUDA allocator history's trace (``_snapshot()["device_traces"][i]``) as the rows
    of :attr:`Log.events`, and its sites (:func:`~torchmem.records.frames.stack_site` of
    each allocation's frames). Entries before `wall` (``time.time_ns()`` when the recording
    started, `start` on the monotonic clock) are left out; an allocation counts from
    ``alloc``, a free from ``free_completed`` (when ``memory_allocated`` drops).

    The trace holds requested bytes; each allocation counts its block's bytes, as
    ``memory_allocated()`` does, told from the addresses and the device's `segments` at
    the end (``_snapshot()["segments"]`` of this device) by
    :func:`~torchmem.records.caching.trace_blocks`."""
    kept = [e for e in trace if e.get("action") in KINDS]
    blocks = trace_blocks(
        [(s["address"], s["total_size"]) for s in segments],
        [
            (b["address"], b["size"])
            for s in segments
            for b in s["blocks"]
            if b["state"] in ("active_allocated", "active_pending_free")
        ],
        [(KINDS[e["action"]], int(e["addr"]), int(e["size"]), 0, 0) for e in kept],
        expandable,
    )
    rows: list[list[int]] = []
    sites: dict[tuple[str, int, str], int] = {}
    keys: dict[int, SiteKey] = {}
    picked: dict[int, int] = {}  # id() of a frames list, which the trace holds meanwhile
    live: dict[int, int] = {}
    for entry, size in zip(kept, blocks, strict=True):
        action = entry["action"]
        if action not in ("alloc", "free_completed"):
            continue
        when = int(entry.get("time_us", 0)) * 1000
        if when and when < wall:
            continue
        at = start + (when - wall if when else 0)
        address = int(entry["addr"])
        if action == "alloc":
            frames = entry.get("frames") or []
            site = picked.get(id(frames), NO_SITE)
            if frames and site == NO_SITE:
                listed = [(f["filename"], int(f["line"]), f["name"]) for f in frames]
                key = SiteKey(*stack_site(listed))
                site = picked[id(frames)] = sites.setdefault(key, len(sites))
                keys.setdefault(site, key)
            live[address] = len(rows)
            rows.append([at, address, size, site, -1])
        else:
            other = live.pop(address, -1)
            if other >= 0:
                rows[other][4] = len(rows)
            rows.append([at, address, -size, NO_SITE, other])
    events = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
    return events, keys


class Laps:
    """A peak window on `meter`, lapped every :data:`INTERVAL` seconds by a thread: an
    exact peak per interval, for a meter without an event log."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.device = meter.device
        self.points: list[tuple[int, int]] = []
        """``(time.monotonic_ns() at the end of the interval, peak bytes in it)``."""
        self.start_bytes = 0
        self.end_bytes = 0
        self.start = 0
        self._interval = INTERVAL
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stat = meter.stats[0]

    def begin(self) -> None:
        self._window = self.meter.window()
        self.start_bytes = self._window.start
        self.start = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="torchmem-laps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._lap()

    def _lap(self) -> None:
        if self._window.closed:
            return
        peak = self._window.lap()[self._stat]
        self.points.append((time.monotonic_ns(), peak))
        if len(self.points) > MAX_POINTS:
            pairs = zip(self.points[::2], self.points[1::2], strict=False)
            merged = [(b[0], max(a[1], b[1])) for a, b in pairs]
            if len(self.points) % 2:
                merged.append(self.points[-1])
            self.points = merged
            self._interval *= 2

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._lap()
        self.end_bytes = self.meter.used()
        self._window.close()
