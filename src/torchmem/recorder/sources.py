"""Where a recording's numbers come from, per device.

- CPU tensors: the counting CPU allocator's event log (every allocation and free, with
  the allocating line of the user's code), see :mod:`torchmem.meters.native`.
- CUDA: PyTorch's own allocator history (``torch.cuda.memory._record_memory_history``),
  which records the Python stack of each allocation inside the caching allocator, at a
  lower cost than anything done from outside it.
- Process RAM, and CPU tensors where the counting allocator is not available: a peak
  window lapped by a thread, an exact peak per interval but no event log.
"""

from __future__ import annotations

import os
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch

from torchmem._compat import cuda_history_start, cuda_history_stop
from torchmem.meters import Meter, Window, meter
from torchmem.meters.cpu import CpuAllocatorMeter, live_storages

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
    sites: dict[int, tuple[str, int, str]]
    """Site index -> (file, line, function)."""
    baseline: dict[int, int] = field(default_factory=dict)
    """Address -> bytes of the storages Python could see when the recording started."""
    reserved_peak: int | None = None
    """CUDA: the caching allocator's highest reserved bytes."""


def user_prefixes() -> dict[str, bool]:
    """Path prefixes, mapped to whether files under them are the user's code: PyTorch,
    torchmem and Python's standard library are not, installed packages are. The longest
    matching prefix decides; a file under none is the user's."""
    paths = sysconfig.get_paths()
    prefixes = {paths[key]: False for key in ("stdlib", "platstdlib") if key in paths}
    prefixes.update({paths[key]: True for key in ("purelib", "platlib") if key in paths})
    prefixes[os.path.dirname(torch.__file__)] = False
    prefixes[os.path.dirname(os.path.dirname(__file__))] = False  # torchmem
    prefixes["<frozen "] = False
    return prefixes


def is_user_file(filename: str, prefixes: dict[str, bool]) -> bool:
    """Whether `filename` is the user's code, by :func:`user_prefixes`."""
    longest, mine = -1, True
    for prefix, user in prefixes.items():
        if len(prefix) > longest and filename.startswith(prefix):
            longest, mine = len(prefix), user
    return mine


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
        self._first = library.record_start(self.sites and library.records_sites, user_prefixes())
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
        library.record_clear()
        return Log("cpu", self._base, self._start, events, sites, self._baseline)


def _site(code: CodeType, line: int) -> tuple[str, int, str]:
    return code.co_filename, line, getattr(code, "co_qualname", code.co_name)  # 3.11+


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

    def start(self) -> None:
        self._windows = [m.window() for m in self.meters]  # for the reserved peak
        self._bases = [m.used() for m in self.meters]
        self._start, self._wall = time.monotonic_ns(), time.time_ns()
        cuda_history_start(self.sites, CUDA_ENTRIES)

    def stop(self) -> list[Log]:
        snapshot = cuda_history_stop(None)
        self.history = snapshot
        traces = snapshot.get("device_traces", [])
        prefixes = user_prefixes()
        logs = []
        for index, window, base in zip(self.indices, self._windows, self._bases, strict=True):
            window.close()
            trace = traces[index] if index < len(traces) else []
            events, sites = cuda_events(trace, self._start, self._wall, prefixes)
            reserved = window.peak("reserved_bytes.all")
            logs.append(Log(f"cuda:{index}", base, self._start, events, sites, {}, reserved))
        return logs


def cuda_events(
    trace: list[dict[str, object]], start: int, wall: int, prefixes: dict[str, bool]
) -> tuple[torch.Tensor, dict[int, tuple[str, int, str]]]:
    """A CUDA allocator history's trace (``_snapshot()["device_traces"][i]``) as the rows
    of :attr:`Log.events`, and its sites. Entries before `wall` (``time.time_ns()`` when
    the recording started, `start` on the monotonic clock) are left out; an allocation
    counts from ``alloc``, a free from ``free_completed`` (when ``memory_allocated``
    drops)."""
    rows: list[list[int]] = []
    sites: dict[tuple[str, int, str], int] = {}
    live: dict[int, int] = {}
    for entry in trace:
        action = entry.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        when = int(entry.get("time_us", 0)) * 1000  # type: ignore[call-overload]
        if when and when < wall:
            continue
        at = start + (when - wall if when else 0)
        address = int(entry["addr"])  # type: ignore[call-overload]
        size = int(entry["size"])  # type: ignore[call-overload]
        if action == "alloc":
            site = NO_SITE
            for frame in entry.get("frames", []):  # type: ignore[attr-defined]
                if is_user_file(frame["filename"], prefixes):
                    key = (frame["filename"], int(frame["line"]), frame["name"])
                    site = sites.setdefault(key, len(sites))
                    break
            live[address] = len(rows)
            rows.append([at, address, size, site, -1])
        else:
            other = live.pop(address, -1)
            if other >= 0:
                rows[other][4] = len(rows)
            rows.append([at, address, -size, NO_SITE, other])
    events = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
    return events, {index: key for key, index in sites.items()}


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
