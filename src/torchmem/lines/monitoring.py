"""The ``sys.monitoring`` back end, Python 3.12+: events from the watched code objects
alone, in every thread, through one tool id shared by all enabled profilers. Unwatched
code runs untouched, and ``sys.settrace`` tracers are not involved at all."""

from __future__ import annotations

import sys
import types
from typing import Any

from torchmem._compat import getframe
from torchmem.lines.state import Call, ProfilerState


class Monitoring:
    """The one user of a ``sys.monitoring`` tool id in this process, serving every
    enabled profiler's recording. Made by the first :meth:`join`, gone after the last
    :meth:`stop`."""

    def __init__(self, api: Any, tool: int) -> None:
        self.api = api
        """``sys.monitoring``."""
        self.tool = tool
        self.recordings: list[ProfilerState] = []
        self.codes: list[types.CodeType] = []

    @classmethod
    def join(cls, recording: ProfilerState) -> MonitoredRecording | None:
        """Send `recording` this process's events; None where ``sys.monitoring`` is missing
        (Python < 3.12) or has no free tool id (use :class:`~torchmem.lines.settrace.Settrace`
        then)."""
        global _active
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            return None
        if _active is None:
            free = [t for t in (3, 4) if monitoring.get_tool(t) is None]
            if not free:
                return None
            _active = cls(monitoring, free[0])
            _active._start()
        _active.recordings.append(recording)
        _active.update()
        return MonitoredRecording(_active, recording)

    def leave(self, recording: ProfilerState) -> None:
        global _active
        if recording not in self.recordings:
            return
        self.recordings.remove(recording)
        self.update()
        if not self.recordings and _active is self:
            self._stop()
            _active = None

    def _start(self) -> None:
        monitoring = self.api
        events = monitoring.events
        monitoring.use_tool_id(self.tool, "torchmem")
        for event, callback in (
            (events.PY_START, self._enter),
            (events.PY_RESUME, self._enter),
            (events.LINE, self._line),
            (events.PY_RETURN, self._exit),
            (events.PY_YIELD, self._exit),
            (events.PY_UNWIND, self._exit),
        ):
            monitoring.register_callback(self.tool, event, callback)
        # Unwinding is a process-wide event only; it fires when an exception leaves a frame.
        monitoring.set_events(self.tool, events.PY_UNWIND)

    def _stop(self) -> None:
        monitoring = self.api
        monitoring.set_events(self.tool, 0)
        for event in (
            monitoring.events.PY_START,
            monitoring.events.PY_RESUME,
            monitoring.events.LINE,
            monitoring.events.PY_RETURN,
            monitoring.events.PY_YIELD,
            monitoring.events.PY_UNWIND,
        ):
            monitoring.register_callback(self.tool, event, None)
        monitoring.free_tool_id(self.tool)

    def update(self) -> None:
        """Switch local events on for the code of every recording, off elsewhere."""
        monitoring = self.api
        events = monitoring.events
        wanted = {id(f.code): f.code for r in self.recordings for f in r.functions.values()}
        local = events.PY_START | events.PY_RESUME | events.LINE | events.PY_RETURN
        for code in self.codes:
            if id(code) not in wanted:
                monitoring.set_local_events(self.tool, code, 0)
        for code in wanted.values():
            monitoring.set_local_events(self.tool, code, local | events.PY_YIELD)
        self.codes = list(wanted.values())

    # The callbacks run in the watched frame's thread; its frame is the caller's.

    def _enter(self, code: types.CodeType, offset: int) -> None:
        frame = getframe(1)
        for recording in self.recordings:
            function = recording.functions.get(id(code))
            if function is not None and recording.depth:
                recording.running[frame] = Call(recording, function, frame)

    def _line(self, code: types.CodeType, lineno: int) -> None:
        frame = getframe(1)
        for recording in self.recordings:
            call = recording.running.get(frame)
            if call is None:  # resumed by throw(), which starts no PY_RESUME
                function = recording.functions.get(id(code))
                if function is None or not recording.depth:
                    continue
                call = recording.running[frame] = Call(recording, function, frame)
            call.at_line(lineno)

    def _exit(self, code: types.CodeType, offset: int, value: object) -> None:
        frame = getframe(1)
        for recording in self.recordings:
            call = recording.running.get(frame)
            if call is not None:
                call.end()


_active: Monitoring | None = None


class MonitoredRecording:
    """One recording's membership of the process's :class:`Monitoring`: the
    :class:`~torchmem.lines.state.Backend` its profiler drives."""

    def __init__(self, monitoring: Monitoring, recording: ProfilerState) -> None:
        self.monitoring = monitoring
        self.recording = recording

    def enter_thread(self) -> None:
        """Events come from every thread already."""

    def leave_thread(self) -> None:
        """Events come from every thread until :meth:`stop`."""

    def update(self) -> None:
        self.monitoring.update()

    def stop(self) -> None:
        self.monitoring.leave(self.recording)
