"""The line profiler: the memory each line of the watched functions peaked and kept.

pytorch_memlab's ``LineProfiler`` on peak windows (see :mod:`~torchmem.lines.state`),
on a GPU through the caching allocator and on CPU tensors through the tensor meter alike.
Only the watched functions pay per line: on Python 3.12+ ``sys.monitoring`` sends events
for their code objects alone (:mod:`~torchmem.lines.monitoring`); before that, a
``sys.settrace`` hook hands every other frame back to whatever tracer was installed
before (:mod:`~torchmem.lines.settrace`).
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO, TypeVar, cast

import torch

from torchmem.lines.columns import check_columns
from torchmem.lines.monitoring import Monitoring
from torchmem.lines.settrace import Settrace
from torchmem.lines.state import ProfilerState, WatchedFunction
from torchmem.lines.wrapping import wrap_calls
from torchmem.meters import Meter, meter
from torchmem.records.lines import FunctionRecord
from torchmem.resolve import DeviceLike, default_device, parse_device, resolve_device

F = TypeVar("F", bound=Callable[..., Any])


class LineReport:
    """What :meth:`LineProfiler.display` returns: the records and the columns to show.

    Prints as text (``str``, ``repr``), and shows as an HTML table in Jupyter.
    """

    def __init__(self, functions: Sequence[FunctionRecord], columns: Sequence[str]) -> None:
        self.functions = tuple(functions)
        """The functions shown, each with every line."""
        self.columns = tuple(columns)
        """The stat columns shown, in order."""

    def __str__(self) -> str:
        from torchmem.render import lines

        return lines.text(self.functions, self.columns)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from torchmem.render import lines

        return lines.html(self.functions, self.columns)


class LineProfiler:
    """Profile the memory of watched functions line by line.

    Each line gets the peak of the memory in use while it ran (the functions it calls
    included), the memory in use when it ended, and what it allocated, freed and kept
    (``delta``). A line that runs many times shows its highest peak and its summed
    change, and how many times it ran (``hits``).

    Use it as a context manager, or call :meth:`enable` and :meth:`disable`; show the
    result with :meth:`display` (text in a terminal, HTML in Jupyter) or
    :meth:`print_stats`. Threads started while it is enabled are profiled too.

    Args:
        *functions: the functions (or methods) to watch; more with :meth:`add_function`.
        target_gpu: the CUDA device to measure when `device` is not given, as an index
            or ``torch.device``; ignored where CUDA is not available.
        device: what to measure, as for :func:`torchmem.meter`: ``"cuda:1"``,
            ``"cpu"`` (CPU tensors, exact), ``"ram"`` (the process's resident memory).
            Default: ``target_gpu``'s allocator where CUDA is available, else CPU tensors.

    Raises:
        TypeError: naming a function that has no Python code to trace.
        ValueError: naming a bad `target_gpu` or `device`.
    """

    def __init__(
        self,
        *functions: Callable[..., Any],
        target_gpu: int | torch.device = 0,
        device: DeviceLike | None = None,
    ) -> None:
        if device is not None:
            meter(device)  # a bad device fails here, naming itself
        self._settings = _Settings(device, _gpu_index(target_gpu))
        self._recording = ProfilerState(self._settings.meter)
        # The tracer holds the recording while profiling is on, never the profiler: one
        # dropped while enabled is switched off, and the tracers before it are back.
        weakref.finalize(self, _switch_off, self._recording)
        for function in functions:
            self.add_function(function)

    # Set-up -----------------------------------------------------------------------

    @property
    def device(self) -> DeviceLike | None:
        """What to measure (see the class); None: `target_gpu`'s allocator where CUDA is
        available, else CPU tensors."""
        return self._settings.device

    @device.setter
    def device(self, device: DeviceLike | None) -> None:
        self._settings.device = device

    @property
    def target_gpu(self) -> int:
        """The CUDA device index measured when no `device` was given."""
        return self._settings.target_gpu

    @target_gpu.setter
    def target_gpu(self, gpu_id: int | torch.device) -> None:
        self._settings.target_gpu = _gpu_index(gpu_id)

    @property
    def meter(self) -> Meter:
        """The meter lines are measured with (see `device` and `target_gpu`)."""
        return self._settings.meter()

    @property
    def default_columns(self) -> tuple[str, ...]:
        """The columns :meth:`display` shows unless told otherwise: :data:`DEFAULT_COLUMNS`
        on a GPU, ``active_bytes.all.peak`` and ``active_bytes.all.delta`` on tensors,
        ``rss.peak`` and ``rss.delta`` for ``"ram"``."""
        return check_columns(None, self._settings.measured())

    @property
    def enabled(self) -> bool:
        """True while profiling is on in any thread."""
        return bool(self._recording.depth)

    def add_function(self, func: Callable[..., Any]) -> None:
        """Watch `func` (a function, method, or a function wrapped with ``functools.wraps``).

        Raises:
            TypeError: naming `func`, if it has no Python code (a builtin, a class).
        """
        code = _code_of(func)
        functions = self._recording.functions
        if id(code) not in functions:
            qualname = getattr(inspect.unwrap(func), "__qualname__", code.co_name)
            functions[id(code)] = WatchedFunction(code, qualname)
            if self._recording.backend is not None:
                self._recording.backend.update()

    def clear(self) -> None:
        """Forget the watched functions and everything recorded."""
        self._recording.functions.clear()

    # Switching on and off -----------------------------------------------------------

    def enable(self) -> None:
        """Start profiling in this thread (and in threads started from now on).

        Calls nest: each :meth:`enable` needs its :meth:`disable`. The tracer that was
        installed before (a debugger, coverage) keeps receiving all its events.
        """
        thread = threading.get_ident()
        recording = self._recording
        with recording.lock:
            depths = recording.depth
            depth = depths.get(thread, 0)
            first = not depths
            depths[thread] = depth + 1
            if first:
                recording.backend = Monitoring.join(recording) or Settrace.join(recording)
            if depth == 0 and recording.backend is not None:
                recording.backend.enter_thread()

    def disable(self) -> None:
        """Stop profiling in this thread; the previous tracer, if any, is back in place.

        Calls of the watched functions still running in this thread (all threads, when
        this was the last thread profiling) stop being measured: their windows close, and
        their frames are let go.
        """
        thread = threading.get_ident()
        recording = self._recording
        with recording.lock:
            depths = recording.depth
            depth = depths.get(thread, 0) - 1
            if depth < 0:
                return
            if depth:
                depths[thread] = depth
                return
            del depths[thread]
            last = not depths
            backend = recording.backend
            if backend is not None:
                backend.leave_thread()
                if last:
                    backend.stop()
                    recording.backend = None
            # Calls still running here (disable() called inside a watched function, or a
            # debugger took over their frames), and after the last disable() calls running
            # in other threads, whose events may never come again.
            calls = [c for c in list(recording.running.values()) if last or c.thread == thread]
        for call in calls:
            call.end()

    def __enter__(self) -> LineProfiler:
        self.enable()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.disable()

    # Results --------------------------------------------------------------------------

    def records(self, func: _Selection = None) -> list[FunctionRecord]:
        """The recorded lines of the watched functions (all, or those `func` selects:
        a function, a qualified name, or a list of either), in the order they were added."""
        wanted = _selector(func)
        return [f.record() for f in self._recording.functions.values() if wanted(f)]

    def display(self, func: _Selection = None, columns: Iterable[str] | None = None) -> LineReport:
        """The report: text when printed, an HTML table in Jupyter.

        Args:
            func: a function, a qualified name, or a list of either; default all.
            columns: column names (see :func:`valid_columns`); default the device's:
                :data:`DEFAULT_COLUMNS` on a GPU, ``active_bytes.all.peak`` and
                ``active_bytes.all.delta`` on CPU tensors.

        Raises:
            ValueError: naming an unknown column, and listing the valid ones.
        """
        return LineReport(self.records(func), check_columns(columns, self._settings.measured()))

    def print_stats(
        self,
        func: _Selection = None,
        columns: Iterable[str] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        """Write the text report to `stream` (default ``sys.stdout``); see :meth:`display`."""
        (stream or sys.stdout).write(str(self.display(func, columns)))

    def to_dataframe(self) -> Any:
        """Every recorded line as a ``pandas.DataFrame`` (pandas must be installed): one
        row per source line, with ``function``, ``filename``, ``line``, ``code``, ``hits``
        and a column per recorded stat (empty for lines that never ran)."""
        from torchmem.render import lines

        return lines.dataframe(self.records())

    # Decorating -----------------------------------------------------------------------

    def wrap_function(self, func: F) -> F:
        """`func`, profiled while it runs: each step of a generator or an async generator,
        the whole await of a coroutine; a ``staticmethod`` or ``classmethod`` gives the same
        kind of method back. Add it with :meth:`add_function` to record its lines."""
        return wrap_calls(func, each_step=lambda: self)


class _Settings:
    """What a profiler measures, kept apart from it: its recording asks for the meter at
    each call, and what the tracer holds must not hold the profiler."""

    def __init__(self, device: DeviceLike | None, target_gpu: int) -> None:
        self.device = device
        self.target_gpu = target_gpu

    def measured(self) -> DeviceLike:
        """The device measured: `device`, else `target_gpu` where CUDA is available."""
        if self.device is not None:
            return self.device
        default = default_device()
        return torch.device("cuda", self.target_gpu) if default.type == "cuda" else default

    def meter(self) -> Meter:
        return meter(self.measured())


def _switch_off(recording: ProfilerState) -> None:
    """Switch off a dropped profiler's `recording`, if it is on, in every thread: its hook
    leaves this thread now, the other threads it was on in at their next call once no
    profiler is on (only a thread can change its own tracer); the calls it was measuring
    stop being measured."""
    with recording.lock:
        backend, recording.backend = recording.backend, None
        if backend is None:
            return
        if threading.get_ident() in recording.depth:
            backend.leave_thread()
        recording.depth.clear()
        backend.stop()
        calls = list(recording.running.values())
    for call in calls:
        call.end()


_Selected = Callable[..., Any] | str
_Selection = _Selected | Sequence[_Selected] | None


def _selector(func: _Selection) -> Callable[[WatchedFunction], bool]:
    if func is None:
        return lambda f: True
    items = list(func) if isinstance(func, list | tuple) else [cast(_Selected, func)]
    names = {item for item in items if isinstance(item, str)}
    codes = {id(_code_of(item)) for item in items if not isinstance(item, str)}
    return lambda f: f.qualname in names or id(f.code) in codes


def _code_of(func: Callable[..., Any]) -> types.CodeType:
    target = inspect.unwrap(func)
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise TypeError(f"cannot profile {func!r}: it has no Python code to trace")
    return code


def _gpu_index(gpu_id: int | torch.device) -> int:
    """A CUDA device index, checked against the visible ones where CUDA is available."""
    try:
        if isinstance(gpu_id, str) or parse_device(gpu_id).type != "cuda":
            raise ValueError("expected a CUDA device index or device")
        device = resolve_device(gpu_id) if torch.cuda.is_available() else parse_device(gpu_id)
    except ValueError as exc:
        raise ValueError(f"invalid target GPU {gpu_id!r}: {exc}") from None
    return device.index or 0
