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

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchmem.events import history
from torchmem.events.notes import NameTable, Notes
from torchmem.events.tally import (
    ALLOC,
    COLUMNS,
    FREE,
    KIND,
    MARK,
    PTR,
    REF,
    SITE,
    SIZE,
    TIME,
    Tally,
)
from torchmem.meters import Meter, Window, meter
from torchmem.meters.base import background_thread
from torchmem.meters.cpu import CpuAllocatorMeter
from torchmem.meters.native import NO_FRAME_SITE, NO_PYTHON_SITE, CpuAllocatorLibrary
from torchmem.records.caching import KINDS, trace_blocks
from torchmem.records.frames import BACKWARD, ENGINE, Frame, SiteKey, Stack, own_file, stack_site

NO_SITE = -1
"""A site index for an allocation whose site was not recorded."""
INTERVAL = 0.02
"""Seconds between two laps of a lapped meter, at first."""
MAX_POINTS = 2000
"""A lapped timeline keeps at most this many intervals: past it, neighbours merge."""
CUDA_ENTRIES = 1_000_000
"""How many allocator actions PyTorch's CUDA history keeps (its ring buffer)."""
CHUNK = 1 << 16
"""Rows of the CPU log tallied at once."""
DRAIN_AT = 1 << 15
"""Rows waiting in the CPU log that make the drain thread tally them."""
BACKLOG = 1 << 17
"""Rows waiting in the CPU log that make the recorded code's own thread tally them."""
DRAIN_EVERY = 0.05
"""Seconds between two looks of the drain thread at the CPU log."""


@dataclass
class Log:
    """Every allocation and free on one device, held in memory before it is tallied
    (CUDA's allocator history, bounded by PyTorch's ring; the estimator's fake run)."""

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
    """Stack index (each distinct stack has one) -> site, ``(file, line, function)``,
    carrying that Python stack (:mod:`torchmem.records.frames`);
    :data:`~torchmem.records.frames.BACKWARD` for allocations autograd's engine made."""
    reserved_peak: int | None = None
    """CUDA: the caching allocator's highest reserved bytes."""

    def tally(self, notes: Notes | None = None, every_device: bool = False) -> Tallied:
        """This log, with the marks of this device (of every device with `every_device`)
        and the probes that `notes` holds, tallied."""
        tally = Tally(self.base, self.start)
        tally.engine = {i for i, key in self.sites.items() if key[0] == BACKWARD}
        rows = stream(self.events.numpy(), notes, None if every_device else self.device)
        for first in range(0, len(rows), CHUNK):
            tally.feed(rows[first : first + CHUNK])
        tally.finish()
        lost = notes.lost if notes is not None else 0
        return Tallied(self.device, tally, self.sites, self.reserved_peak, lost)


@dataclass
class Tallied:
    """A device's recording, tallied: what the report is made from."""

    device: str
    tally: Tally
    sites: dict[int, SiteKey]
    """Stack index -> site (see :attr:`Log.sites`); index :data:`NO_PYTHON_SITE`: no Python
    frame (a thread Python does not know: intra-op workers)."""
    reserved_peak: int | None = None
    lost_notes: int = 0
    """Marks and probes too old to be kept (see :class:`~torchmem.events.notes.Notes`)."""
    lost_rows: int = 0
    """Rows the CPU log had no memory for (see :meth:`CpuAllocatorLibrary.dropped_rows`)."""


def stream(events: np.ndarray, notes: Notes | None, device: str | None) -> np.ndarray:
    """`events` (rows of :attr:`Log.events`) and the marks (of `device`; None: of every
    device) and probes of `notes`, merged in time order into the rows of
    :mod:`torchmem.events.tally`'s stream: a free names its allocation's row, a mark the
    allocation alive at its address then."""
    events = events.reshape(-1, 5)
    held = notes.rows if notes is not None else ()
    kept = [r for r in held if device is None or r[5] in ("", device)]
    noted = np.array([r[:5] for r in kept], np.int64).reshape(-1, 5)
    n, m = len(events), len(noted)
    times = np.concatenate([events[:, 0], noted[:, 0]])
    order = np.lexsort((np.arange(n + m), times))  # by time; an event before a note then
    at = np.empty(n + m, np.int64)
    at[order] = np.arange(n + m)
    rows = np.empty((n + m, COLUMNS), np.int64)
    mine, theirs = at[:n], at[n:]
    frees = events[:, 2] < 0
    other = events[:, 4]
    rows[mine, TIME] = events[:, 0]
    rows[mine, PTR] = events[:, 1]
    rows[mine, SIZE] = events[:, 2]
    rows[mine, SITE] = np.where(frees, NO_SITE, events[:, 3])
    rows[mine, REF] = np.where(frees & (other >= 0), mine[np.maximum(other, 0)], -1)
    rows[mine, KIND] = np.where(frees, FREE, ALLOC)
    rows[theirs, TIME] = noted[:, 0]
    rows[theirs, KIND] = noted[:, 1]
    rows[theirs, PTR] = noted[:, 2]
    rows[theirs, SITE] = noted[:, 3]
    rows[theirs, SIZE] = 0
    rows[theirs, REF] = noted[:, 4]
    marks = theirs[noted[:, 1] == MARK]
    if len(marks) and n:
        rows[marks, REF] = _alive_at(rows, marks)
    return rows


