"""Memory limits for tests: measure part of a test on some devices, and judge its limits.

The pytest plugin (:mod:`torchmem.pytest_plugin`) reads a test's markers with
:func:`limit_memory` and :func:`limit_leaks`, measures with a :class:`Span`, and asks the
span for a :class:`~torchmem.records.limits.Verdict`; nothing here knows pytest.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from dataclasses import replace

from torchmem.meters import Meter, Window
from torchmem.recorder import Recording
from torchmem.records.limits import Limit, Usage, Verdict
from torchmem.records.tensors import TensorRecord
from torchmem.resolve import DeviceLike, resolve_device
from torchmem.tensors import MemReporter, diff
from torchmem.units import parse_size

TOP = 10
"""How many lines, allocations and modules a failure's explanation lists."""


def device_name(device: DeviceLike | None) -> str:
    """The device a limit measures, as a string: ``"ram"`` for the process, else
    :func:`~torchmem.resolve_device`'s (``None``: the current GPU, else ``"cpu"``).

    Raises:
        ValueError: naming the device, if this machine does not have it.
    """
    return "ram" if device == "ram" else str(resolve_device(device))


def limit_memory(
    limit: int | str, *, device: DeviceLike | None = None, setup: bool = False
) -> Limit:
    """The limit ``@pytest.mark.limit_memory(...)`` stands for: the test fails if its peak
    on `device` rises more than `limit` above what was in use when it started.

    Args:
        limit: bytes, or a size string read as :func:`~torchmem.units.parse_size` reads it
            (``"24 MB"``, ``"1.5 GiB"``; every prefix is a power of 1024).
        device: ``None`` (the current GPU, else CPU tensors), ``"cpu"``, ``"cuda:1"``,
            ``"ram"`` (the process's resident memory), ...
        setup: also charge the test's fixtures: measure from before their setup.

    Raises:
        ValueError: naming the bad limit or device.
    """
    return _limit("limit_memory", limit, device, setup)


def limit_leaks(
    limit: int | str, *, device: DeviceLike | None = None, setup: bool = False
) -> Limit:
    """The limit ``@pytest.mark.limit_leaks(...)`` stands for: the test fails if, after it
    returns and after ``gc.collect()``, more than `limit` bytes more are in use on
    `device` than when it started. Arguments as :func:`limit_memory`'s; with `setup`, from
    before the fixtures' setup until after their teardown."""
    return _limit("limit_leaks", limit, device, setup)


def _limit(kind: str, limit: int | str, device: DeviceLike | None, setup: object) -> Limit:
    if not isinstance(setup, bool):
        raise ValueError(f"invalid setup {setup!r}: expected True or False")
    return Limit(kind, parse_size(limit), device_name(device), setup)


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
            return Verdict(limit, found.usage, run, report.modules)
        if limit.kind == "limit_leaks" and self._tensors is not None:
            after = MemReporter().snapshot(self._tensors)
            return Verdict(limit, found.usage, stayed=diff(self._before, after).appeared)
        return found
