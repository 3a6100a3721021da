"""Cost of the line profiler, per traced line, against memory_profiler and line_profiler.

Each contender watches the same function line by line: torchmem's ``LineProfiler``,
memory_profiler's (what its ``@profile`` does, reading the process's memory through
psutil at every line), and line_profiler's, which measures time only and so is the
floor of any line tracer. Contenders run in the same process, alternating, repeated;
the table shows the median time and its ratio to the unprofiled run. A contender whose
package is not installed shows as such.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

import torchmem
from benchmarks import meters, timing

Work = Callable[[], None]


def linears(n: int = 200, device: str = "cpu") -> Work:
    """`n` constructions of ``torch.nn.Linear(16, 16)``: a loop of many short lines, each
    running a lot of unwatched Python (module set-up, parameter initialisation)."""

    def run() -> None:
        for _ in range(n):
            torch.nn.Linear(16, 16, device=device)
        meters.synchronize(device)

    return run


def mlp_step(device: str = "cpu") -> Work:
    """One training step of the MLP of :mod:`benchmarks.meters`, a line per stage."""
    model, opt, x, y = meters.mlp(device)

    def run() -> None:
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        meters.synchronize(device)

    run()  # Adam's state exists from here on
    return run


Bind = Callable[[Work, str], Callable[[], contextlib.AbstractContextManager]]
"""Given the work and its device: a context that profiles it."""


def unprofiled(work: Work, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    return contextlib.nullcontext


def torchmem_lines(work: Work, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: torchmem.LineProfiler(work, device=device)


def memory_profiler_lines(
    work: Work, device: str
) -> Callable[[], contextlib.AbstractContextManager]:
    import memory_profiler

    @contextlib.contextmanager
    def profiled() -> Iterator[None]:
        prof = memory_profiler.LineProfiler(backend="psutil")
        prof.add_function(work)
        prof.enable_by_count()
        try:
            yield
        finally:
            prof.disable_by_count()

    return profiled


def line_profiler_lines(work: Work, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    import line_profiler

    @contextlib.contextmanager
    def profiled() -> Iterator[None]:
        prof = line_profiler.LineProfiler(work)
        prof.enable_by_count()
        try:
            yield
        finally:
            prof.disable_by_count()

    return profiled


CONTENDERS: dict[str, Bind] = {
    "unprofiled": unprofiled,
    "torchmem LineProfiler": torchmem_lines,
    "memory_profiler LineProfiler (psutil)": memory_profiler_lines,
    "line_profiler LineProfiler (time only)": line_profiler_lines,
}
"""Contender -> its context for a watched function; importing a missing package fails."""
CASES = {"torch.nn.Linear(16, 16), 200 times": linears, "MLP training step (Adam)": mlp_step}
TARGETS = {"torch.nn.Linear(16, 16), 200 times": 2.0, "MLP training step (Adam)": 1.3}
"""Case -> the ratio torchmem's line profiler should stay within."""


def measure(repeat: int = 7, scale: float = 1.0, device: str = "cpu") -> list[timing.Row]:
    """(case, contender, median seconds, ratio to unprofiled) for every pair; None, None
    for a contender whose package is not installed."""
    rows = []
    for case, make in CASES.items():
        work = make(max(1, int(200 * scale)), device) if make is linears else make(device)
        contexts = {}
        for name, bind in CONTENDERS.items():
            with contextlib.suppress(ImportError):
                contexts[name] = bind(work, device)
        found = timing.medians(work, contexts, repeat)
        rows += timing.rows(case, list(CONTENDERS), found, "unprofiled")
    return rows


def table(rows: list[timing.Row]) -> str:
    return timing.table(rows)


def targets(rows: list[timing.Row]) -> str:
    """torchmem's ratio in each case against its target, a line per case."""
    lines = []
    for case, name, _, ratio in rows:
        if name == "torchmem LineProfiler" and ratio is not None:
            target = TARGETS[case]
            verdict = "met" if ratio <= target else "missed"
            lines.append(f"- {case}: at most {target:.1f}x, measured {ratio:.2f}x ({verdict})")
    return "\n".join(lines)