def _alive_at(rows: np.ndarray, marks: np.ndarray) -> np.ndarray:
    """For each mark row, the row of the allocation alive at its address then (-1: none)."""
    allocs = np.flatnonzero(rows[:, KIND] == ALLOC)
    ended = np.full(len(rows), np.iinfo(np.int64).max, np.int64)
    frees = np.flatnonzero((rows[:, KIND] == FREE) & (rows[:, REF] >= 0))
    ended[rows[frees, REF]] = frees
    _, rank = np.unique(np.concatenate([rows[allocs, PTR], rows[marks, PTR]]), return_inverse=True)
    width = len(rows) + 1
    keys = rank[: len(allocs)] * width + allocs  # by address, then by place
    order = np.argsort(keys)
    keys, allocs = keys[order], allocs[order]
    wanted = rank[len(allocs) :] * width + marks
    found = np.searchsorted(keys, wanted) - 1
    ok = found >= 0
    found = np.maximum(found, 0)
    ok &= keys[found] // width == wanted // width
    ok &= ended[allocs[found]] > marks
    return np.where(ok, allocs[found], -1)


class CpuStream:
    """The counting CPU allocator's log while recordings run: a thread drains it as it
    fills and feeds each recording's :class:`Tally`, so that it never holds more than a
    few chunks, whatever the run's length. One per process; recordings that nest share it.
    """

    def __init__(self, library: CpuAllocatorLibrary) -> None:
        self.library = library
        self.tallies: list[Tally] = []
        self.sites: dict[int, SiteKey] = {}
        self.names = NameTable()
        """The marks' names: one table for the recordings that share the log."""
        self._engine: set[int] = {NO_PYTHON_SITE}
        self._taken = 0
        self._next_site = 0  # sites numbered below it are in `sites`
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget)

    def open(self, sites: bool, used: Callable[[], int], start: int) -> Tally:
        """Start a recording whose start is `used()` bytes at `start` (the origin of its
        times, ``time.monotonic_ns()``); its tally."""
        with self._lock:
            fresh = not self.tallies  # (a nested recording's first row may be row 0 too)
            first = self.library.record_start(sites)
            if fresh:
                self.sites, self.names, self._engine = {}, NameTable(), {NO_PYTHON_SITE}
                self._taken, self._next_site = 0, 0
                self._halt.clear()
                self._thread = background_thread(self._run, "torchmem-log")
                self._thread.start()
            tally = Tally(used(), start, first)
            tally.engine = self._engine
            self.tallies.append(tally)
        return tally

    def close(self, tally: Tally) -> dict[int, SiteKey]:
        """End the recording of `tally`, tallied to its end; the sites it may name."""
        last = False
        try:
            with self._lock:
                last = self.library.record_stop()
                try:
                    self._drain()
                finally:
                    self.tallies.remove(tally)
                    sites = dict(self.sites)
                    if last:
                        self._halt.set()
        finally:  # the log and its thread are left as they should be, whatever happened
            if last:
                if self._thread is not None:
                    self._thread.join()
                self._thread = None
                self.library.record_clear()
        tally.finish()
        return sites

    def catch_up(self) -> None:
        """Tally the log here and now if the thread has fallen behind (a program that
        seldom lets it run): the log never holds more than :data:`BACKLOG` rows for long."""
        if self.library.count() - self._taken >= BACKLOG:
            with self._lock:
                self._drain()

    def _run(self) -> None:
        try:
            while not self._halt.wait(DRAIN_EVERY):
                if self.library.count() - self._taken >= DRAIN_AT:
                    with self._lock:
                        self._drain()
        except Exception:  # the closing recording drains again, and raises it
            pass

    def _drain(self) -> None:
        """Tally what the log holds; with the lock held. Rows that arrive meanwhile wait
        for the next drain: chasing them would tally a few hundred at a time, paying each
        tally's fixed cost again (1,000,000 tiny allocations: 2,352 tallies and 1.0 to
        1.5 s of the drain's time, against 30 tallies and 0.3 to 0.6 s)."""
        while True:
            rows = self.library.take(CHUNK)
            if not len(rows):
                return
            first = self._taken
            self._taken += len(rows)
            site = rows[:, SITE]
            allocs = rows[:, KIND] == ALLOC
            site[allocs & (site == NO_FRAME_SITE)] = NO_PYTHON_SITE
            # Stacks are numbered in the order first met: new ones are above those known.
            top = int(np.max(site, where=allocs, initial=-1))
            for index in range(self._next_site, top + 1):
                found = self.library.record_site(index)
                if found is not None:
                    self.sites[index] = key = _site(*found)
                    if key[0] == BACKWARD:
                        self._engine.add(index)
            self._next_site = max(self._next_site, top + 1)
            for tally in self.tallies:
                skip = tally.seq - first
                if skip < len(rows):
                    tally.feed(rows[max(skip, 0) :])
            if len(rows) < CHUNK:
                return

    def _forget(self) -> None:
        """In a child made by fork: no recording, no thread, a free lock."""
        self.tallies, self._thread, self._lock = [], None, threading.Lock()


