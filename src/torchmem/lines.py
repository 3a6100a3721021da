"""The line profiler: the memory each line of the watched functions peaked and kept.

pytorch_memlab's ``LineProfiler``, ``profile``, ``profile_every`` and ``set_target_gpu``,
on peak windows. Every call of a watched function gets its own window on the meter, and
the window restarts at each line, so a line's peak is exactly the highest use while it
ran (including inside the functions it called, watched or not), on a GPU through the
caching allocator and on CPU tensors through the tensor meter alike.

Only the watched functions pay per line: on Python 3.12+ ``sys.monitoring`` sends events
for their code objects alone; before that, a ``sys.settrace`` hook hands every other
frame back to whatever tracer was installed before (a debugger, coverage.py), or to none.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import linecache
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import torch

from torchmem.meters import Meter, Window, meter

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_COLUMNS = ("active_bytes.all.peak", "reserved_bytes.all.peak")
"""pytorch_memlab's default columns, the default on a GPU: the peak of the bytes in tensors
and of the bytes the caching allocator holds, while the line ran."""

_TENSOR_DEFAULT = ("active_bytes.all.peak", "active_bytes.all.delta")
_RAM_DEFAULT = ("rss.peak", "rss.delta")

_PARTS = ("peak", "current", "allocated", "freed", "delta")
_CUDA_STATS = tuple(
    f"{family}.{pool}"
    for family in (
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
        "allocation",
        "segment",
        "active",
        "inactive_split",
    )
    for pool in ("all", "large_pool", "small_pool")
)


def valid_columns(device: str | int | torch.device | None = None) -> tuple[str, ...]:
    """The column names the line profiler can show for a device (see :class:`LineProfiler`).

    ``<stat>.peak`` is the highest value while the line ran, ``<stat>.current`` the value
    when it ended, ``<stat>.allocated`` / ``<stat>.freed`` what it allocated and freed,
    and ``<stat>.delta`` its net change (allocated minus freed). On CUDA and XPU, every
    ``torch.cuda.memory_stats()`` stat (``reserved_bytes.all``, ``allocation.large_pool``,
    ...); on tensor meters (``"cpu"``, ``"meta"``, ...) ``active_bytes.all`` and its alias
    ``allocated_bytes.all``; for ``"ram"``, ``rss`` (no allocated or freed).
    """
    kind = _kind(device)
    if kind == "ram":
        return ("rss.peak", "rss.current", "rss.delta")
    stats = _CUDA_STATS if kind == "allocator" else ("active_bytes.all", "allocated_bytes.all")
    return tuple(f"{stat}.{part}" for stat in stats for part in _PARTS)


def check_columns(
    columns: Iterable[str] | None, device: str | int | torch.device | None = None
) -> tuple[str, ...]:
    """`columns` as a tuple, or the device's default ones for ``None``.

    Raises:
        ValueError: naming the unknown columns and listing the valid ones.
    """
    if columns is None:
        kind = _kind(device)
        return {"allocator": DEFAULT_COLUMNS, "ram": _RAM_DEFAULT}.get(kind, _TENSOR_DEFAULT)
    if isinstance(columns, str):
        columns = (columns,)
    columns = tuple(columns)
    valid = valid_columns(device)
    unknown = [c for c in columns if c not in valid]
    if unknown or not columns:
        raise ValueError(
            f"unknown column(s) {', '.join(map(repr, unknown)) or '(none given)'} for device"
            f" {_device_name(device)!r}; valid columns: {', '.join(valid)}"
        )
    return columns


def _kind(device: str | int | torch.device | None) -> str:
    if device is None:
        return "allocator" if torch.cuda.is_available() else "tensor"
    if device == "ram":
        return "ram"
    if isinstance(device, int) and not isinstance(device, bool):
        return "allocator"
    return "allocator" if torch.device(device).type in ("cuda", "xpu") else "tensor"


def _device_name(device: str | int | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


# Records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineRecord:
    """One source line of a profiled function."""

    lineno: int
    """Line number in its file."""
    code: str
    """The source text of the line, without its newline; empty where the source is unknown."""
    hits: int
    """How many times the line ran (a loop header runs once more than its body)."""
    stats: dict[str, int] = field(default_factory=dict)
    """Column -> value, bytes for stats named ``*bytes*`` (counts otherwise): peaks and
    ``current`` are the maximum over the line's runs, ``allocated``, ``freed`` and ``delta``
    their sum. Empty for a line that never ran."""


@dataclass(frozen=True)
class FunctionRecord:
    """The lines of one profiled function."""

    qualname: str
    """The function's qualified name, e.g. ``Net.forward``."""
    filename: str
    """The file the function was defined in (``<ipython-input-...>`` for a notebook cell)."""
    lines: tuple[LineRecord, ...]
    """Every source line from the first decorator or ``def`` to the last line, in order."""

    @property
    def ran(self) -> bool:
        """True if any line of it ran while profiled."""
        return any(line.hits for line in self.lines)


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
        from torchmem.render.lines import lines_text

        return lines_text(self.functions, self.columns)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from torchmem.render.lines import lines_html

        return lines_html(self.functions, self.columns)


