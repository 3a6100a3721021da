"""The whole suite: every case, its tables, and ``benchmarks/RESULTS.md``.

``python -m benchmarks`` runs :data:`FULL`; the tests run :data:`TINY`, so the suite
cannot rot. Each section is printed as soon as it is measured. ``python -m
benchmarks.recorder`` runs only the cases of a recording's cost over long runs (11 to 13).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import inspect
import os
import platform
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import psutil
import torch

from benchmarks import (
    allocations,
    cells,
    estimate,
    fixed,
    lines,
    long,
    meters,
    peaks,
    plugin,
    processes,
    ranks,
    reporter,
    run as run_command,
    sharded,
    snapshot,
    zoo,
)
from benchmarks.timing import table

RESULTS = Path(__file__).with_name("RESULTS.md")
PEERS = ("ipyexperiments", "memory_profiler", "line_profiler", "pytorch-memlab", "pytest-memray")


@dataclass(frozen=True)
class Config:
    repeat: int = 5
    """Runs of each contender; each figure is their median (the worst, for errors)."""
    line_repeat: int = 7
    scale: float = 1.0
    """Fraction of the full workloads' loop counts."""
    spike: int = peaks.SIZE
    """Bytes of each spike in the peak case."""
    sleep: float = 2.0
    """Seconds the cell sleeps in the cell-logger case."""
    tensors: int = 100_000
    """Live tensors in the reporter case."""
    steps: int = 50
    """Training steps of the example script in the ``torchmem run`` case."""
    layers: int = 12
    """Transformer blocks of the GPT-2-small step in the estimator case."""
    tests: int = 20
    """Tests in the pytest plugin's suite."""
    snapshot_entries: int = 750_000
    """Trace entries of the synthetic memory snapshot."""
    long_repeat: int = 1
    """Runs of each contender in the long-run case (minutes each: one round, so that the
    whole suite stays under an hour)."""
    long_scale: float = 1.0
    """Fraction of the long runs' steps."""
    long_cases: Collection[int] | None = None
    """The long runs' cases to run, by index in ``long.CASES`` (None: all)."""
    tiny_repeat: int = 5
    """Rounds of each contender in the tiny-allocation case (about 40 s a round)."""
    tiny_scale: float = 1.0
    """Fraction of the tiny-allocation case's allocations."""
    zoo_models: int | None = None
    """Models of the estimator's zoo (None: all)."""
    record_repeat: int = 21
    """Rounds of each contender in the recording's fixed-cost case."""
    sharded_width: int = sharded.WIDTH
    """Width of the sharded step's layers."""
    sharded_batch: int = 64
    sharded_worlds: tuple[int, ...] = (2, 4)
    """The world sizes of the sharded step."""


FULL = Config()
TINY = Config(
    repeat=1,
    line_repeat=1,
    scale=0.01,
    spike=2**26,
    sleep=0.01,
    tensors=200,
    steps=1,
    layers=1,
    tests=2,
    snapshot_entries=2_000,
    long_repeat=1,
    long_scale=0.001,
    long_cases=(2,),  # the cases differ only in the example's options
    tiny_repeat=1,
    tiny_scale=0.0002,
    zoo_models=3,
    sharded_width=256,
    sharded_batch=8,
    sharded_worlds=(2,),
    record_repeat=1,
)


