"""pytorch_memlab's global line profiler and its decorators: ``profile``,
``profile_every``, ``set_target_gpu``, ``clear_global_line_profiler``."""

from __future__ import annotations

import atexit
import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from torchmem.lines.columns import check_columns
from torchmem.lines.profiler import LineProfiler
from torchmem.lines.wrapping import wrap_calls

F = TypeVar("F", bound=Callable[..., Any])

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

    Use as ``@profile`` or ``@profile(columns=[...])``, on a function, a generator, a
    coroutine or an async generator function, or above ``@staticmethod`` or
    ``@classmethod``. The report shows, for each line, the highest peak over all calls
    and the summed change; a function that never ran prints ``No data collected``.
    Profiling is on only while the function runs (each step, for a generator). The
    report goes to ``sys.stdout``, to ``sys.stderr`` where that is gone at exit, and
    nowhere where both are.

    Raises:
        ValueError: naming an unknown column, and listing the valid ones.
        TypeError: naming what has no Python code to profile (a builtin, a class).
    """
    chosen = None if columns is None else check_columns(columns, _global_device())

    def decorate(f: F) -> F:
        profiler = global_line_profiler()
        profiler.add_function(f)
        atexit.register(_print_at_exit, profiler, _function_of(f), chosen)
        return profiler.wrap_function(f)

    return decorate if func is None else decorate(func)


def profile_every(
    output_interval: int = 1, enable: bool = True, columns: Iterable[str] | None = None
) -> Callable[[F], F]:
    """Profile a function line by line, and print the report after every
    `output_interval`-th call (the records keep adding up across calls). A call of a
    generator or an async generator function ends when it is exhausted or closed; it
    may be used above ``@staticmethod`` or ``@classmethod``.

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
        function = _function_of(func)
        calls = 0

        @contextlib.contextmanager
        def counted() -> Iterator[None]:
            nonlocal calls
            try:
                yield
            finally:
                calls += 1
                if calls % output_interval == 0:
                    profiler.print_stats(function, chosen)

        return wrap_calls(func, each_call=counted, each_step=lambda: profiler)

    return decorate


def _function_of(func: Any) -> Any:
    """The function a ``staticmethod`` or ``classmethod`` holds; else `func`."""
    return func.__func__ if isinstance(func, staticmethod | classmethod) else func


def _print_at_exit(
    profiler: LineProfiler, func: Callable[..., Any], columns: tuple[str, ...] | None
) -> None:
    """:func:`profile`'s report, at exit: on ``sys.stdout``, or on ``sys.stderr`` where
    stdout is ``None``, closed or broken; never an error of its own."""
    text = str(profiler.display(func, columns))
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # closed (ValueError), or a broken pipe
            continue
        return


def _global_device() -> str | None:
    return None if _global is None or _global.device is None else str(_global.device)
