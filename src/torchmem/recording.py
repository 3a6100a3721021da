"""``torchmem.record()``: record where a block's (or a script's) memory went."""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch

from torchmem._compat import getframe
from torchmem.errors import TorchmemError, UsageError
from torchmem.events.analysis import Names, device_run, laps_run, module_peaks
from torchmem.events.growth import (
    Kept,
    asked,
    growth,
    kept,
    lasting,
    made_in_steps,
    step_records,
)
from torchmem.events.holders import holders
from torchmem.events.hooks import Watcher
from torchmem.events.notes import Notes, Variable
from torchmem.events.sources import CpuLog, CudaLog, Laps, Tallied
from torchmem.events.steps import MIN_STEADY
from torchmem.events.workers import WorkerSampler, unrecorded
from torchmem.meters import CpuAllocatorMeter, Meter, meter
from torchmem.meters.ram import RamMeter
from torchmem.meters.storages import Storages
from torchmem.records import TOP
from torchmem.records.frames import SiteKey
from torchmem.records.run import DeviceRun, Growth, HeldGraph, ModulePeak, RunRecord
from torchmem.records.workers import Workers
from torchmem.report import Report
from torchmem.resolve import RAM, DeviceLike, measured


@dataclass(frozen=True)
class RunReport(RunRecord, Report):
    """What :meth:`Recording.report` returns (the fields are :class:`RunRecord`'s): prints
    as text, shows as HTML in Jupyter, saves JSON and a self-contained HTML page."""

    renderer = "run"
    top: int = TOP
    """How many sites, allocations and modules the text and HTML list."""