_streams: dict[int, CpuStream] = {}
_streams_lock = threading.Lock()


class CpuLog:
    """A recording of the counting CPU allocator's log. :attr:`available` is False on the
    fallback meter, which keeps no log."""

    device = "cpu"

    def __init__(self, sites: bool) -> None:
        cpu = meter("cpu")
        self.meter = cpu
        self.available = isinstance(cpu, CpuAllocatorMeter)
        self.records_sites = isinstance(cpu, CpuAllocatorMeter) and cpu.library.records_sites
        self.sites = sites
        self.stream: CpuStream | None = None
        if isinstance(cpu, CpuAllocatorMeter):
            with _streams_lock:  # one per library: a stream's fork handler is for good
                stream = _streams.get(id(cpu.library)) or CpuStream(cpu.library)
                self.stream = _streams[id(cpu.library)] = stream
        self._tally: Tally | None = None
        self._dropped = 0

    @property
    def tally(self) -> Tally | None:
        """The log's tally since :meth:`start`, which the drain thread adds to; else None."""
        return self._tally

    def start(self, origin: int) -> None:
        assert self.stream is not None
        self._dropped = self.stream.library.dropped_rows()
        self._tally = self.stream.open(self.sites and self.records_sites, self.meter.used, origin)

    def stop(self) -> Tallied:
        assert self.stream is not None and self._tally is not None
        tally, self._tally = self._tally, None
        lost = self.stream.library.dropped_rows() - self._dropped
        return Tallied("cpu", tally, self.stream.close(tally), lost_rows=lost)


def _site(kind_of_site: int, site: Frame, stack: Stack) -> SiteKey:
    """A site of the CPU log: its frame (torchmem's own passed over), :data:`BACKWARD` where
    that is autograd engine's entry point; torchmem's own frames are left out of its stack."""
    kept = tuple(f for f in stack if not own_file(f[0]))
    if kind_of_site == ENGINE:
        return SiteKey((BACKWARD, 0, ""), kept)
    return SiteKey(kept[0] if kept and own_file(site[0]) else site, kept)


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
        self._origin = 0

    def start(self, origin: int) -> None:
        self._windows = [m.window() for m in self.meters]  # for the reserved peak
        self._bases = [m.used() for m in self.meters]
        self._start, self._wall = time.monotonic_ns(), time.time_ns()
        self._origin = origin  # the times' (at or before _start, which goes with _wall)
        self._lease = history.acquire(self.sites, CUDA_ENTRIES)

    def stop(self, notes: Notes | None = None) -> list[Tallied]:
        """The GPUs' logs, tallied with the marks and probes of `notes`."""
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
            log = Log(f"cuda:{index}", base, self._origin, events, sites, reserved)
            logs.append(log.tally(notes))
        return logs


def cuda_events(
    trace: list[dict[str, Any]],
    start: int,
    wall: int,
    segments: Sequence[dict[str, Any]] = (),
    expandable: bool = False,
) -> tuple[torch.Tensor, dict[int, SiteKey]]:
    """A CUDA allocator history's trace (``_snapshot()["device_traces"][i]``) as the rows
    of :attr:`Log.events`, and its stacks, each numbered once, with their sites
    (:func:`~torchmem.records.frames.stack_site`). Entries before `wall` (``time.time_ns()``
    at the start, `start` on the monotonic clock) are left out; an allocation counts from
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
    sites: dict[tuple[Frame, Stack], int] = {}
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
                site = picked[id(frames)] = sites.setdefault((key, key.stack), len(sites))
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
        self.exact: bool | None = None
        """Whether the peaks are exact, where the meter's :attr:`~Meter.exact` does not
        say (a RAM meter that kept the kernel's high-water mark)."""

    def begin(self, origin: int) -> None:
        """Start lapping; times are counted from `origin` (``time.monotonic_ns()``)."""
        self._window = self.meter.window()
        self.start_bytes = self._window.start
        self.start = origin
        self._thread = background_thread(self._run, "torchmem-laps")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._lap()

    def _lap(self, at: int | None = None) -> None:
        if self._window.closed:
            return
        peak = self._window.lap()[self._stat]
        self.points.append((time.monotonic_ns() if at is None else at, peak))
        if len(self.points) > MAX_POINTS:
            pairs = zip(self.points[::2], self.points[1::2], strict=False)
            merged = [(b[0], max(a[1], b[1])) for a, b in pairs]
            if len(self.points) % 2:
                merged.append(self.points[-1])
            self.points = merged
            self._interval *= 2

    def end(self, stop: int) -> None:
        """End at `stop` (``time.monotonic_ns()``): the last interval ends there."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.points = [(min(t, stop), peak) for t, peak in self.points]
        self._lap(stop)
        self.end_bytes = self.meter.used()
        self._window.close()
