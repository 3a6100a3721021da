"""Tracing a block: how much memory it left used, and how far above that it peaked.

``MemTrace`` is fastai's ``GPUMemTrace`` on a peak window, so its peak is exact (no
polling thread) and traces nested inside each other do not disturb one another.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, overload

from torchmem.lines.wrapping import wrap_calls
from torchmem.meters import Window, meter
from torchmem.resolve import DeviceLike
from torchmem.units import b2mb

F = TypeVar("F", bound=Callable[..., Any])


class _SilentSwitch:
    """What ``MemTrace.silent`` returns: true while silent, and callable the way the seed
    documents it (``mtrace.silent()``, ``mtrace.silent(False)``)."""

    def __init__(self, trace: MemTrace) -> None:
        self._trace = trace

    def __call__(self, silent: bool = True) -> None:
        self._trace._silent = bool(silent)

    def __bool__(self) -> bool:
        return self._trace._silent

    def __eq__(self, other: object) -> bool:
        return bool(self) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._trace._silent)


class MemTrace:
    """Trace the memory used and peaked by code, as deltas; also ``GPUMemTrace``.

    Tracing starts when the object is created. ``data()`` gives ``(delta_used,
    delta_peaked)`` in whole MB, ``report()`` prints them:

    - *delta used*: memory in use now (or at :meth:`stop`) minus at the start;
    - *delta peaked*: how far the peak rose above both the start and the end, i.e. the
      size of the blip the code needed beyond what it kept. Never negative.

    Args:
        silent: make :meth:`report` and :meth:`report_n_reset` print nothing.
        ctx: a note added to every report line, e.g. the function traced.
        on_exit_report: print a report (``ctx: exit``) when a ``with`` block ends.
        device: what to measure, as for :func:`torchmem.meter`: ``"cuda:1"``, ``"cpu"``
            (CPU tensors), ``"ram"`` (process RAM); default the current CUDA device, else
            CPU tensors.
    """

    def __init__(
        self,
        silent: bool = False,
        ctx: str | None = None,
        on_exit_report: bool = True,
        device: DeviceLike | None = None,
    ) -> None:
        self.meter = meter(device)
        """The meter traced."""
        self.ctx = ctx
        self.on_exit_report = on_exit_report
        self._silent = bool(silent)
        self._window: Window | None = None
        self._frozen: tuple[int, int] = (0, 0)
        self.start()

    # Running ------------------------------------------------------------------------

    def start(self) -> None:
        """Start tracing anew from the current use (a running trace restarts)."""
        if self._window is None:
            self._window = self.meter.window()
        else:
            self._window.restart()

    def stop(self) -> None:
        """Stop tracing and freeze :meth:`data` at this point. Stopping twice is harmless."""
        if self._window is not None:
            self._frozen = self._measure()
            self._window.close()
            self._window = None

    def reset(self) -> None:
        """Restart the deltas at the current use; a stopped trace starts again."""
        self.start()

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._window is not None

    # Results ------------------------------------------------------------------------

    def _measure(self) -> tuple[int, int]:
        """(used delta, peak rise) in bytes, now."""
        window = self._window
        if window is None:
            return self._frozen
        return self.meter.used() - window.start, window.peak() - window.start

    @property
    def used_bytes(self) -> int:
        """Delta used, in bytes: use now (or at stop) minus use at the start."""
        return self._measure()[0]

    @property
    def peak_bytes(self) -> int:
        """How far the peak rose above the start, in bytes."""
        return self._measure()[1]

    @property
    def peaked_bytes(self) -> int:
        """Delta peaked, in bytes: how far the peak rose above both start and end."""
        used, peak = self._measure()
        return peak - max(used, 0)

    def data(self) -> tuple[int, int]:
        """``(delta_used, delta_peaked)`` in whole MB (MiB, truncated like ``b2mb``)."""
        return b2mb(self.used_bytes), b2mb(self.peaked_bytes)

    # Reports ------------------------------------------------------------------------

    @property
    def silent(self) -> _SilentSwitch:
        """True while reports are silenced. Set it (``mtrace.silent = True``) or call it
        (``mtrace.silent()``, ``mtrace.silent(False)``)."""
        return _SilentSwitch(self)

    @silent.setter
    def silent(self, value: bool) -> None:
        self._silent = bool(value)

    def __repr__(self) -> str:
        from torchmem.render import trace

        return trace.text(*self.data())

    def report(self, subctx: str | None = None) -> None:
        """Print delta used and peaked in MB, with `ctx` and `subctx` as a note, unless
        silent: ``△Used Peaked MB:     10      5 (ctx: subctx)``."""
        if self._silent:
            return
        from torchmem.render import trace

        print(trace.text(*self.data(), notes=(self.ctx or "", subctx or "")))

    def report_n_reset(self, subctx: str | None = None) -> None:
        """:meth:`report`, then :meth:`reset`."""
        self.report(subctx)
        self.reset()

    # Context manager ----------------------------------------------------------------

    def __enter__(self) -> MemTrace:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self.on_exit_report:
            self.report("exit")

    def __del__(self) -> None:
        if getattr(self, "_window", None) is not None:
            self.stop()


@overload
def mem_trace(func: F) -> F: ...
@overload
def mem_trace(*, device: DeviceLike | None = None) -> Callable[[F], F]: ...


def mem_trace(func: F | None = None, *, device: DeviceLike | None = None) -> F | Callable[[F], F]:
    """Decorator: trace every call of a function and report ``(qualname: exit)``; also
    ``gpu_mem_trace``.

    Use bare (``@mem_trace``) or with a device (``@mem_trace(device="cpu")``), on a
    function, a coroutine function (the trace spans its await), a generator or an async
    generator function (from its first step until it is exhausted or closed), or above
    ``@staticmethod`` or ``@classmethod``. The function's name, docstring and return value
    are kept; exceptions pass through.

    Raises:
        TypeError: naming what is not callable.
    """

    def decorate(function: F) -> F:
        held = function.__func__ if isinstance(function, staticmethod | classmethod) else function
        qualname = getattr(held, "__qualname__", repr(held))
        return wrap_calls(
            function,
            each_call=lambda: MemTrace(ctx=qualname, on_exit_report=True, device=device),
        )

    return decorate if func is None else decorate(func)


GPUMemTrace = MemTrace
gpu_mem_trace = mem_trace