class Recording:
    """Records every allocation and free while it is open; :meth:`report` says where the
    memory went. Made by :func:`record`; use it as a context manager, or call
    :meth:`start` and :meth:`stop`."""

    def __init__(self, device: DeviceLike | None = None, *, sites: bool = True) -> None:
        # "ram", or a device of this machine ("cuda:1"); a clear ValueError for a bad one.
        self.device = None if device is None else measured(device)
        self.sites = sites
        self._watcher: Watcher | None = None
        self._cpu: CpuLog | None = None
        self._workers: WorkerSampler | None = None
        self._seen: Workers | None = None
        self._storages: Storages | None = None
        self._received = 0
        """Storages mapped from other processes' shared memory (at the start, then while
        it recorded)."""
        self._cuda: CudaLog | None = None
        self._laps: list[Laps] = []
        self._ram_kept: Callable[[], bool] | None = None
        self._logs: list[Tallied] = []
        self._variables: dict[int, Variable] = {}
        self._kept: dict[str, Kept | None] = {}
        self._held: dict[int, str] = {}
        self._graphs: tuple[str | None, list[HeldGraph]] = (None, [])
        """The device whose growth names the graphs variables keep, and those graphs."""
        self._started = self._stopped = 0
        self._report: RunReport | None = None

    @property
    def start_ns(self) -> int:
        """``time.monotonic_ns()`` when the recording started (0 before): the origin of
        every time in its report (timelines, peak times, phases), which are seconds from
        it. Place the program's own moments on the report's time axis with it:
        ``(time.monotonic_ns() - rec.start_ns) / 1e9``."""
        return self._started

    @property
    def meters(self) -> list[Meter]:
        """The meters this recording measures, in the order its report lists them (GPUs,
        CPU tensors, process RAM); empty before :meth:`start`."""
        found = [*(self._cuda.meters if self._cuda is not None else [])]
        found += [self._cpu.meter] if self._cpu is not None else []
        return found + [laps.meter for laps in self._laps]

    @property
    def cpu_log(self) -> CpuLog | None:
        """The counting CPU allocator's log this recording tallies (its sites, its tally so
        far); None where it keeps none (another device, the fallback meter, before
        :meth:`start`)."""
        return self._cpu

    def start(self) -> Recording:
        """Start recording (once)."""
        if self._started:
            raise UsageError("this recording has started already: make a new one")
        wanted = self.device
        if wanted in (None, "cpu"):
            cpu = CpuLog(self.sites)
            if cpu.available:
                self._cpu = cpu
            else:
                self._laps.append(Laps(cpu.meter))
        if wanted is None and torch.cuda.is_available():
            self._cuda = CudaLog(list(range(torch.cuda.device_count())), self.sites)
        elif wanted is not None and wanted.startswith("cuda:"):
            self._cuda = CudaLog([int(wanted.removeprefix("cuda:"))], self.sites)
        elif wanted not in (None, "cpu", RAM):
            self._laps.append(Laps(meter(wanted)))
        if wanted in (None, RAM):
            ram = meter(RAM)
            self._laps.append(Laps(ram))
            # The program's own peak (ru_maxrss, VmHWM) is left alone: a run's is exact
            # where it is the process's highest yet, as it is for nearly every script.
            assert isinstance(ram, RamMeter)
            self._ram_kept = ram.keep_high_water_mark()
            if os.path.isdir("/proc/self/task"):
                self._workers = WorkerSampler()
        # Made before anything counts: wrapping the hooks may import Dynamo.
        watcher = Watcher() if self._cpu is not None or self._cuda is not None else None
        self._started = time.monotonic_ns()
        for laps in self._laps:
            laps.begin(self._started)
        if self._workers is not None:
            self._workers.begin(self._started)
        if self._cpu is not None:
            self._cpu.start(self._started)
            assert isinstance(self._cpu.meter, CpuAllocatorMeter)
            # Storages that other allocators make (shared memory, mapped files) count too.
            self._storages = self._cpu.meter.storages
            self._received = self._storages.received
            self._storages.watch()
        if self._cuda is not None:
            self._cuda.start(self._started)
        if watcher is not None:
            stream = self._cpu.stream if self._cpu is not None else None
            if stream is not None:
                watcher.use(log=stream.library, names=stream.names, catch_up=stream.catch_up)
            if self._cuda is not None:
                watcher.use(notes=Notes())
            self._watcher = watcher
            watcher.start()
        return self

    def stop(self, variables: Mapping[str, object] | None = None) -> None:
        """Stop recording; every hook is gone afterwards, whatever happens.

        Args:
            variables: a namespace (a script's globals, a frame's locals) whose tensors
                name the allocations they hold in the report.
        """
        if self._stopped or not self._started:
            return
        self._stopped = time.monotonic_ns()
        namespace = variables or {}
        try:
            for laps in self._laps:  # first: what follows is torchmem's, not the program's
                laps.end(self._stopped)
                if laps.device == "ram" and self._ram_kept is not None:
                    laps.exact, self._ram_kept = self._ram_kept(), None
            if self._watcher is not None:
                self._watcher.stop(namespace.values())
            self._variables = _variables(namespace)
        finally:
            if self._ram_kept is not None:
                self._ram_kept()
                self._ram_kept = None
            if self._workers is not None:
                self._seen = self._workers.end(self._stopped)
            if self._storages is not None:
                self._storages.unwatch()
                self._received = self._storages.received - self._received
            if self._cpu is not None:
                self._logs.append(self._cpu.stop())
            if self._cuda is not None:
                notes = self._watcher.notes if self._watcher is not None else None
                self._logs[:0] = self._cuda.stop(notes)
        self._explain(namespace)

    def _explain(self, namespace: Mapping[str, object]) -> None:
        """Each device's steps; where enough ended, what holds what outlives them and the
        autograd graphs the program's variables keep (the first device with steps names
        those)."""
        ram = self._watcher.phases.ram() if self._watcher else np.empty((0, 2), np.int64)
        self._kept = {found.device: kept(found, ram) for found in self._logs}
        stepped = [(f, k) for f in self._logs if (k := self._kept[f.device]) is not None]
        if not any(len(k.table) > MIN_STEADY for _, k in stepped):
            return
        wanted = [asked(k) for _, k in stepped if k.rise]
        steps_of: dict[int, int] = {}
        for found, result in stepped:
            steps_of.update(made_in_steps(found, result.table))
        self._held, graphs = holders(
            namespace, set(np.concatenate(wanted).tolist()) if wanted else set(), steps_of
        )
        self._graphs = (next((f.device for f, _ in stepped if _used(f)), None), graphs)

    def __enter__(self) -> Recording:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(_variables_of(getframe(1)))

    def save_snapshot(self, path: str | Path) -> None:
        """Write what was recorded as a PyTorch memory snapshot (the pickle
        ``torch.cuda.memory._dump_snapshot`` writes) to `path`: PyTorch's viewer
        (``pytorch.org/memory_viz``), ``torch.cuda._memory_viz`` and
        :func:`torchmem.load_snapshot` open it, for a CPU run as for a CUDA one.

        CUDA devices are PyTorch's own history (kept by the recording until it is
        dropped); CPU tensors are built from the counting allocator's log: each allocation
        alive at the end is a segment of its own, with the line that made it as its frame.

        Raises:
            RuntimeError: the recording has not stopped.
            TorchmemError: nothing recorded has an event log (process RAM only, or CPU
                tensors on the fallback meter: see ``torchmem build``).
        """
        import pickle

        from torchmem.events.export import snapshot

        if not self._stopped:
            raise UsageError("stop the recording (leave its with-block) before saving it")
        cpu = next((log for log in self._logs if log.device == "cpu"), None)
        cuda = self._cuda.history if self._cuda is not None else None
        if cpu is None and cuda is None:
            raise TorchmemError(
                "nothing this recording holds has an event log (process RAM, or CPU"
                " tensors on the fallback meter: see `torchmem build`): no snapshot to save"
            )
        with open(path, "wb") as file:
            pickle.dump(snapshot(cpu, cuda), file)

    def sites_alive(self, device: str) -> dict[int, SiteKey]:
        """Where the allocations on `device` still alive when the recording stopped were
        made: data pointer -> site, ``(file, line, function)`` with its ``stack``, for
        those made while it recorded, where it recorded sites (none for a device without
        an event log).

        Raises:
            RuntimeError: the recording has not stopped.
        """
        if not self._stopped:
            raise UsageError("stop the recording (leave its with-block) before reading it")
        found: dict[int, SiteKey] = {}
        for log in self._logs:
            if log.device == device:
                live = log.tally.live
                for ptr, site in zip(live.ptr.tolist(), live.site.tolist(), strict=True):
                    if site in log.sites:
                        found[ptr] = log.sites[site]
        return found

    def growth(self, device: str) -> Growth | None:
        """Where memory on `device` rose at the end of each training step, by how much,
        from which lines and why (see :attr:`DeviceRun.growth`); None where it did not, or
        `device` has no event log. Less work than :meth:`report` (a failing test's
        explanation asks for it).

        Raises:
            RuntimeError: the recording has not stopped.
        """
        if not self._stopped:
            raise UsageError("stop the recording (leave its with-block) before reading it")
        watcher = self._watcher or Watcher()
        for found in self._logs:
            result = self._kept.get(found.device)
            if found.device == device and result is not None:
                return self._growth(found, result, watcher, Names(watcher))
        return None

    def report(self, top: int = TOP) -> RunReport:
        """Where the memory went: per device the peak, when, the end, the categories at
        the peak and the end, the lines whose allocations were alive at the peak, the
        largest allocations then, and each module's forward and backward peak.

        Args:
            top: how many sites, allocations and modules to list (the text and the JSON).
        """
        if not self._stopped:
            raise UsageError("stop the recording (leave its with-block) before its report")
        if top < 1:
            raise ValueError(f"top must be at least 1, not {top!r}")
        watcher = self._watcher or Watcher()
        names = Names(watcher)
        devices: dict[str, DeviceRun] = {}
        modules: tuple[ModulePeak, ...] = ()
        notes = []
        steps_by: str | None = None
        for found in self._logs:
            tally = found.tally
            if not _used(found):
                continue  # a GPU this run did not use
            run = device_run(found, self._stopped, names, watcher.names, self._variables, top)
            result = self._kept.get(found.device)
            if result is not None:
                steps_by = steps_by or result.table.by
                run = self._with_steps(run, found, result, watcher, names)
            devices[found.device] = run
            if not modules and watcher.modules:
                modules = module_peaks(
                    tally, found.device, watcher.modules, names.modules, watcher.calls
                )
            notes.extend(_log_notes(found))
        notes.extend(_compiled(watcher))
        for laps in self._laps:
            devices[laps.device] = laps_run(laps)
            if laps.device == "cpu":
                notes.append(
                    "CPU tensors were measured by the fallback meter: no categories, sites"
                    " or modules (see `torchmem build`)."
                )
        if self._cuda is not None:
            notes.extend(self._cuda.notes)
            devices = _what_ifs(devices, self._cuda.history)
        if self._cpu is not None and self.sites and not self._cpu.records_sites:
            notes.append(
                "CPU allocation sites were not recorded: they need Python 3.10 to 3.13 with"
                " the GIL, and Python's headers where torchmem was built."
            )
        duration = (self._stopped - self._started) / 1e9
        return RunReport(
            devices,
            modules,
            duration,
            notes=(*notes, *unrecorded(self._received, self._seen)),
            phases=watcher.phases.read(self._started),
            steps_by=steps_by,
            workers=self._seen,
            top=top,
        )

    def _with_steps(
        self, run: DeviceRun, found: Tallied, result: Kept, watcher: Watcher, names: Names
    ) -> DeviceRun:
        """`run` with its steps and its growth, where it grows."""
        listed = step_records(result.table, self._started)
        return replace(run, steps=listed, growth=self._growth(found, result, watcher, names))

    def _growth(
        self, found: Tallied, result: Kept, watcher: Watcher, names: Names
    ) -> Growth | None:
        labels = {key: names.label(key) for key in watcher.modules}
        forwards = watcher.phases.forwards()
        device, graphs = self._graphs
        held = lasting(graphs, result.table) if found.device == device else ()
        return growth(found, result, watcher.names, labels, forwards, self._held, held)


