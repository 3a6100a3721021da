"""What a line profiler records, and the calls it is measuring: the state its event back
ends (:mod:`~torchmem.lines.settrace`, :mod:`~torchmem.lines.monitoring`) report to.

Every call of a watched function gets its own peak window on the meter, restarted at each
line, so a line's peak is exactly the highest use while it ran (the functions it called
included), and nested, recursive and threaded calls each see their own.

On the counting CPU allocator (the CPU's meter), which lines read on every line event, a
line reads its counters as one list and restarts the window only where they moved: a line
that allocated, freed and adopted nothing stayed at its start's bytes.
"""

from __future__ import annotations

import linecache
import threading
import types
from collections.abc import Callable
from typing import Protocol

from torchmem.lines.columns import with_aliases
from torchmem.meters import CpuAllocatorMeter, Meter, Window
from torchmem.meters.cpu import COUNTS, counters_of
from torchmem.records.lines import FunctionRecord, LineRecord


class ProfilerState:
    """A line profiler's watched functions, what their lines recorded, and the calls being
    measured now. The back ends look functions up by code object and report each call's
    lines and end to its :class:`Call`."""

    def __init__(self, meter: Callable[[], Meter]) -> None:
        self.meter = meter
        """The meter a call starting now is measured with."""
        self.functions: dict[int, WatchedFunction] = {}
        """The watched functions, by ``id()`` of their code object."""
        self.running: dict[object, Call] = {}
        """The calls being measured, by a key of their back end's choosing (never the
        frame object under ``sys.settrace``: that would keep its locals alive)."""
        self.depth: dict[int, int] = {}
        """Thread -> how many times profiling is enabled in it; empty while disabled."""
        self.lock = threading.RLock()
        """Guards :attr:`depth` and what the lines record."""
        self.backend: Backend | None = None
        """Where the events come from while profiling is on (made by the first enable)."""


class Backend(Protocol):
    """Where a profiler's events come from while it is enabled: made when it is first
    enabled, stopped when it is last disabled."""

    def enter_thread(self) -> None:
        """Profiling starts in this thread."""

    def leave_thread(self) -> None:
        """Profiling stops in this thread."""

    def update(self) -> None:
        """The watched functions changed."""

    def stop(self) -> None:
        """Profiling stops everywhere."""


class WatchedFunction:
    """A watched function and what its lines recorded so far."""

    def __init__(self, code: types.CodeType, qualname: str) -> None:
        self.code = code
        self.qualname = qualname
        self.lines: dict[int, LineTally] = {}

    def record(self) -> FunctionRecord:
        """Every source line of the function, with what it recorded."""
        code = self.code
        numbers = [n for _, _, n in code.co_lines() if n is not None]
        last = max(numbers, default=code.co_firstlineno)
        span = range(code.co_firstlineno, last + 1)
        source = {n: linecache.getline(code.co_filename, n) for n in span}
        if not any(source.values()):  # no source (a REPL, exec'd text): the lines that ran
            source = {n: "" for n in sorted(self.lines)}
        rows = []
        for n, text in source.items():
            line = self.lines.get(n)
            hits, stats = (line.hits, with_aliases(line.values)) if line else (0, {})
            rows.append(LineRecord(n, text.rstrip("\r\n"), hits, stats))
        return FunctionRecord(self.qualname, code.co_filename, tuple(rows))


class LineTally:
    """What one source line recorded over its runs."""

    __slots__ = ("counted", "hits", "values")

    def __init__(self) -> None:
        self.hits = 0
        self.values: dict[str, int] = {}
        self.counted = False
        """True once :attr:`values` has every column :meth:`add_counts` adds to."""

    def add(self, peaks: dict[str, int], start: dict[str, int], end: dict[str, int]) -> None:
        """One more run of the line: the window's `peaks`, and the meter's counters at
        its `start` and `end`."""
        self.hits += 1
        values = self.values
        for stat, value in peaks.items():
            key = _PEAK.get(stat) or _PEAK.setdefault(stat, f"{stat}.peak")
            if value > values.get(key, -1):
                values[key] = value
        for key, value in end.items():
            change = value - start.get(key, value)
            delta = _DELTA.get(key)
            if delta is None:
                delta = _DELTA.setdefault(key, _delta_key(key))
            if delta:  # a current value: keep its highest, and add up its changes
                if value > values.get(key, -1):
                    values[key] = value
                key = delta
            values[key] = values.get(key, 0) + change

    def add_counts(self, peak: int, counts: list[int], start: list[int]) -> None:
        """:meth:`add` for the counting CPU allocator: the line's `peak`, and the meter's
        :attr:`~torchmem.meters.CpuAllocatorMeter.counts` at its end and `start` (the same
        list where they did not move). The same values, without the dicts."""
        values = self.values
        if not self.counted:  # the first run adds the columns, in add()'s order
            self.add({COUNTS[1]: peak}, counters_of(start), counters_of(counts))
            self.counted = all(column in values for column in _COUNT_COLUMNS)
            return
        self.hits += 1
        if peak > values[_PEAK_COLUMN]:
            values[_PEAK_COLUMN] = peak
        current = counts[0]
        if current > values[_CURRENT_COLUMN]:
            values[_CURRENT_COLUMN] = current
        if counts is start:
            return  # every change is 0
        values[_DELTA_COLUMN] += current - start[0]
        values[_ALLOCATED_COLUMN] += counts[2] - start[2]
        values[_FREED_COLUMN] += counts[3] - start[3]
        values[_ALLOCATIONS_COLUMN] += counts[4] - start[4]
        values[_FREES_COLUMN] += counts[5] - start[5]


