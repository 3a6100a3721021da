"""From a device's tally and the watcher's names to the records of a report.

The tally (:mod:`torchmem.events.tally`) kept the allocations alive at the peak (the
first row where use was highest) and at the end, each with the first category of
:data:`~torchmem.records.run.CATEGORIES` a mark gave it while it was alive; here they are
summed per category and per site, the largest named, and each module's highest use
listed. An allocation autograd's engine made (site :data:`~torchmem.records.frames.BACKWARD`,
or no Python frame while a backward pass ran) is named after the innermost module whose
backward pass was running then.
"""

from __future__ import annotations

import linecache
import os
from typing import Any

import numpy as np

from torchmem.events.hooks import Watcher
from torchmem.events.notes import NameTable, Variable
from torchmem.events.sources import NO_SITE, Laps, Tallied
from torchmem.events.table import Table
from torchmem.events.tally import UNNAMED, Tally
from torchmem.meters.native import NO_PYTHON_SITE
from torchmem.records.frames import NO_PYTHON, SiteKey, Stack, located
from torchmem.records.run import CATEGORIES, DeviceRun, Held, ModulePeak, Site
from torchmem.records.sites import stacks_of

BUCKETS = 200
"""Intervals in the timeline of a device with an event log, at most."""
_PSEUDO = {NO_PYTHON_SITE: SiteKey((NO_PYTHON, 0, ""), ())}
"""Sites standing for site indices the log could not place."""
BEFORE = "<before recording>"
_OTHER = len(CATEGORIES) - 1


def device_run(
    found: Tallied,
    stop: int,
    namer: Names,
    table: NameTable,
    variables: dict[int, Variable],
    top: int,
) -> DeviceRun:
    """The record of one device with an event log.

    Args:
        stop: ``time.monotonic_ns()`` when the recording stopped.
        namer: turns a mark's name into a name (None: no name), and names backward passes.
        table: the names the marks gave, by index.
        variables: address -> the variable holding that storage at the end.
        top: how many of the largest allocations to list (every site is kept).
    """
    tally = found.tally
    at_start = tally.peak_seq < tally.first
    largest, others = _largest(found, namer, table, variables, top)
    timeline, layers = tally.line.read(stop, BUCKETS)
    return DeviceRun(
        device=found.device,
        start_bytes=tally.base,
        peak_bytes=tally.peak,
        peak_time=0.0 if at_start else max((tally.peak_time - tally.start) / 1e9, 0.0),
        end_bytes=tally.current,
        timeline=timeline,
        categories_at_peak=_categories(tally.at_peak, tally.hidden_at_peak),
        categories_at_end=_categories(tally.live, tally.hidden),
        sites_at_peak=_sites(found, namer),
        largest_at_peak=largest,
        others_at_peak=others,
        reserved_peak_bytes=found.reserved_peak,
        timeline_categories=layers,
    )


def _categories(records: Table, hidden: int) -> dict[str, int]:
    totals = np.bincount(records.cat, weights=records.size, minlength=len(CATEGORIES))
    counted = [int(t) for t in totals[: len(CATEGORIES)]]
    counted[_OTHER] += hidden
    return dict(zip(CATEGORIES, counted, strict=True))


def _key(found: Tallied, site: int, owner: int, names: Names) -> SiteKey | None:
    """The site of an allocation (None: not recorded); one autograd's engine made while a
    module's backward pass ran is named after that module."""
    key = found.sites.get(site) if site >= 0 else _PSEUDO.get(site)
    if owner >= 0:
        return SiteKey((names.backward(owner), 0, ""), key.stack if key is not None else ())
    return key


def _sites(found: Tallied, names: Names) -> tuple[Site, ...]:
    """The sites alive at the peak, each with the stacks of its allocations alive then."""
    records = found.tally.at_peak
    made = records.born >= 0
    if not made.any() or bool((records.site[made] == NO_SITE).all()):
        return ()  # nothing allocated alive at the peak, or sites were not recorded
    totals: dict[SiteKey, dict[Stack, int]] = {}  # site -> its stacks' bytes
    pairs = np.stack([records.site[made], records.owner[made]], axis=1)
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    sums = np.bincount(inverse.reshape(-1), weights=records.size[made], minlength=len(unique))
    for (site, owner), size in zip(unique.tolist(), sums.tolist(), strict=True):
        key = _key(found, site, owner, names)
        if key is not None:
            stacks = totals.setdefault(key, {})
            stacks[key.stack] = stacks.get(key.stack, 0) + int(size)
    sites = [
        Site(*key, sum(stacks.values()), stacks_of(stacks), source(key))
        for key, stacks in totals.items()
    ]
    before = found.tally.hidden_at_peak + int(records.size[~made].sum())
    if before:
        sites.append(Site(BEFORE, 0, "", before))
    sites.sort(key=lambda s: s.bytes, reverse=True)
    return tuple(sites)


def source(key: SiteKey) -> str | None:
    """The text of a site's line, stripped; None for a pseudo file (no line) and where the
    file cannot be read. A notebook cell's is read from the file IPython compiled it as."""
    if key[1] <= 0:
        return None
    return linecache.getline(key.path, key[1]).strip() or None


