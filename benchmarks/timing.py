"""What the benchmarks share: the alternating timing loop, and the table it ends in.

Contenders run in the same process, one after the other, `repeat` rounds over; each
keeps the median of its rounds, so a slow moment of the machine falls on every
contender alike and the ratios to the baseline stay fair.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping

Row = tuple[str, str, float | None, float | None]
"""(case, contender, median seconds, ratio to the baseline); None, None for a contender
that could not run (its package is not installed)."""


def medians(
    work: Callable[[], None],
    contenders: Mapping[str, Callable[[], contextlib.AbstractContextManager]],
    repeat: int,
) -> dict[str, float]:
    """Median seconds of `work()` inside each contender's context, alternating contenders,
    `repeat` rounds. Entering and leaving the context are timed too: a profiler does its
    post-processing on exit, and torchmem's dispatch fallback walks live tensors there."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, context in contenders.items():
            start = time.perf_counter()
            with context():
                work()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def rows(case: str, names: list[str], found: Mapping[str, float], base: str) -> list[Row]:
    """A row per contender in `names`, in order, with its ratio to contender `base`;
    those missing from `found` get None, None."""
    baseline = found[base]
    return [
        (case, name, found[name], found[name] / baseline)
        if name in found
        else (case, name, None, None)
        for name in names
    ]


def table(rows: list[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| case | contender | median | ratio |", "| --- | --- | ---: | ---: |"]
    for case, name, median, ratio in rows:
        if median is None or ratio is None:
            lines.append(f"| {case} | {name} | not installed | - |")
        else:
            lines.append(f"| {case} | {name} | {median * 1e3:.2f} ms | {ratio:.2f}x |")
    return "\n".join(lines)


def command_medians(
    commands: Mapping[str, list[str]], repeat: int, env: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Median wall seconds of each command, run to its end in a new process (Python's
    start and ``import torch`` included), contenders alternating, `repeat` rounds."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, env=env)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def ratio_verdicts(rows: list[Row], targets: Mapping[str, float]) -> str:
    """One line per contender with a target: its ratio, and whether it met the target."""
    lines = []
    for _, name, _, ratio in rows:
        if name in targets and ratio is not None:
            verdict = "met" if ratio <= targets[name] else "missed"
            lines.append(f"- {name}: {ratio:.2f}x (target {targets[name]}x: {verdict})")
    return "\n".join(lines)
