"""From a device's event log and the hooks' marks to the records of a report.

The bytes in use after each event are the start's plus a running sum; the peak is the
first event where that sum is highest. An allocation is alive at the peak when it was
made at or before it and freed after it (or never). Each allocation's category is the
first of :data:`~torchmem.records.run.CATEGORIES` that a mark gave the storage at its
address while it was alive. An allocation autograd's engine made (site
:data:`~torchmem.records.frames.BACKWARD`, or no Python frame while a backward pass ran)
is named after the innermost module whose backward pass was running then.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchmem.meters.native import NO_PYTHON_SITE
from torchmem.recorder.hooks import OTHER, Interval, Mark, Watcher
from torchmem.recorder.sources import NO_SITE, Laps, Log
from torchmem.records.frames import BACKWARD, NO_PYTHON, SiteKey
from torchmem.records.run import CATEGORIES, DeviceRun, Held, ModulePeak, Site

BUCKETS = 200
"""Intervals in the timeline of a device with an event log."""
_PSEUDO = {NO_PYTHON_SITE: (NO_PYTHON, 0, "")}
"""Sites standing for site indices the log could not place."""
BEFORE = "<before recording>"


@dataclass(frozen=True)
class _Named:
    """What the marks said about one allocation: the category, and how to name it."""

    category: int
    name: tuple[Any, ...] | None
    shape: tuple[int, ...]
    dtype: str


class Replay:
    """One device's log, replayed: bytes in use after each event, and what each
    allocation was."""

    def __init__(self, log: Log, marks: Sequence[Mark]) -> None:
        self.log = log
        events = log.events
        self.times = events[:, 0].contiguous()
        self.sizes = events[:, 2]
        self.others = events[:, 4]
        self.current = log.base + torch.cumsum(self.sizes, 0)
        self.allocs = self.sizes > 0
        self.named: dict[int, _Named] = {}
        """Allocation event index -> what marks said it was."""
        self.baseline: dict[int, _Named] = {}
        """Address of a storage alive at the start -> what marks said it was."""
        self._resolve([m for m in marks if m.device == log.device])

    def _resolve(self, marks: list[Mark]) -> None:
        if not marks:
            return
        events = self.log.events
        wanted = torch.tensor(sorted({m.ptr for m in marks}), dtype=torch.int64)
        candidates = (torch.isin(events[:, 1], wanted) & self.allocs).nonzero()[:, 0].tolist()
        at: dict[int, list[int]] = {}
        for index in candidates:
            at.setdefault(int(events[index, 1]), []).append(index)
        times = self.times
        for mark in sorted(marks, key=lambda m: m.time):
            found = None
            for index in reversed(at.get(mark.ptr, [])):
                if times[index] <= mark.time:
                    free = int(self.others[index])
                    if free < 0 or times[free] > mark.time:
                        found = index
                    break
            if found is not None:
                _keep(self.named, found, mark)
            elif mark.ptr in self.log.baseline:
                _keep(self.baseline, mark.ptr, mark)

    def at(self, k: int) -> int:
        """Bytes in use after event `k` (-1: at the start)."""
        return self.log.base if k < 0 else int(self.current[k])

    def peak(self) -> int:
        """The index of the first event at the highest use; -1 when nothing rose above
        the start."""
        if not len(self.current):
            return -1
        value, index = torch.max(self.current, 0)
        return int(index) if int(value) > self.log.base else -1

    def alive(self, k: int) -> list[int]:
        """Allocation events alive after event `k`."""
        if k < 0:
            return []
        n = len(self.sizes)
        index = torch.arange(n)
        alive = self.allocs & (index <= k) & ((self.others < 0) | (self.others > k))
        return alive.nonzero()[:, 0].tolist()

    def baseline_alive(self, k: int) -> tuple[int, set[int]]:
        """Bytes alive after event `k` that were allocated before the start, and the
        addresses of those freed by then."""
        if k < 0:
            return self.log.base, set()
        frees = (~self.allocs[: k + 1]) & (self.others[: k + 1] < 0)
        freed = self.sizes[: k + 1][frees]
        addresses = set(self.log.events[: k + 1, 1][frees].tolist())
        return self.log.base + int(freed.sum()), addresses


def _keep(table: dict[int, _Named], key: int, mark: Mark) -> None:
    known = table.get(key)
    if known is None or mark.category < known.category:
        table[key] = _Named(mark.category, mark.name, mark.shape, mark.dtype)


def device_run(
    log: Log,
    marks: Sequence[Mark],
    stop: int,
    namer: Names,
    variables: dict[int, str],
    top: int,
) -> tuple[DeviceRun, Replay]:
    """The record of one device with an event log, and its replay (for module peaks).

    Args:
        stop: ``time.monotonic_ns()`` when the recording stopped.
        namer: turns a mark's name into a name (None: no name), and names backward passes.
        variables: address -> name of a variable holding that storage at the end.
        top: how many sites and allocations to keep.
    """
    replay = Replay(log, marks)
    k = replay.peak()
    end = len(replay.sizes) - 1
    peak_time = (int(replay.times[k]) - log.start) / 1e9 if k >= 0 else 0.0
    run = DeviceRun(
        device=log.device,
        start_bytes=log.base,
        peak_bytes=int(replay.at(k)),
        peak_time=max(peak_time, 0.0),
        end_bytes=int(replay.at(end)),
        timeline=_timeline(replay, log.start, stop),
        categories_at_peak=_categories(replay, k),
        categories_at_end=_categories(replay, end),
        sites_at_peak=_sites(replay, k, top, namer),
        largest_at_peak=_largest(replay, k, namer, variables, top),
        reserved_peak_bytes=log.reserved_peak,
    )
    return run, replay


def _categories(replay: Replay, k: int) -> dict[str, int]:
    totals = [0] * len(CATEGORIES)
    for index in replay.alive(k):
        named = replay.named.get(index)
        totals[OTHER if named is None else named.category] += int(replay.sizes[index])
    remaining, freed = replay.baseline_alive(k)
    for address, named in replay.baseline.items():
        if address not in freed:
            size = replay.log.baseline[address]
            totals[named.category] += size
            remaining -= size
    totals[OTHER] += remaining
    return dict(zip(CATEGORIES, totals, strict=True))


def _keys(replay: Replay, indices: list[int], names: Names) -> list[tuple[str, int, str] | None]:
    """The site of each allocation event of `indices` (None: not recorded), those
    autograd's engine made named after the module whose backward pass ran then."""
    log = replay.log
    keys: list[tuple[str, int, str] | None] = []
    engine = []
    for position, site in enumerate(log.events[indices, 3].tolist()):
        key = log.sites.get(site) if site >= 0 else _PSEUDO.get(site)
        if key is not None and key[0] in (BACKWARD, NO_PYTHON):
            engine.append(position)
        keys.append(key)
    times = [int(replay.times[indices[p]]) for p in engine]
    for position, name in zip(engine, names.backward(times), strict=True):
        if name is not None:
            keys[position] = SiteKey((name, 0, ""), getattr(keys[position], "stack", ()))
    return keys


