"""Memory limits for tests: measure part of a test on some devices, and judge its limits.

The pytest plugin (:mod:`torchmem.pytest_plugin`) reads a test's markers with
:func:`limit_memory` and :func:`limit_leaks`, measures with a :class:`Span`, and asks the
span for a :class:`~torchmem.records.limits.Verdict`; nothing here knows pytest.
"""

from __future__ import annotations

import gc
import linecache
import os
import re
import threading
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from torchmem._compat import getframe, thread_frames
from torchmem.meters import Meter, TensorMeter, Window, meter
from torchmem.recording import Recording
from torchmem.records import TOP
from torchmem.records.frames import SiteKey, shown
from torchmem.records.limits import Elsewhere, Limit, Origin, Usage, Verdict
from torchmem.records.run import Site
from torchmem.records.tensors import TensorRecord
from torchmem.resolve import RAM, DeviceLike, measured
from torchmem.tensors import MemReporter, diff
from torchmem.units import parse_size


def limit_memory(
    limit: int | str,
    *,
    device: DeviceLike | None = None,
    setup: bool = False,
    current_thread_only: bool = False,
) -> Limit:
    """The limit ``@pytest.mark.limit_memory(...)`` stands for: the test fails if its peak
    on `device` rises more than `limit` above what was in use when it started.

    Args:
        limit: bytes, or a size string read as :func:`~torchmem.units.parse_size` reads it
            (``"24 MB"``, ``"1.5 GiB"``; every prefix is a power of 1024).
        device: ``None`` (the current GPU, else CPU tensors), ``"cpu"``, ``"cuda:1"``,
            ``"ram"`` (the process's resident memory), ...
        setup: also charge the test's fixtures: measure from before their setup.
        current_thread_only: count only the tensor storages that the test's thread (and
            the autograd threads it starts) makes, as pytest-memray's keyword of that
            name, instead of every thread's; not for ``"ram"``.

    Raises:
        ValueError: naming the bad limit, device or flag.
    """
    return _limit("limit_memory", limit, device, setup, current_thread_only)


def limit_leaks(
    limit: int | str,
    *,
    device: DeviceLike | None = None,
    setup: bool = False,
    current_thread_only: bool = False,
) -> Limit:
    """The limit ``@pytest.mark.limit_leaks(...)`` stands for: the test fails if, after it
    returns and after ``gc.collect()``, more than `limit` bytes more are in use on
    `device` than when it started. Arguments as :func:`limit_memory`'s; with `setup`, from
    before the fixtures' setup until after their teardown."""
    return _limit("limit_leaks", limit, device, setup, current_thread_only)


def _limit(
    kind: str, limit: int | str, device: DeviceLike | None, setup: bool, thread: bool
) -> Limit:
    for name, value in (("setup", setup), ("current_thread_only", thread)):
        if not isinstance(value, bool):  # a marker's arguments are not type-checked
            raise ValueError(f"invalid {name} {value!r}: expected True or False")
    name = measured(device)
    if thread and name == RAM:
        raise ValueError(
            "current_thread_only=True cannot measure device 'ram': the process's resident"
            " memory is not counted per thread"
        )
    return Limit(kind, parse_size(limit), name, setup, thread)


class Span:
    """Measures part of a test: an exact peak window on each device, and what a failure
    of its limits needs explained.

    Args:
        meters: the meters to read (``meter(device)`` of each device measured).
        record: a device to record while the span is open (every allocation with its
            line), so that a peak over a limit can say what held the memory.
        tensors: a device whose live tensors are listed at the start, so that a leak can
            say which tensors stayed.

    ``start()``, then ``stop(limits)``, which returns their verdicts. Where several spans
    end together, :meth:`freeze` them all first: stopping a recording makes its log, a
    tensor, which no other span's peak should see.
    """

    @classmethod
    def of(cls, limit: Limit) -> Span:
        """The span that measures `limit`: its device's meter (a tensor meter of the
        test's thread for ``current_thread_only``), and a recording of the device, which
        explains a peak or says where what stayed was allocated; for a leak, the live
        tensors listed too."""
        device = limit.device
        found = TensorMeter(device) if limit.current_thread_only else meter(device)
        leak = limit.kind == "limit_leaks"
        return cls([found], record=device, tensors=device if leak else None)

    def __init__(
        self, meters: Iterable[Meter], *, record: str | None = None, tensors: str | None = None
    ) -> None:
        self.meters = list({m.device: m for m in meters}.values())
        self.usage: dict[str, Usage] = {}
        """Per device, what its memory did: filled by :meth:`stop`."""
        self._windows: dict[str, Window] = {}
        self._recording = None if record in (None, "ram") else Recording(record)
        self._tensors = None if tensors in (None, "ram") else tensors
        self._before: list[TensorRecord] = []

    def start(self, *, collect: bool = False) -> None:
        """Open the windows (and the recording, and list the tensors); with `collect`, run
        ``gc.collect()`` first, so that garbage left by earlier code is not freed during
        the span, which would hide as much of a leak."""
        if collect:
            gc.collect()
        if self._tensors is not None:
            self._before = MemReporter().snapshot(self._tensors)
        try:
            for found in self.meters:
                self._windows[found.device] = found.window()
            if self._recording is not None:
                self._recording.start()
        except BaseException:
            self._release()
            raise

    def freeze(self) -> None:
        """Fix every peak here: close the windows (the recording goes on)."""
        for window in self._windows.values():
            window.close()

    def stop(
        self,
        limits: Iterable[Limit] = (),
        *,
        collect: bool = False,
        variables: Mapping[str, object] | None = None,
    ) -> list[Verdict]:
        """End the span, fill :attr:`usage`, and judge `limits` (of this span's devices).

        Args:
            limits: the limits to hold against what this span measured.
            collect: run ``gc.collect()`` before reading the bytes in use at the end.
            variables: names for the tensors the recording saw (a test's fixture values).

        Returns:
            A verdict per limit; a failed one carries what explains it (the recording's
            peak, or the tensors that stayed).
        """
        try:
            self.freeze()
            if collect:
                gc.collect()
            for device, window in self._windows.items():
                used = window.meter.used()
                peak = max(window.peak(), used)
                self.usage[device] = Usage(device, window.start, peak, used, window.meter.exact)
            if self._recording is not None:
                self._recording.stop(variables)
            return [self._verdict(limit) for limit in limits]
        finally:
            self._release()

    def _release(self) -> None:
        """Close the windows, stop the recording, and drop it and the tensors' list: what
        the recording keeps (its log, the models it saw) must not outlive the span."""
        try:
            self.freeze()
        finally:
            if self._recording is not None:
                self._recording.stop()
            self._recording = None
            self._before = []

    def _verdict(self, limit: Limit) -> Verdict:
        found = Verdict(limit, self.usage[limit.device])
        if found.passed:
            return found
        if limit.kind == "limit_memory" and self._recording is not None:
            report = self._recording.report(TOP)
            run = report.devices.get(limit.device)
            if run is None:
                return found
            # The recording ends after the test, holding the models it saw: its end is not
            # the test's, and the peak is what the verdict is about.
            run = replace(run, categories_at_end=None)
            elsewhere = () if limit.current_thread_only else other_threads(run.sites_at_peak)
            return replace(found, peak=run, modules=report.modules, elsewhere=elsewhere)
        if limit.kind == "limit_leaks" and self._tensors is not None:
            stayed = diff(self._before, MemReporter().snapshot(self._tensors)).appeared
            sites = {} if self._recording is None else self._recording.sites_alive(limit.device)
            named, origins = _origins(stayed, sites)
            growth = None if self._recording is None else self._recording.growth(limit.device)
            return replace(found, stayed=named, origins=origins, growth=growth)
        return found