# Collecting ---------------------------------------------------------------------------


class _Function:
    """A watched function and what its lines recorded so far."""

    def __init__(self, code: types.CodeType, qualname: str) -> None:
        self.code = code
        self.qualname = qualname
        self.lines: dict[int, _Line] = {}

    def record(self) -> FunctionRecord:
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
            hits, stats = (line.hits, _with_aliases(line.values)) if line else (0, {})
            rows.append(LineRecord(n, text.rstrip("\r\n"), hits, stats))
        return FunctionRecord(self.qualname, code.co_filename, tuple(rows))


class _Line:
    __slots__ = ("hits", "values")

    def __init__(self) -> None:
        self.hits = 0
        self.values: dict[str, int] = {}

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


# Column names, made once per stat rather than on every line.
_PEAK: dict[str, str] = {}
_DELTA: dict[str, str] = {}


def _delta_key(key: str) -> str:
    """``"x.current"`` -> ``"x.delta"``; ``""`` for a running total (``allocated``, ``freed``)."""
    stat, _, part = key.rpartition(".")
    return f"{stat}.delta" if part == "current" else ""


class _Frame:
    """One running call of a watched function: its window, and the line it is on.

    Also the frame's local trace function, which forwards every event to the tracer that
    was installed before ours, if it traces this frame too.
    """

    __slots__ = (
        "chained",
        "function",
        "key",
        "line",
        "meter",
        "profiler",
        "start",
        "thread",
        "window",
    )

    def __init__(
        self, profiler: LineProfiler, function: _Function, chained: Any, key: object = None
    ) -> None:
        self.profiler = profiler
        self.function = function
        self.chained = chained
        self.key = self if key is None else key
        self.thread = threading.get_ident()
        self.meter: Meter | None = None
        self.window: Window | None = None
        self.line = 0
        self.start: dict[str, int] = {}

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.chained is not None:
            self.chained = self.chained(frame, event, arg)
        if event == "line":
            self.profiler._line(self, frame.f_lineno)
        elif event == "return":
            self.profiler._end(self)
            return self.chained
        return self


def _hook(profiler: LineProfiler, chained: Any) -> Any:
    """The global trace function for one thread: it traces the watched functions' frames
    and leaves every other frame to `chained`, the tracer that was there before (or to
    none). A plain function, as it runs on every Python call: the cheapest thing to call.
    """
    functions, running, depth = profiler._functions, profiler._running, profiler._depth

    def hook(frame: types.FrameType, event: str, arg: Any) -> Any:
        # Only "call" events reach a global trace function.
        local = chained(frame, event, arg) if chained is not None else None
        if depth:
            function = functions.get(id(frame.f_code))
            if function is not None:
                state = _Frame(profiler, function, local)
                running[state] = state  # not by frame: that would keep its locals alive
                return state
        return local

    hook.chained = chained  # type: ignore[attr-defined]
    return hook


