"""The ``sys.settrace`` back end, for Python before 3.12 (and where ``sys.monitoring`` has
no free tool id): one global trace function per thread, shared by every enabled profiler,
that traces the watched functions' frames and hands every event to the tracer installed
before it (a debugger, coverage.py), or to none.

One hook per thread, whatever the number of profilers, so that profilers enabled and
disabled in any order leave the tracer that was there before the first one in place.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from torchmem.lines.state import Call, ProfilerState, WatchedFunction

TraceFunction = Any
"""A ``sys.settrace`` trace function (``None`` for none)."""


class TracedCall(Call):
    """A call traced through ``sys.settrace``: also the frame's local trace function, which
    forwards every event to the tracer that was installed before ours, if it traces this
    frame too."""

    __slots__ = ("chained",)

    def __init__(
        self, recording: ProfilerState, function: WatchedFunction, chained: TraceFunction
    ) -> None:
        super().__init__(recording, function)
        self.chained = chained

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.chained is not None:
            self.chained = self.chained(frame, event, arg)
        if event == "line":
            self.at_line(frame.f_lineno)
        elif event == "return":
            self.end()
            return self.chained
        return self


class ThreadTrace:
    """Our trace hook in one thread, and the trace function it forwards events to."""

    __slots__ = ("chained", "entered", "hook", "started")

    def __init__(self, tracer: Settrace, chained: TraceFunction, started: bool) -> None:
        self.chained = chained
        """The tracer that would be installed in this thread without ours."""
        self.entered = 0
        """How many times profiling was enabled in this thread, and not yet disabled."""
        self.started = started
        """True in a thread started while profiling: its hook stays until profiling stops."""
        self.hook = _hook(tracer, self)


def _hook(tracer: Settrace, thread: ThreadTrace) -> TraceFunction:
    """The global trace function of one thread: it traces the watched functions' frames
    and forwards every event to ``thread.chained``. A plain function, as it runs on every
    Python call: the cheapest thing to call.
    """
    if thread.chained is None:
        # Nothing to forward to, now or later (a tracer installed after ours replaces it):
        # the hook of most threads. It reads the frame's code and the tracer's one watched
        # code, and nothing more (each variable of a closure costs each call too).

        def alone(frame: types.FrameType, event: str, arg: Any) -> Any:
            # Only "call" events reach a global trace function.
            code = frame.f_code
            only = tracer.only
            if code is only:
                return tracer.trace(frame, None)
            if only is None:  # several functions watched, or none
                return tracer.look_up(frame, thread)
            return None

        return alone

    recordings, watched = tracer.recordings, tracer.watched
    gettrace, settrace = sys.gettrace, sys.settrace
    chained = thread.chained  # kept here too: a closure's variable is quicker to read

    def hook(frame: types.FrameType, event: str, arg: Any) -> Any:
        nonlocal chained
        # Only "call" events reach a global trace function.
        local = None
        if chained is not None:
            local = chained(frame, event, arg)
            now = gettrace()
            if now is not hook:
                # coverage.py's C tracer installs itself again (the C way) on every call
                # event it is handed, and its thread starter puts its real tracer in its
                # place: that is now the tracer to forward to, behind ours.
                chained = thread.chained = now
                settrace(hook)
        if not recordings:  # every profiler is off: step aside
            if gettrace() is hook:
                settrace(chained)
            return local
        code = frame.f_code
        only = tracer.only
        if code is only or (only is None and id(code) in watched):
            return tracer.trace(frame, local)
        return local

    return hook


_lock = threading.Lock()
"""Guards the making and the end of :data:`_active`, and its threads."""


class Settrace:
    """The trace hooks of every enabled profiler's recording: one in each thread that
    enabled one, and, through ``threading.settrace``, one in each thread started while one
    is enabled. Made by the first :meth:`join`, gone after the last :meth:`leave`."""

    __slots__ = ("only", "recordings", "thread_chained", "thread_hook", "threads", "watched")

    def __init__(self) -> None:
        self.recordings: list[ProfilerState] = []
        self.watched: set[int] = set()
        """``id()`` of every watched code object."""
        self.only: types.CodeType | None = None
        """The watched code object, where there is one (None for several, or none): the
        hooks compare each call's code with it, an identity test, where looking up its
        ``id()`` in :attr:`watched` makes an int and probes a set on every Python call."""
        self.threads: dict[int, ThreadTrace] = {}
        self.thread_chained = threading.gettrace()
        """The tracer for new threads that was there before ours."""
        self.thread_hook = self._thread_hook()

    @classmethod
    def join(cls, recording: ProfilerState) -> TracedRecording:
        """Trace the watched functions of `recording` from now on."""
        global _active
        with _lock:
            if _active is None:
                _active = cls()
                threading.settrace(_active.thread_hook)
            _active.recordings.append(recording)
            _active.update()
            return TracedRecording(_active, recording)

    def leave(self, recording: ProfilerState) -> None:
        global _active
        with _lock:
            if recording in self.recordings:
                self.recordings.remove(recording)
            self.update()
            if self.recordings or _active is not self:
                return
            _active = None
            if threading.gettrace() is self.thread_hook:
                threading.settrace(self.thread_chained)
            # Hooks left in threads started meanwhile step aside at their next call.

    def update(self) -> None:
        """The watched functions changed."""
        codes = {key: f.code for r in self.recordings for key, f in r.functions.items()}
        self.watched.intersection_update(codes)
        self.watched.update(codes)
        self.only = next(iter(codes.values())) if len(codes) == 1 else None

    def trace(self, frame: types.FrameType, local: TraceFunction) -> TraceFunction:
        """A watched function's call: trace its frame for each recording watching it, in
        front of `local`, the frame's trace function of the tracer there before ours."""
        key = id(frame.f_code)
        traced = local
        for recording in self.recordings:
            function = recording.functions.get(key)
            if function is not None and recording.depth:
                traced = TracedCall(recording, function, traced)
                recording.running[traced] = traced
        if traced is not local:
            # A tracer that does not measure this file (coverage.py) turns its line
            # events off; the profiler needs them.
            frame.f_trace_lines = True
        return traced

    def look_up(self, frame: types.FrameType, thread: ThreadTrace) -> TraceFunction:
        """A call in `thread`, which has no tracer to forward to, while several functions
        are watched, or none: traced if watched; once every profiler is off, the thread's
        hook steps aside."""
        if id(frame.f_code) in self.watched:
            return self.trace(frame, None)
        if not self.recordings and sys.gettrace() is thread.hook:
            sys.settrace(None)
        return None

    def enter_thread(self) -> None:
        """A profiler starts in this thread: our hook goes in front of its tracer."""
        ident = threading.get_ident()
        with _lock:
            thread = self.threads.get(ident)
            if thread is None or sys.gettrace() is not thread.hook:
                # A thread that reused a dead one's id, or one whose hook was replaced.
                thread = self.threads[ident] = ThreadTrace(self, sys.gettrace(), False)
                sys.settrace(thread.hook)
            thread.entered += 1

    def leave_thread(self) -> None:
        """A profiler stops in this thread: after the last one, the tracer that was there
        before is back, where ours is still the one installed."""
        ident = threading.get_ident()
        with _lock:
            thread = self.threads.get(ident)
            if thread is None or thread.entered == 0:
                return
            thread.entered -= 1
            if thread.entered or thread.started:
                return
            del self.threads[ident]
            if sys.gettrace() is thread.hook:
                sys.settrace(thread.chained)

    def _thread_hook(self) -> TraceFunction:
        """The trace function ``threading`` installs in each new thread: it puts that
        thread's own hook in its place, and hands it the first event."""

        def start_thread(frame: types.FrameType, event: str, arg: Any) -> Any:
            thread = ThreadTrace(self, self.thread_chained, True)
            self.threads[threading.get_ident()] = thread
            sys.settrace(thread.hook)
            return thread.hook(frame, event, arg)

        return start_thread


_active: Settrace | None = None


class TracedRecording:
    """One recording's membership of the process's :class:`Settrace`: the
    :class:`~torchmem.lines.state.Backend` its profiler drives."""

    def __init__(self, tracer: Settrace, recording: ProfilerState) -> None:
        self.tracer = tracer
        self.recording = recording

    def enter_thread(self) -> None:
        self.tracer.enter_thread()

    def leave_thread(self) -> None:
        self.tracer.leave_thread()

    def update(self) -> None:
        self.tracer.update()

    def stop(self) -> None:
        self.tracer.leave(self.recording)