def _largest(
    found: Tallied,
    namer: Names,
    table: NameTable,
    variables: dict[int, Variable],
    top: int,
) -> tuple[tuple[Held, ...], tuple[int, int]]:
    """The `top` largest allocations alive at the peak, and ``(count, bytes)`` of the
    others."""
    tally = found.tally
    records = tally.at_peak
    # Allocated while recording, or alive from before and named.
    listed = (records.born >= 0) | (records.name != UNNAMED)
    order = np.flatnonzero(listed)
    order = order[np.argsort(-records.size[order], kind="stable")]
    others = (len(order[top:]), int(records.size[order[top:]].sum()))
    order = order[:top]
    alive = set(tally.live.key.tolist())
    held = []
    for i in order.tolist():
        size, ptr, name_at = int(records.size[i]), int(records.ptr[i]), int(records.name[i])
        entry = table.entries[name_at] if name_at != UNNAMED else None
        category = CATEGORIES[int(records.cat[i])]
        name, shape, dtype = None, None, None
        if entry is not None:
            name, shape, dtype = namer(entry[0]), entry[1], entry[2]
        if records.born[i] < 0:
            held.append(Held(name or "Tensor", size, category, shape, dtype, BEFORE))
            continue
        key = _key(found, int(records.site[i]), int(records.owner[i]), namer)
        where = None
        if key is not None and key[0] != NO_PYTHON:
            where = located(key[0], key[1])
        if name is None and int(records.key[i]) in alive and ptr in variables:
            variable = variables[ptr]
            name = variable.name
            if entry is None:
                shape, dtype = variable.shape, variable.dtype
        if name is None:
            name = f"Tensor@{os.path.basename(where)}" if where else "Tensor"
        held.append(Held(name, size, category, shape, dtype, where))
    held.sort(key=lambda h: h.bytes, reverse=True)
    return tuple(held), others


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
        exact=laps.meter.exact if laps.exact is None else laps.exact,
    )


def module_peaks(
    tally: Tally,
    device: str,
    modules: dict[int, str],
    names: dict[int, str],
    calls: dict[int, int],
) -> tuple[ModulePeak, ...]:
    """Each module's highest use during its forward calls and its backward passes, and
    what they added (`modules`: each module's class's name, by id)."""
    return tuple(
        ModulePeak(
            names.get(key, ""),
            kind,
            device,
            tally.forward.get(key, tally.base),
            tally.backward.get(key),
            calls.get(key, 0),
            forward_kept_bytes=max(tally.kept.get(key, 0), 0),
            backward_rise_bytes=tally.rise.get(key),
        )
        for key, kind in modules.items()
    )


class Names:
    """Names of the modules and parameters a :class:`Watcher` saw, from the outermost
    modules called; called with a mark's name, the name a report shows. Also names
    backward passes (:meth:`backward`)."""

    def __init__(self, watcher: Watcher) -> None:
        self.modules: dict[int, str] = {}
        self.params: dict[int, str] = {}
        self._types = watcher.modules
        several = len(watcher.roots) > 1
        for root in watcher.roots:
            tree = watcher.trees[root]
            prefix = tree.kind if several else ""
            for key, name in tree.modules:
                self.modules.setdefault(key, _join(prefix, name))
            for key, name in tree.params:
                self.params.setdefault(key, _join(prefix, name))
        for key, kind in watcher.modules.items():
            self.modules.setdefault(key, kind)

    def __call__(self, name: tuple[Any, ...] | None) -> str | None:
        if name is None:
            return None
        kind = name[0]
        if kind in ("param", "grad", "buffer"):
            found = _join(self.modules.get(name[1], ""), name[2])
            return found + ".grad" if kind == "grad" else found
        if kind == "grad-of":
            return self.params.get(name[1], "Parameter") + ".grad"
        if kind == "state":
            return f"{name[1]}.{self.params.get(name[2], 'Parameter')}.{name[3]}"
        if kind == "gathered":
            return _join(self.modules.get(name[1], ""), name[2]) + " (all-gathered)"
        if kind == "unsharded-grad":
            return _join(self.modules.get(name[1], ""), name[2]) + ".grad (unsharded)"
        if kind == "collectives":
            return f"FSDP2 collectives of {self.modules.get(name[1]) or 'the model'}"
        if kind == "saved":
            return f"saved by {self.modules.get(name[1]) or 'the model'}"
        return None

    def backward(self, module: int) -> str:
        """``backward of <module> (<class>)`` for the module of id `module` (``backward of
        0 (Linear)`` for an ``nn.Sequential``'s first); ``backward of <class>`` for the
        outermost one."""
        return f"backward of {self.label(module)}"

    def label(self, module: int) -> str:
        """``<module> (<class>)`` for the module of id `module` (``0 (Linear)``); its
        class's name for the outermost one."""
        kind = self._types.get(module, "module")
        name = self.modules.get(module) or kind
        return name if name == kind else f"{name} ({kind})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