def sections(config: Config) -> Iterator[str]:
    """The results, one markdown section at a time, measured as they are asked for."""
    cuda = torch.cuda.is_available()
    skipped = "Skipped: no CUDA device on this machine."

    yield "## 1. Peak exactness\n\n" + doc(peaks)
    yield f"{config.repeat} runs of each spike, contenders alternating:\n\n" + peaks.table(
        peaks.measure(config.repeat, config.spike)
    )
    yield "CUDA variant:\n\n" + (
        peaks.table(peaks.measure_cuda(config.repeat, config.spike)) if cuda else skipped
    )

    yield (
        "## 2. Line profiler overhead\n\nEach contender watches the same function line by "
        "line, alternating, in one process; median of "
        f"{config.line_repeat} and its ratio to the unprofiled run "
        "(line_profiler measures time only: the floor of any line tracer)."
    )
    rows = lines.measure(config.line_repeat, config.scale)
    yield lines.table(rows) + "\n\nTargets for torchmem's LineProfiler:\n\n" + lines.targets(rows)
    yield "CUDA variant (the caching allocator's counters):\n\n" + (
        lines.table(lines.measure(config.line_repeat, config.scale, "cuda")) if cuda else skipped
    )

    yield (
        "## 3. CPU meter overhead per operator\n\nWork run inside an open peak window of "
        "each CPU backend (the counting allocator, the default; the dispatch-mode "
        "fallback) against the PyTorch profiler recording memory, alternating; opening "
        "and closing each (the profiler's post-processing on exit) timed too; median of "
        f"{config.repeat} and ratio to the unwatched run. Target: below the profiler, "
        f"and the counting allocator at most +{meters.TARGET_US_PER_OP} µs per operator."
    )
    rows = meters.measure(config.repeat, config.scale)
    yield (
        meters.table(rows)
        + "\n\n"
        + meters.verdicts(rows)
        + "\n\nCost per operator over the unwatched run (10,000 small ops):\n\n"
        + meters.per_op(rows, int(10_000 * config.scale))
    )
    yield "CUDA variant (the caching allocator's meter):\n\n" + (
        meters.table(meters.measure(config.repeat, config.scale, "cuda")) if cuda else skipped
    )

    yield "## 4. Background cost of the cell logger\n\n" + doc(cells)
    yield cells.table(cells.measure(config.repeat, config.sleep), config.sleep)

    yield "## 5. Tensor reporter\n\n" + doc(reporter)
    yield (
        f"Time to report {config.tensors:,} live tensors, median of {config.repeat}:\n\n"
        + reporter.table_time(reporter.measure_time(config.tensors, config.repeat))
    )
    yield "Sizes reported for a known model:\n\n" + reporter.table_sizes(reporter.measure_sizes())

    yield "## 6. torchmem run\n\n" + doc(run_command)
    rows = run_command.measure(config.repeat, config.steps)
    yield table(rows) + "\n\n" + run_command.verdicts(rows)

    yield "## 7. Estimator\n\n" + doc(estimate)
    rows, facts = estimate.measure(config.repeat, config.layers, "80 GiB")
    yield table(rows) + "\n\n" + estimate.verdicts(rows) + "\n\n" + facts

    yield "## 8. pytest plugin\n\n" + doc(plugin)
    rows = plugin.measure(config.repeat, config.tests, config.steps)
    yield table(rows) + "\n\n" + plugin.verdicts(rows, config.tests)

    yield "## 9. torchmem run under torchrun\n\n" + doc(ranks)
    rows = ranks.measure(config.repeat, config.steps)
    yield table(rows) + "\n\n" + ranks.verdicts(rows)

    yield "## 10. Reading a memory snapshot\n\n" + doc(snapshot)
    rows = snapshot.measure(config.repeat, config.snapshot_entries)
    rows += snapshot.measure_real(config.repeat)
    yield table(rows) + "\n\n" + snapshot.verdicts(rows)

    yield from recorder_sections(config)

    yield "## 14. Estimator model zoo\n\n" + doc(zoo)
    rows = zoo.measure(config.zoo_models)
    yield zoo.table(rows) + "\n\n" + zoo.verdicts(rows)

    yield "## 15. Each rank of a sharded step, estimated\n\n" + doc(sharded)
    found = sharded.measure(config.sharded_width, config.sharded_batch, config.sharded_worlds)
    yield sharded.table(found) + "\n\n" + sharded.verdicts(found)


def recorder_sections(config: Config, cases: Collection[int] | None = None) -> Iterator[str]:
    """The cases of a recording's cost over long runs and many events (11 to 13, or those
    of `cases`), one markdown section at a time; ``python -m benchmarks.recorder`` runs
    only these."""
    for number, case in RECORDER_CASES.items():
        if cases is None or number in cases:
            yield from case(config)


def long_runs(config: Config) -> Iterator[str]:
    yield "## 11. torchmem run on long training runs\n\n" + doc(long)
    runs = long.measure(config.long_repeat, config.long_scale, config.long_cases)
    yield processes.table(runs) + "\n\n" + long.verdicts(runs)


def tiny_allocations(config: Config) -> Iterator[str]:
    yield "## 12. Many tiny allocations\n\n" + doc(allocations)
    runs = allocations.measure(config.tiny_repeat, config.tiny_scale)
    yield processes.table(runs) + "\n\n" + allocations.verdicts(runs)


def fixed_cost(config: Config) -> Iterator[str]:
    yield "## 13. A recording's fixed cost\n\n" + doc(fixed)
    rows, objects = fixed.measure(config.record_repeat)
    yield table(rows) + "\n\n" + fixed.verdicts(rows, objects)


RECORDER_CASES: dict[int, Callable[[Config], Iterator[str]]] = {
    11: long_runs,
    12: tiny_allocations,
    13: fixed_cost,
}


def doc(module: ModuleType) -> str:
    """A benchmark module's docstring, which says what it measures and how."""
    return inspect.cleandoc(module.__doc__ or "")


def header() -> str:
    """Date, machine and versions."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    peers = []
    for package in PEERS:
        try:
            peers.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            peers.append(f"{package} not installed")
    return "\n".join(
        [
            "# Benchmark results",
            "",
            f"- Date: {datetime.date.today().isoformat()}",
            f"- Machine: {cpu_name()}, {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, GPU: {gpu}",
            f"- OS: {platform.system()} {platform.release()}",
            f"- Python {platform.python_version()}, torch {torch.__version__}, "
            f"torchmem {importlib.metadata.version('torchmem')}",
            f"- Peers: {', '.join(peers)}",
            "- Command: `python -m benchmarks`",
        ]
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(config: Config = FULL, show: Callable[[str], None] = print) -> str:
    """Measure everything, showing each section as it comes; return the whole report."""
    started = time.perf_counter()
    parts = [header()]
    show(parts[0])
    for section in sections(config):
        show("\n" + section)
        parts.append(section)
    parts.append(f"Whole run: {time.perf_counter() - started:.0f} s.")
    show("\n" + parts[-1])
    return "\n\n".join(parts) + "\n"