def _sites(replay: Replay, k: int, top: int, names: Names) -> tuple[Site, ...]:
    alive = replay.alive(k)
    if not alive:
        return ()
    if bool((replay.log.events[alive, 3] == NO_SITE).all()):
        return ()  # sites were not recorded
    totals: dict[tuple[str, int, str], int] = {}
    for key, size in zip(_keys(replay, alive, names), replay.sizes[alive].tolist(), strict=True):
        if key is not None:
            totals[key] = totals.get(key, 0) + size
    found = [Site(*key, size, getattr(key, "stack", ())) for key, size in totals.items()]
    before, _ = replay.baseline_alive(k)
    if before:
        found.append(Site(BEFORE, 0, "", before))
    found.sort(key=lambda s: s.bytes, reverse=True)
    return tuple(found[:top])


def _largest(
    replay: Replay,
    k: int,
    namer: Names,
    variables: dict[int, str],
    top: int,
) -> tuple[Held, ...]:
    events = replay.log.events
    alive = replay.alive(k)
    alive.sort(key=lambda i: int(replay.sizes[i]), reverse=True)
    held = []
    for index, key in zip(alive[:top], _keys(replay, alive[:top], namer), strict=True):
        ptr, size, _, other = (int(v) for v in events[index, 1:])
        named = replay.named.get(index)
        where = None
        if key is not None and key[0] != NO_PYTHON:
            where = f"{key[0]}:{key[1]}" if key[1] else key[0]
        name = namer(named.name) if named is not None else None
        if name is None and other < 0:
            name = variables.get(ptr)
        if name is None:
            name = f"Tensor@{os.path.basename(where)}" if where else "Tensor"
        held.append(_held(name, size, named, where))
    _, freed = replay.baseline_alive(k)
    for address, named in replay.baseline.items():
        if address not in freed:
            size = replay.log.baseline[address]
            held.append(_held(namer(named.name) or "Tensor", size, named, BEFORE))
    held.sort(key=lambda h: h.bytes, reverse=True)
    return tuple(held[:top])


def _held(name: str, size: int, named: _Named | None, where: str | None) -> Held:
    if named is None:
        return Held(name, size, CATEGORIES[OTHER], site=where)
    return Held(name, size, CATEGORIES[named.category], named.shape, named.dtype, where)


