"""pytorch_memlab's global line profiler and its decorators: ``profile``,
``profile_every``, ``set_target_gpu``, ``clear_global_line_profiler``."""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from torchmem.lines.columns import check_columns
from torchmem.lines.profiler import LineProfiler

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
        return profiler.wrap_function(f)

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
        profiled = profiler.wrap_function(func)
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