# Column names, made once per stat rather than on every line.
_PEAK: dict[str, str] = {}
_DELTA: dict[str, str] = {}


def _delta_key(key: str) -> str:
    """``"x.current"`` -> ``"x.delta"``; ``""`` for a running total (``allocated``, ``freed``)."""
    stat, _, part = key.rpartition(".")
    return f"{stat}.delta" if part == "current" else ""


# The columns add() makes of the counting allocator's counts, in the order it adds them.
_PEAK_COLUMN = f"{COUNTS[1]}.peak"
_CURRENT_COLUMN, _DELTA_COLUMN = COUNTS[0], _delta_key(COUNTS[0])
_ALLOCATED_COLUMN, _FREED_COLUMN, _ALLOCATIONS_COLUMN, _FREES_COLUMN = COUNTS[2:6]
_COUNT_COLUMNS = (_PEAK_COLUMN, _CURRENT_COLUMN, _DELTA_COLUMN, *COUNTS[2:6])


class Call:
    """One running call of a watched function: its window, and the line it is on.

    Its events come from its own thread; :meth:`end` may also come from another one (the
    thread that disables the profiler), so a lock of its own orders the two.
    """

    __slots__ = (
        "allocator",
        "ended",
        "function",
        "key",
        "line",
        "lock",
        "meter",
        "read_counts",
        "recording",
        "start",
        "start_counts",
        "thread",
        "window",
    )

    def __init__(
        self, recording: ProfilerState, function: WatchedFunction, key: object = None
    ) -> None:
        self.recording = recording
        self.function = function
        self.key = self if key is None else key
        """Its key in :attr:`ProfilerState.running`."""
        self.thread = threading.get_ident()
        self.lock = threading.Lock()
        self.ended = False
        """True once :meth:`end` ran: it measures nothing more."""
        self.meter: Meter | None = None
        self.window: Window | None = None
        self.line = 0
        self.start: dict[str, int] = {}
        self.allocator: CpuAllocatorMeter | None = None
        """The meter, where it is the counting CPU allocator's: read through its counts
        (:attr:`read_counts`), and :attr:`start_counts` in place of :attr:`start`."""
        self.read_counts: Callable[[], list[int]] = list
        """:attr:`allocator`'s :attr:`~torchmem.meters.CpuAllocatorMeter.counts`, kept here:
        one lookup less on every line."""
        self.start_counts: list[int] = []

    def at_line(self, lineno: int) -> None:
        """The call reached line `lineno`: charge what happened since the last line to it."""
        with self.lock:
            window = self.window
            if window is None:
                # Ended, or started before disable() and now just winding down.
                if self.ended or not self.recording.depth:
                    return
                self._open()
            elif self.allocator is not None:  # the CPU's meter: no dicts
                # A lap only where the counts moved: a line that allocated, freed and
                # adopted nothing (most lines of most code) stayed at its start's bytes,
                # which is what a lap would find.
                start = self.start_counts
                counts = self.read_counts()
                if counts == start:
                    self._count(counts[0], start)
                else:
                    self._count(*self.allocator.lap_counts(window, counts))
            else:
                self._charge(*window.lap_with_counters())
            self.line = lineno

    def _open(self) -> None:
        meter = self.meter = self.recording.meter()
        self.window = meter.window()
        if isinstance(meter, CpuAllocatorMeter):
            self.allocator = meter
            self.read_counts = meter.counts
            self.start_counts = meter.counts()
        else:
            self.start = meter.counters()

    def end(self) -> None:
        """The call returned, raised, yielded, or stopped being measured (in any thread)."""
        self.recording.running.pop(self.key, None)
        with self.lock:
            self.ended = True
            window, self.window = self.window, None
            if window is None:
                return
            if self.allocator is not None:
                peak, counts = self.allocator.lap_counts(window)
                window.close()
                self._count(peak, counts)
                return
            peaks, end = window.lap_with_counters()
            window.close()
            self._charge(peaks, end)

    def _charge(self, peaks: dict[str, int], end: dict[str, int]) -> None:
        """Charge what happened since the line started (`peaks`, and `end` against the
        counters at its start) to that line."""
        lines = self.function.lines
        with self.recording.lock:
            line = lines.get(self.line)
            if line is None:
                line = lines[self.line] = LineTally()
            line.add(peaks, self.start, end)
        self.start = end

    def _count(self, peak: int, counts: list[int]) -> None:
        """:meth:`_charge` for the counting CPU allocator: the line's `peak`, and the
        meter's counts at its end (:attr:`start_counts` itself where they did not move)."""
        lines = self.function.lines
        with self.recording.lock:
            line = lines.get(self.line)
            if line is None:
                line = lines[self.line] = LineTally()
            line.add_counts(peak, counts, self.start_counts)
        self.start_counts = counts
