"""The ``sys.settrace`` back end, for Python before 3.12 (and where ``sys.monitoring`` has
no free tool id): a global trace function per thread that traces the watched functions'
frames and hands every other frame back to the tracer installed before (a debugger,
coverage.py), or to none."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from torchmem.lines.recording import Call, Recording, WatchedFunction

TraceFunction = Any
"""A ``sys.settrace`` trace function (``None`` for none)."""


class TracedCall(Call):
    """A call traced through ``sys.settrace``: also the frame's local trace function, which
    forwards every event to the tracer that was installed before ours, if it traces this
    frame too."""

    __slots__ = ("chained",)

    def __init__(
        self, recording: Recording, function: WatchedFunction, chained: TraceFunction
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


def _hook(recording: Recording, chained: TraceFunction) -> TraceFunction:
    """The global trace function for one thread: it traces the watched functions' frames
    and leaves every other frame to `chained`, the tracer that was there before (or to
    none). A plain function, as it runs on every Python call: the cheapest thing to call.
    """
    functions, running, depth = recording.functions, recording.running, recording.depth

    def hook(frame: types.FrameType, event: str, arg: Any) -> Any:
        # Only "call" events reach a global trace function.
        local = chained(frame, event, arg) if chained is not None else None
        if depth:
            function = functions.get(id(frame.f_code))
            if function is not None:
                call = TracedCall(recording, function, local)
                running[call] = call
                return call
        return local

    return hook


class Settrace:
    """Installs the trace hooks of one profiler: in each thread that enables it, and,
    through ``threading.settrace``, in threads started while it is enabled. Leaving puts
    back the tracer that was there before, where ours is still the one installed."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.hooks: dict[int, tuple[TraceFunction, TraceFunction]] = {}
        """Thread -> (our hook there, the trace function it chains to)."""
        self.chained = threading.gettrace()
        self.thread_hook = _hook(recording, self.chained)
        threading.settrace(self.thread_hook)

    def enter_thread(self) -> None:
        """Profiling starts in this thread."""
        chained = sys.gettrace()
        hook = _hook(self.recording, chained)
        self.hooks[threading.get_ident()] = hook, chained
        sys.settrace(hook)

    def leave_thread(self) -> None:
        """Profiling stops in this thread."""
        hook, chained = self.hooks.pop(threading.get_ident(), (None, None))
        if hook is not None and sys.gettrace() is hook:
            sys.settrace(chained)

    def update(self) -> None:
        """The watched functions changed: the hooks look them up on every call anyway."""

    def stop(self) -> None:
        """Profiling stops everywhere: threads started from now on are not traced."""
        if threading.gettrace() is self.thread_hook:
            threading.settrace(self.chained)