def _timeline(replay: Replay, start: int, stop: int) -> tuple[tuple[float, int], ...]:
    span = max(stop - start, 1)
    edges = start + torch.arange(BUCKETS + 1, dtype=torch.int64) * span // BUCKETS
    current = replay.current
    times = replay.times
    peaks = torch.full((BUCKETS,), replay.log.base, dtype=torch.int64)
    if len(current):
        before = torch.searchsorted(times, edges[:-1])  # events before each interval
        prior = current[(before - 1).clamp(min=0)]
        peaks = torch.where(before > 0, prior, peaks)
        bucket = ((times - start) * BUCKETS // span).clamp(0, BUCKETS - 1)
        peaks.scatter_reduce_(0, bucket, current, "amax")
    ends = (edges[1:] - start).tolist()
    return tuple((end / 1e9, int(p)) for end, p in zip(ends, peaks.tolist(), strict=True))


def laps_run(laps: Laps) -> DeviceRun:
    """The record of a device lapped by a thread: no categories, sites or modules."""
    points = laps.points
    peak_at, peak = max(points, key=lambda p: p[1]) if points else (laps.start, laps.start_bytes)
    return DeviceRun(
        device=laps.device,
        start_bytes=laps.start_bytes,
        peak_bytes=max(peak, laps.start_bytes),
        peak_time=(peak_at - laps.start) / 1e9,
        end_bytes=laps.end_bytes,
        timeline=tuple(((t - laps.start) / 1e9, p) for t, p in points),
        exact=laps.meter.exact,
    )


def module_peaks(
    replay: Replay,
    intervals: Sequence[Interval],
    modules: dict[int, torch.nn.Module],
    names: dict[int, str],
    calls: dict[int, int],
) -> tuple[ModulePeak, ...]:
    """Each module's highest use during its forward calls and its backward passes."""
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    if intervals:
        times = replay.times
        starts = torch.searchsorted(times, torch.tensor([i.start for i in intervals]))
        ends = torch.searchsorted(times, torch.tensor([i.end for i in intervals]))
        for interval, i0, i1 in zip(intervals, starts.tolist(), ends.tolist(), strict=True):
            high = int(replay.at(i0 - 1))
            if i1 > i0:
                high = max(high, int(replay.current[i0:i1].max()))
            table = backward if interval.backward else forward
            table[interval.module] = max(table.get(interval.module, high), high)
    return tuple(
        ModulePeak(
            names.get(key, ""),
            type(module).__name__,
            replay.log.device,
            forward.get(key, replay.log.base),
            backward.get(key),
            calls.get(key, 0),
        )
        for key, module in modules.items()
    )


class Names:
    """Names of the modules and parameters a :class:`Watcher` saw, from the outermost
    modules called; called with a mark's name, the name a report shows. Also names the
    backward passes the watcher saw (:meth:`backward`)."""

    def __init__(self, watcher: Watcher) -> None:
        self.modules: dict[int, str] = {}
        self.params: dict[int, str] = {}
        self._types = {key: type(module).__name__ for key, module in watcher.modules.items()}
        self._backward = sorted((i.start, i.end, i.module) for i in watcher.intervals if i.backward)
        several = len(watcher.roots) > 1
        for root in watcher.roots:
            prefix = type(root).__name__ if several else ""
            for name, module in root.named_modules(remove_duplicate=False):
                self.modules.setdefault(id(module), _join(prefix, name))
            for name, param in root.named_parameters(remove_duplicate=False):
                self.params.setdefault(id(param), _join(prefix, name))
        for key, module in watcher.modules.items():
            self.modules.setdefault(key, type(module).__name__)

    def __call__(self, name: tuple[Any, ...] | None) -> str | None:
        if name is None:
            return None
        kind = name[0]
        if kind in ("param", "grad"):
            found = _join(self.modules.get(name[1], ""), name[2])
            return found + ".grad" if kind == "grad" else found
        if kind == "grad-of":
            return self.params.get(name[1], "Parameter") + ".grad"
        if kind == "state":
            return f"{name[1]}.{self.params.get(name[2], 'Parameter')}.{name[3]}"
        if kind == "saved":
            return f"saved by {self.modules.get(name[1]) or 'the model'}"
        return None

    def backward(self, times: list[int]) -> list[str | None]:
        """For each of `times` (``time.monotonic_ns()``), ``backward of <module>`` for the
        innermost module whose backward pass was running then, else None. Modules that
        share an output run their backward passes at once: the deepest name is the
        innermost."""
        found: list[str | None] = [None] * len(times)
        running: list[tuple[int, int, int]] = []
        i = 0
        for position in sorted(range(len(times)), key=times.__getitem__):
            now = times[position]
            while i < len(self._backward) and self._backward[i][0] <= now:
                running.append(self._backward[i])
                i += 1
            running = [r for r in running if r[1] >= now]
            if running:
                key = max(running, key=lambda r: (self._depth(r[2]), r[0]))[2]
                found[position] = f"backward of {self.modules.get(key) or self._types[key]}"
        return found

    def _depth(self, key: int) -> int:
        name = self.modules.get(key, "")
        return name.count(".") + 1 if name else 0


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