class _Monitor:
    """Python 3.12+: ``sys.monitoring`` events from the watched code objects alone, in
    every thread, through one tool id shared by all enabled profilers. Unwatched code
    runs untouched, and ``sys.settrace`` tracers are not involved at all."""

    def __init__(self, tool: int) -> None:
        self.tool = tool
        self.profilers: list[LineProfiler] = []
        self.codes: list[types.CodeType] = []

    @classmethod
    def join(cls, profiler: LineProfiler) -> bool:
        """Send `profiler` this process's events; False where ``sys.monitoring`` is
        missing (Python < 3.12) or has no free tool id (then ``sys.settrace`` is used)."""
        global _monitor
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            return False
        if _monitor is None:
            free = [t for t in (3, 4) if monitoring.get_tool(t) is None]
            if not free:
                return False
            _monitor = cls(free[0])
            _monitor._start(monitoring)
        _monitor.profilers.append(profiler)
        _monitor.update()
        return True

    @classmethod
    def leave(cls, profiler: LineProfiler) -> None:
        global _monitor
        if _monitor is None or profiler not in _monitor.profilers:
            return
        _monitor.profilers.remove(profiler)
        _monitor.update()
        if not _monitor.profilers:
            _monitor._stop(sys.monitoring)
            _monitor = None

    def _start(self, monitoring: Any) -> None:
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

    def _stop(self, monitoring: Any) -> None:
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
        """Switch local events on for the code of every enabled profiler, off elsewhere."""
        monitoring = sys.monitoring
        events = monitoring.events
        wanted = {id(f.code): f.code for p in self.profilers for f in p._functions.values()}
        local = events.PY_START | events.PY_RESUME | events.LINE | events.PY_RETURN
        for code in self.codes:
            if id(code) not in wanted:
                monitoring.set_local_events(self.tool, code, 0)
        for code in wanted.values():
            monitoring.set_local_events(self.tool, code, local | events.PY_YIELD)
        self.codes = list(wanted.values())

    # The callbacks run in the watched frame's thread; its frame is the caller's.

    def _enter(self, code: types.CodeType, offset: int) -> None:
        frame = sys._getframe(1)
        for profiler in self.profilers:
            function = profiler._functions.get(id(code))
            if function is not None and profiler._depth:
                profiler._running[frame] = _Frame(profiler, function, None, frame)

    def _line(self, code: types.CodeType, lineno: int) -> None:
        frame = sys._getframe(1)
        for profiler in self.profilers:
            state = profiler._running.get(frame)
            if state is None:  # resumed by throw(), which starts no PY_RESUME
                function = profiler._functions.get(id(code))
                if function is None or not profiler._depth:
                    continue
                state = profiler._running[frame] = _Frame(profiler, function, None, frame)
            profiler._line(state, lineno)

    def _exit(self, code: types.CodeType, offset: int, value: object) -> None:
        frame = sys._getframe(1)
        for profiler in self.profilers:
            state = profiler._running.get(frame)
            if state is not None:
                profiler._end(state)