def _what_ifs(
    devices: dict[str, DeviceRun], history: dict[str, Any] | None
) -> dict[str, DeviceRun]:
    """`devices` with each GPU's allocator history (`history`, ``_snapshot()``'s) replayed
    under other allocator settings: its fragmentation at the peak, the reserved peak each
    would give (:func:`torchmem.estimator.whatif.what_if`; linear in the history, which
    keeps at most :data:`~torchmem.events.sources.CUDA_ENTRIES` actions)."""
    if history is None:
        return devices
    from torchmem.estimator.whatif import what_if

    return {
        name: (
            replace(run, what_if=what_if(history, device=int(name.removeprefix("cuda:"))))
            if name.startswith("cuda:")
            else run
        )
        for name, run in devices.items()
    }


def _used(found: Tallied) -> bool:
    """Whether the run used the device of `found` (a GPU with nothing allocated on it and
    nothing alive is left out of the report)."""
    tally = found.tally
    return not found.device.startswith("cuda") or bool(tally.events or tally.base)


def _compiled(watcher: Watcher) -> list[str]:
    """The note on compiled modules, where some ran."""
    if "OptimizedModule" not in watcher.modules.values():
        return []
    return [
        "Compiled modules ran (torch.compile): each call is measured from the outside,"
        " its allocations and peak counted under its OptimizedModule; the modules"
        " inside are not seen one by one (the graph is the one compiled without us)."
    ]