_NUMBERED = re.compile(r"(Tensor|Parameter)\d+")
"""The names :class:`~torchmem.MemReporter` numbers tensors it knows no name for by."""


def _origins(
    stayed: Sequence[TensorRecord], sites: Mapping[int, SiteKey]
) -> tuple[tuple[TensorRecord, ...], tuple[Origin, ...]]:
    """The tensors that `stayed`, those numbered renamed after the line that allocated
    them (``Tensor@test_model.py:21``), and those lines, largest first; `sites` are the
    recording's, by data pointer."""
    named = []
    totals: dict[tuple[str, int, str], int] = {}
    for record in stayed:
        address = _address(record)
        site = None if address is None else sites.get(address)
        if site is None or not site[1]:  # a pseudo site (autograd's engine): no line
            named.append(record)
            continue
        file, line, function = site
        numbered = _NUMBERED.fullmatch(record.name)
        if numbered is not None:
            record = replace(record, name=f"{numbered[1]}@{os.path.basename(file)}:{line}")
        named.append(record)
        totals[file, line, function] = totals.get((file, line, function), 0) + record.nbytes
    origins = [
        Origin(file, line, function, linecache.getline(file, line).strip(), size)
        for (file, line, function), size in totals.items()
    ]
    origins.sort(key=lambda origin: origin.bytes, reverse=True)
    return tuple(named), tuple(origins)


def _address(record: TensorRecord) -> int | None:
    """The data pointer of the storage of `record`'s tensor, if it is alive and has one."""
    tensor = record.tensor() if record.tensor is not None else None
    if tensor is None:
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):  # no storage (sparse, nested, subclasses)
        return None


def other_threads(sites: Iterable[Site]) -> tuple[Elsewhere, ...]:
    """What threads other than the calling one allocated among `sites` (alive at a peak),
    largest first. An allocation's thread is told by the function its stack entered first
    outside ``threading``, and named after the live threads whose stacks entered that
    function too."""
    here = threading.get_ident()
    mine = _entry(_outward(getframe(0)))
    names: dict[tuple[str, str] | None, list[str]] = {}
    frames = thread_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or 0)
        if thread.ident != here and frame is not None:
            names.setdefault(_entry(_outward(frame)), []).append(thread.name)
    totals: dict[tuple[str, str], int] = {}
    for nbytes, stack in (each for site in sites for each in site.stacks):
        entry = _entry([(file, function) for file, _, function in reversed(stack)])
        if entry is not None and entry != mine:
            totals[entry] = totals.get(entry, 0) + nbytes
    found = [Elsewhere(tuple(names.get(entry, ())), size) for entry, size in totals.items()]
    return tuple(sorted(found, key=lambda other: other.bytes, reverse=True))


_THREADING = shown(threading.Thread.run.__code__.co_filename)


def _outward(frame: types.FrameType | None) -> list[tuple[str, str]]:
    """The stack from `frame` out, outermost first, as a site's stack names its frames:
    ``(file, function)``, the file as :func:`~torchmem.records.frames.shown` gives it, the
    function's qualified name where Python has one."""
    stack = []
    while frame is not None:
        code = frame.f_code
        stack.append((shown(code.co_filename), getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return stack[::-1]


def _entry(stack: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    """The first frame of an outermost-first `stack` outside ``threading`` (a thread's
    target, or the main thread's script); None for none."""
    return next((frame for frame in stack if frame[0] != _THREADING), None)