_monitor: _Monitor | None = None


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
        device: str | int | torch.device | None = None,
    ) -> None:
        self._functions: dict[int, _Function] = {}
        self._lock = threading.Lock()
        self._depth: dict[int, int] = {}  # thread -> nested enable() calls
        self._hooks: dict[int, Any] = {}  # thread -> its trace hook
        self._thread_hook: Any = None
        self._running: dict[object, _Frame] = {}  # the calls being measured, by frame
        self._monitored = False
        self.device = device
        self.target_gpu = _gpu_index(target_gpu)
        if device is not None:
            meter(device)  # a bad device fails here, naming itself
        for function in functions:
            self.add_function(function)

    # Set-up -----------------------------------------------------------------------

    @property
    def target_gpu(self) -> int:
        """The CUDA device index measured when no `device` was given."""
        return self._target_gpu

    @target_gpu.setter
    def target_gpu(self, gpu_id: int | torch.device) -> None:
        self._target_gpu = _gpu_index(gpu_id)

    @property
    def meter(self) -> Meter:
        """The meter lines are measured with (see `device` and `target_gpu`)."""
        if self.device is not None:
            return meter(self.device)
        if torch.cuda.is_available():
            return meter(torch.device("cuda", self._target_gpu))
        return meter("cpu")

    @property
    def enabled(self) -> bool:
        """True while profiling is on in any thread."""
        return bool(self._depth)

    def add_function(self, func: Callable[..., Any]) -> None:
        """Watch `func` (a function, method, or a function wrapped with ``functools.wraps``).

        Raises:
            TypeError: naming `func`, if it has no Python code (a builtin, a class).
        """
        code = _code_of(func)
        if id(code) not in self._functions:
            qualname = getattr(inspect.unwrap(func), "__qualname__", code.co_name)
            self._functions[id(code)] = _Function(code, qualname)
            if self._monitored and _monitor is not None:
                _monitor.update()

    def clear(self) -> None:
        """Forget the watched functions and everything recorded."""
        self._functions.clear()

    # Switching on and off -----------------------------------------------------------

    def enable(self) -> None:
        """Start profiling in this thread (and in threads started from now on).

        Calls nest: each :meth:`enable` needs its :meth:`disable`. The tracer that was
        installed before (a debugger, coverage) keeps receiving all its events.
        """
        thread = threading.get_ident()
        with self._lock:
            depth = self._depth.get(thread, 0)
            self._depth[thread] = depth + 1
            first = len(self._depth) == 1 and depth == 0
        if first:
            self._monitored = _Monitor.join(self)
            if not self._monitored:
                self._thread_hook = _hook(self, threading.gettrace())
                threading.settrace(self._thread_hook)
        if depth == 0 and not self._monitored:
            hook = self._hooks[thread] = _hook(self, sys.gettrace())
            sys.settrace(hook)

    def disable(self) -> None:
        """Stop profiling in this thread; the previous tracer, if any, is back in place."""
        thread = threading.get_ident()
        with self._lock:
            depth = self._depth.get(thread, 0) - 1
            if depth < 0:
                return
            if depth:
                self._depth[thread] = depth
                return
            del self._depth[thread]
            last = not self._depth
        hook = self._hooks.pop(thread, None)
        if hook is not None and sys.gettrace() is hook:
            sys.settrace(hook.chained)
        if last and self._monitored:
            _Monitor.leave(self)
            self._monitored = False
        if last and self._thread_hook is not None:
            if threading.gettrace() is self._thread_hook:
                threading.settrace(self._thread_hook.chained)
            self._thread_hook = None
        # Calls still running here (disable() called inside a watched function, or a
        # debugger took over their frames) stop being measured now.
        for state in [s for s in list(self._running.values()) if s.thread == thread]:
            self._end(state)

    def __enter__(self) -> LineProfiler:
        self.enable()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.disable()

    # Events from the trace hooks ------------------------------------------------------

    def _line(self, state: _Frame, lineno: int) -> None:
        if state.window is None:
            if not self._depth:  # started before disable(), now just winding down
                return
            state.meter = self.meter
            state.window = state.meter.window()
            state.start = state.meter.counters()
        else:
            self._charge(state, *state.meter._lap(state.window))
        state.line = lineno

    def _end(self, state: _Frame) -> None:
        self._running.pop(state.key, None)
        window = state.window
        if window is None:
            return
        state.window = None
        assert state.meter is not None
        peaks, end = state.meter._lap(window)
        window.close()
        self._charge(state, peaks, end)

    def _charge(self, state: _Frame, peaks: dict[str, int], end: dict[str, int]) -> None:
        """Charge what happened since the line started (`peaks`, and `end` against the
        counters at its start) to that line."""
        with self._lock:
            line = state.function.lines.get(state.line)
            if line is None:
                line = state.function.lines[state.line] = _Line()
            line.add(peaks, state.start, end)
        state.start = end

    # Results --------------------------------------------------------------------------

    def records(self, func: _Selection = None) -> list[FunctionRecord]:
        """The recorded lines of the watched functions (all, or those `func` selects:
        a function, a qualified name, or a list of either), in the order they were added."""
        wanted = _selector(func)
        return [f.record() for f in self._functions.values() if wanted(f)]

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
        device = self.device if self.device is not None else _default_device(self._target_gpu)
        return LineReport(self.records(func), check_columns(columns, device))

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
        from torchmem.render.lines import lines_dataframe

        return lines_dataframe(self.records())

    # Decorating -----------------------------------------------------------------------

    def _wrap(self, func: F) -> F:
        """`func`, profiled while it runs (each step, for a generator)."""
        if inspect.isgeneratorfunction(func):

            @functools.wraps(func)
            def generator(*args: Any, **kwargs: Any) -> Any:
                gen = func(*args, **kwargs)
                step, value = gen.send, None
                while True:
                    with self:
                        try:
                            item = step(value)
                        except StopIteration as stop:
                            return stop.value
                    try:
                        value, step = (yield item), gen.send
                    except GeneratorExit:
                        gen.close()
                        raise
                    except BaseException as exc:
                        value, step = exc, gen.throw

            return generator  # type: ignore[return-value]
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def coroutine(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await func(*args, **kwargs)

            return coroutine  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


_Selection = Callable[..., Any] | str | Sequence[Callable[..., Any] | str] | None


def _selector(func: _Selection) -> Callable[[_Function], bool]:
    if func is None:
        return lambda f: True
    items = list(func) if isinstance(func, (list, tuple)) else [func]
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


def _with_aliases(values: dict[str, int]) -> dict[str, int]:
    """A copy of `values`; tensor meters count one quantity, which CUDA reports both as
    allocated and as active bytes, so both names are given."""
    values = dict(values)
    for part in _PARTS:
        if f"allocated_bytes.all.{part}" in values:
            values.setdefault(f"active_bytes.all.{part}", values[f"allocated_bytes.all.{part}"])
    return values


def _gpu_index(gpu_id: int | torch.device) -> int:
    """A CUDA device index, checked."""
    if isinstance(gpu_id, torch.device) and gpu_id.type == "cuda":
        gpu_id = torch.cuda.current_device() if gpu_id.index is None else gpu_id.index
    if isinstance(gpu_id, bool) or not isinstance(gpu_id, int) or gpu_id < 0:
        raise ValueError(f"invalid target GPU {gpu_id!r}: expected a CUDA device index or device")
    if torch.cuda.is_available() and gpu_id >= torch.cuda.device_count():
        raise ValueError(
            f"invalid target GPU {gpu_id!r}: {torch.cuda.device_count()} CUDA device(s) visible"
        )
    return gpu_id


def _default_device(target_gpu: int) -> str:
    return f"cuda:{target_gpu}" if torch.cuda.is_available() else "cpu"


# pytorch_memlab's global profiler and decorators ----------------------------------------

_global: LineProfiler | None = None


def global_line_profiler() -> LineProfiler:
    """The profiler behind :func:`profile`, :func:`profile_every` and
    :func:`set_target_gpu`, made on first use."""
    global _global
    if _global is None:
        _global = LineProfiler()
    return _global


def clear_global_line_profiler() -> None:
    """Forget everything :func:`profile` and :func:`profile_every` recorded."""
    global_line_profiler().clear()


def set_target_gpu(gpu_id: int | torch.device) -> None:
    """Measure CUDA device `gpu_id` in :func:`profile` and :func:`profile_every` from now
    on (also from inside a profiled function). Ignored where CUDA is not available.

    Raises:
        ValueError: naming `gpu_id`, if it is not a visible CUDA device.
    """
    global_line_profiler().target_gpu = gpu_id


def profile(func: F | None = None, columns: Iterable[str] | None = None) -> F | Callable[[F], F]:
    """Profile a function line by line every time it runs; print the report at exit.

    Use as ``@profile`` or ``@profile(columns=[...])``. The report shows, for each line,
    the highest peak over all calls and the summed change; a function that never ran
    prints ``No data collected``. Profiling is on only while the function runs.

    Raises:
        ValueError: naming an unknown column, and listing the valid ones.
    """
    chosen = None if columns is None else check_columns(columns, _global_device())

    def decorate(f: F) -> F:
        profiler = global_line_profiler()
        profiler.add_function(f)
        atexit.register(profiler.print_stats, f, chosen)
        return profiler._wrap(f)

    return decorate if func is None else decorate(func)


def profile_every(
    output_interval: int = 1, enable: bool = True, columns: Iterable[str] | None = None
) -> Callable[[F], F]:
    """Profile a function line by line, and print the report after every
    `output_interval`-th call (the records keep adding up across calls).

    With ``enable=False`` the function runs unprofiled.

    Raises:
        ValueError: for an `output_interval` below 1, or an unknown column.
    """
    if not isinstance(output_interval, int) or isinstance(output_interval, bool):
        raise ValueError(f"invalid output_interval {output_interval!r}: expected an int >= 1")
    if output_interval < 1:
        raise ValueError(f"invalid output_interval {output_interval!r}: expected an int >= 1")
    chosen = None if columns is None else check_columns(columns, _global_device())

    def decorate(func: F) -> F:
        if not enable:
            return func
        profiler = global_line_profiler()
        profiler.add_function(func)
        profiled = profiler._wrap(func)
        calls = 0

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            try:
                return profiled(*args, **kwargs)
            finally:
                calls += 1
                if calls % output_interval == 0:
                    profiler.print_stats(func, chosen)

        return wrapper  # type: ignore[return-value]

    return decorate


def _global_device() -> str | None:
    return None if _global is None or _global.device is None else str(_global.device)