def _log_notes(found: Tallied) -> list[str]:
    """What a reader of the report must know of a device's log: what it did not keep, or
    could not log."""
    tally = found.tally
    notes = []
    if tally.dropped:
        notes.append(
            f"{found.device}: {tally.events:,} allocations and frees were tallied as"
            " they happened; kept are those alive at the peak and at the end, the"
            " highest use per interval and per module, and (for --snapshot) the"
            f" last {tally.events - tally.dropped:,}."
        )
    if found.lost_rows:
        notes.append(
            f"{found.device}: {found.lost_rows:,} allocations and frees could not be"
            " logged (out of memory): this device's figures may be off (meter('cpu')"
            " itself stayed exact)."
        )
    if found.lost_notes:
        notes.append(
            f"{found.device}: the oldest {found.lost_notes:,} marks of what tensors"
            " were (parameters, gradients, ...) were not kept: allocations made"
            " before them and freed since may count as other."
        )
    return notes


def record(device: DeviceLike | None = None, *, sites: bool = True) -> Recording:
    """Record where memory goes while a block runs; then ``rec.report()`` says.

    ``with torchmem.record() as rec: train()`` then ``print(rec.report())``.

    Args:
        device: the device to record: ``"cpu"`` (CPU tensors), ``"cuda:0"``, ``"ram"``
            (process memory), ...; None (the default) records every GPU, CPU tensors
            and process RAM, and reports the ones used.
        sites: record the line of the user's code that made each allocation (a frame
            walk per allocation). Off, the recording costs less and the report lists no
            sites.

    Models, optimizers and the tensors autograd saves are found through PyTorch's
    global hooks while the block runs; nothing needs naming.
    """
    return Recording(device, sites=sites)


def _variables(namespace: Mapping[str, object]) -> dict[int, Variable]:
    found: dict[int, Variable] = {}
    for name, value in namespace.items():
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            try:
                storage = value.untyped_storage()
                ptr = storage.data_ptr()
                whole = (
                    value.storage_offset() == 0
                    and value.numel() * value.element_size() == storage.nbytes()
                )
            except Exception:  # no storage
                continue
            if ptr and ptr not in found:
                # A view of part of its storage does not give the allocation's shape.
                shape, dtype = (tuple(value.shape), str(value.dtype)) if whole else (None, None)
                found[ptr] = Variable(name, shape, dtype)
    return found


def _variables_of(frame: FrameType) -> dict[str, object]:
    """The variables `frame`'s code sees: its globals, and its locals over them.

    Before Python 3.13, reading a function's ``f_locals`` leaves a snapshot of its locals
    on the frame, which holds everything they held alive until the function returns (a
    tensor ``del``-ed after the recording would not be freed): the snapshot is emptied
    once read (the next read of it, ``locals()`` or a debugger's, takes it anew). A
    module's, a class body's or ``exec``'s locals are the namespace itself: left alone.
    """
    local = frame.f_locals
    found = {**frame.f_globals, **local}
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        local.clear()
    return found
