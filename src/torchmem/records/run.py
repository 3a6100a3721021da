"""A recording's records: where a run's memory went, per device, in bytes and seconds.

Made by :mod:`torchmem.events` (``torchmem run``, ``torchmem.record()``); read by the
renderers in :mod:`torchmem.render.run`. :meth:`RunRecord.to_json` is the documented JSON
contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchmem.records.growth import (
    STEPS_LISTED as STEPS_LISTED,
    Growth as Growth,
    GrowthSite as GrowthSite,
    HeldGraph as HeldGraph,
    Step as Step,
)
from torchmem.records.sites import Site as Site, SiteStack as SiteStack
from torchmem.records.whatif import WhatIf
from torchmem.records.workers import Workers

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "buffers",
    "communication",
    "activations",
    "other",
)
"""What a byte can be, in the order reports list them. A storage that is several things
(a weight autograd saved for backward) counts as the first of them. ``communication``:
the buffers of sharded training's collectives (FSDP2's all-gathered unsharded parameters,
its reduce-scatter and all-reduce inputs)."""


@dataclass(frozen=True)
class Held:
    """One allocation (a tensor's storage) alive at the peak."""

    name: str
    """As :class:`~torchmem.MemReporter` names it (``fc1.weight``, ``fc1.weight.grad``,
    ``Adam.fc1.weight.exp_avg``), the variable that held it at the end of the run, a
    tensor autograd saved in a module (``saved by fc1``), else ``Tensor@<file>:<line>``."""
    bytes: int
    """Bytes of the allocation."""
    category: str
    """One of :data:`CATEGORIES`."""
    shape: tuple[int, ...] | None = None
    """The shape of the tensor it was seen as, where it was seen."""
    dtype: str | None = None
    """``str(dtype)`` of that tensor, e.g. ``"torch.float32"``."""
    site: str | None = None
    """``file:line`` where it was allocated (``In [4], line 3`` for a notebook cell, see
    :func:`~torchmem.records.frames.located`); None where that is not known."""


@dataclass(frozen=True)
class ModulePeak:
    """The highest memory in use on :attr:`device` while a module ran, over all its calls."""

    name: str
    """Its name in ``named_modules()`` of the outermost module called (``""`` for that
    one itself; ``"Net"``-prefixed names where several outermost modules ran)."""
    type: str
    """Its class name, e.g. ``"Linear"``."""
    device: str
    """The device measured: the run's main device (the first GPU used, else ``"cpu"``)."""
    forward_peak_bytes: int
    """Highest bytes in use during any of its forward calls (absolute, not a rise)."""
    backward_peak_bytes: int | None
    """Highest bytes in use while autograd computed its gradients; None when no backward
    pass went through it."""
    calls: int
    """How many times its forward ran."""
    forward_kept_bytes: int = 0
    """The most one forward call added and kept: bytes in use when the call returned less
    bytes in use when it began (its output and what autograd saved for backward), the
    highest over its calls; 0 where no call kept anything."""
    backward_rise_bytes: int | None = None
    """The most one backward pass through it rose above the bytes in use when that pass
    began; None when no backward pass went through it."""


PHASES = ("forward", "backward", "step")
"""What a :class:`Phase` can be: a forward call of an outermost module, a backward pass
through the model, a call of ``optimizer.step()``."""


@dataclass(frozen=True)
class Phase:
    """A span of the run where the program was in one phase of training."""

    kind: str
    """One of :data:`PHASES`."""
    start: float
    """Seconds from the start of the recording."""
    end: float
    """Seconds from the start of the recording."""


@dataclass(frozen=True)
class DeviceRun:
    """What one device's memory did over the recording."""

    device: str
    """``"cpu"`` (CPU tensors), ``"cuda:0"``, ... (the caching allocator's allocated bytes),
    or ``"ram"`` (the process's resident memory)."""
    start_bytes: int
    """Bytes in use when the recording started."""
    peak_bytes: int
    """The highest bytes in use during the recording."""
    peak_time: float
    """Seconds from the start of the recording to the peak (to the end of the interval
    that held it where the device has no event log)."""
    end_bytes: int
    """Bytes in use when the recording stopped."""
    timeline: tuple[tuple[float, int], ...]
    """``(end of interval in seconds, highest bytes in use during the interval)``: exact
    peaks over consecutive intervals, not samples."""
    categories_at_peak: dict[str, int] | None = None
    """Bytes of each of :data:`CATEGORIES` at the peak; None where the device has no
    event log (process RAM, the CPU fallback meter)."""
    categories_at_end: dict[str, int] | None = None
    """The same at the end of the recording."""
    sites_at_peak: tuple[Site, ...] = ()
    """Source lines whose allocations were alive at the peak, largest first."""
    largest_at_peak: tuple[Held, ...] = ()
    """The largest allocations alive at the peak, largest first (as many as the report
    was asked to list)."""
    others_at_peak: tuple[int, int] = (0, 0)
    """``(count, bytes)`` of the allocations alive at the peak that :attr:`largest_at_peak`
    leaves out."""
    reserved_peak_bytes: int | None = None
    """CUDA only: the caching allocator's highest reserved bytes."""
    timeline_categories: tuple[tuple[int, ...], ...] | None = None
    """For each interval of :attr:`timeline`, the bytes of each of :data:`CATEGORIES` (in
    that order) at the interval's highest point; they sum to the interval's bytes. An
    allocation counts as one category for its whole life (the first a mark gave it while
    it was alive: a gradient from its allocation in the backward pass, though it is known
    as one at the optimizer's step), so the peak's interval has :attr:`categories_at_peak`.
    None where the device has no event log."""
    exact: bool = True
    """False where the peak comes from sampling (process RAM off Linux)."""
    steps: tuple[Step, ...] = ()
    """The training steps, in order (see :attr:`RunRecord.steps_by`); empty where none
    ended or the device has no event log (its peak laps do not say where a step ends)."""
    growth: Growth | None = None
    """Memory that rises at the end of each step, where it does."""
    what_if: WhatIf | None = None
    """GPUs only: the recorded allocator history replayed through the model of the caching
    allocator: the fragmentation at the peak (reserved but not allocated, the largest free
    block) and the reserved peak under other allocator settings."""


@dataclass(frozen=True)
class RunRecord:
    """Where a run's memory went: the report of :func:`torchmem.record` and ``torchmem run``."""

    devices: dict[str, DeviceRun]
    """Per device, keyed by its device string, in the order: GPUs, ``"cpu"``, ``"ram"``."""
    modules: tuple[ModulePeak, ...]
    """Each module that ran, in the order of first call."""
    duration: float
    """Seconds recorded."""
    exit_code: int | None = None
    """The script's exit code (``torchmem run``); None for a recorded block."""
    command: tuple[str, ...] = ()
    """The script and its arguments (``torchmem run``)."""
    notes: tuple[str, ...] = field(default=())
    """What the report could not see, in one sentence each."""
    phases: tuple[Phase, ...] = ()
    """The forward passes, backward passes and optimizer steps, in time order (one per
    phase for the whole run: linear in its length, a few per training step)."""
    steps_by: str | None = None
    """What ends a step in :attr:`DeviceRun.steps`: ``"optimizer.step()"`` (where it
    returns), ``"backward"`` (a run with no optimizer: where a backward pass through the
    outermost modules ends) or ``"forward"`` (neither: where a forward call of the first
    outermost module returns); None where no step ended."""
    workers: Workers | None = None
    """The DataLoader workers seen and their peak RSS, where the recording measured
    process RAM on Linux; None where it did not look."""

    @property
    def growth(self) -> Growth | None:
        """The main device's growth, else another device's, else None."""
        runs = sorted(self.devices.values(), key=lambda r: r.device != self.main_device)
        return next((run.growth for run in runs if run.growth is not None), None)

    @property
    def main_device(self) -> str:
        """The device the top-level answers are about: the first GPU, else ``"cpu"``,
        else the only one recorded."""
        for name in self.devices:
            if name != "ram":
                return name
        return next(iter(self.devices), "ram")

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (``torchmem run --json``); bytes are ints, times floats."""
        main = self.devices.get(self.main_device)
        return {
            "exit_code": self.exit_code,
            "command": list(self.command),
            "duration_s": self.duration,
            "main_device": self.main_device,
            "devices": {name: _device_json(run) for name, run in self.devices.items()},
            "sites_at_peak": [s.to_json() for s in main.sites_at_peak] if main else [],
            "largest_at_peak": [_held_json(h) for h in main.largest_at_peak] if main else [],
            "modules": [
                {
                    "name": m.name,
                    "type": m.type,
                    "device": m.device,
                    "forward_peak_bytes": m.forward_peak_bytes,
                    "backward_peak_bytes": m.backward_peak_bytes,
                    "calls": m.calls,
                    "forward_kept_bytes": m.forward_kept_bytes,
                    "backward_rise_bytes": m.backward_rise_bytes,
                }
                for m in self.modules
            ],
            "phases": [{"kind": p.kind, "start_s": p.start, "end_s": p.end} for p in self.phases],
            "steps_by": self.steps_by,
            "workers": None if self.workers is None else self.workers.to_json(),
            "growth": None if self.growth is None else self.growth.to_json(),
            "timeline": {
                name: [[t, b] for t, b in run.timeline] for name, run in self.devices.items()
            },
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        """The record that :meth:`to_json` wrote (another rank's report, a saved file).

        Raises:
            ValueError: `data` is not such a report; the message names what is missing.
        """
        try:
            timelines = data["timeline"]
            devices = {
                name: _device_from_json(name, entry, timelines.get(name, ()))
                for name, entry in data["devices"].items()
            }
            modules = tuple(
                ModulePeak(
                    m["name"],
                    m["type"],
                    m["device"],
                    m["forward_peak_bytes"],
                    m["backward_peak_bytes"],
                    m["calls"],
                    m.get("forward_kept_bytes", 0),  # older reports: none
                    m.get("backward_rise_bytes"),
                )
                for m in data["modules"]
            )
            phases = tuple(
                Phase(p["kind"], p["start_s"], p["end_s"]) for p in data.get("phases", ())
            )
            return cls(
                devices,
                modules,
                data["duration_s"],
                exit_code=data["exit_code"],
                command=tuple(data["command"]),
                notes=tuple(data["notes"]),
                phases=phases,
                steps_by=data.get("steps_by"),
                workers=Workers.from_json(data["workers"]) if data.get("workers") else None,
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a torchmem run report: {type(exc).__name__}: {exc}") from None


def _held_json(held: Held) -> dict[str, Any]:
    return {
        "name": held.name,
        "bytes": held.bytes,
        "category": held.category,
        "shape": list(held.shape) if held.shape is not None else None,
        "dtype": held.dtype,
        "site": held.site,
    }


def _device_json(run: DeviceRun) -> dict[str, Any]:
    return {
        "start_bytes": run.start_bytes,
        "peak_bytes": run.peak_bytes,
        "peak_time_s": run.peak_time,
        "end_bytes": run.end_bytes,
        "reserved_peak_bytes": run.reserved_peak_bytes,
        "exact": run.exact,
        "categories_at_peak": run.categories_at_peak,
        "categories_at_end": run.categories_at_end,
        "sites_at_peak": [s.to_json() for s in run.sites_at_peak],
        "largest_at_peak": [_held_json(h) for h in run.largest_at_peak],
        "others_at_peak": {"count": run.others_at_peak[0], "bytes": run.others_at_peak[1]},
        "timeline_categories": (
            None
            if run.timeline_categories is None
            else [list(row) for row in run.timeline_categories]
        ),
        "steps": [step.to_json() for step in run.steps],
        "growth": None if run.growth is None else run.growth.to_json(),
        "what_if": None if run.what_if is None else run.what_if.to_json(),
    }


def _device_from_json(name: str, entry: dict[str, Any], timeline: Any) -> DeviceRun:
    others = entry.get("others_at_peak") or {"count": 0, "bytes": 0}  # older reports: none
    layers = entry.get("timeline_categories")
    return DeviceRun(
        name,
        entry["start_bytes"],
        entry["peak_bytes"],
        entry["peak_time_s"],
        entry["end_bytes"],
        tuple((t, b) for t, b in timeline),
        categories_at_peak=entry["categories_at_peak"],
        categories_at_end=entry["categories_at_end"],
        sites_at_peak=tuple(Site.from_json(s) for s in entry["sites_at_peak"]),
        largest_at_peak=tuple(
            Held(**{**h, "shape": None if h["shape"] is None else tuple(h["shape"])})
            for h in entry["largest_at_peak"]
        ),
        others_at_peak=(others["count"], others["bytes"]),
        reserved_peak_bytes=entry["reserved_peak_bytes"],
        timeline_categories=None if layers is None else tuple(map(_seven, layers)),
        exact=entry["exact"],
        steps=tuple(_step(step) for step in entry.get("steps", ())),  # older reports: none
        growth=None if entry.get("growth") is None else Growth.from_json(entry["growth"]),
        what_if=None if entry.get("what_if") is None else WhatIf.from_json(entry["what_if"]),
    )


def _step(data: dict[str, Any]) -> Step:
    return Step(
        data["index"],
        data["start_bytes"],
        data["peak_bytes"],
        data["end_bytes"],
        data["start_s"],
        data["end_s"],
        data["count"],
        data.get("ram_bytes"),  # older reports: none
    )


def _seven(row: list[int]) -> tuple[int, ...]:
    """A row of :attr:`DeviceRun.timeline_categories`; older reports' rows have no
    ``communication`` column (their sixth is ``other``)."""
    return (*row[:4], 0, *row[4:]) if len(row) == len(CATEGORIES) - 1 else tuple(row)
