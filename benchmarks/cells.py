"""What a cell logger costs while the cell does nothing: CPU seconds spent by the
process during a cell that sleeps, in a real IPython shell.

ipyexperiments' ``CellLogger`` samples RSS from a thread that spins without sleeping
for as long as a cell runs; torchmem's reads the kernel's high-water mark before and
after the cell and runs no thread. *Background* is the CPU time of every thread but the
one running the cell; *total* adds the cell's own thread (the logger's ``gc.collect``
and readings before and after the cell, and the sleep's wake-up). Contenders alternate,
and each figure is the median of the runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torchmem
from benchmarks.peaks import Shell

Logger = Callable[[Shell], tuple[str, str]]
"""Given the shell: the cells that start and stop the logger."""


def no_logger(shell: Shell) -> tuple[str, str]:
    return "pass", "pass"


def torchmem_logger(shell: Shell) -> tuple[str, str]:
    shell.shell.user_ns["logger"] = torchmem.CellLogger(shell=shell.shell)
    return "logger.start()", "logger.stop()"


def ipyexperiments_logger(shell: Shell) -> tuple[str, str]:
    from ipyexperiments import IPyExperimentsCPU

    shell.shell.user_ns["IPyExperimentsCPU"] = IPyExperimentsCPU
    return "exp = IPyExperimentsCPU(exp_enable=False)", "exp.finish()"


CONTENDERS: dict[str, Logger] = {
    "no logger": no_logger,
    "torchmem CellLogger": torchmem_logger,
    "ipyexperiments CellLogger": ipyexperiments_logger,
}


@dataclass(frozen=True)
class Row:
    contender: str
    background: float | None
    """Median CPU seconds of the other threads during the cell; None: not installed."""
    total: float | None
    """Median CPU seconds of the whole process during the cell."""


def measure(repeat: int = 5, sleep: float = 2.0) -> list[Row]:
    """CPU seconds during a cell running ``time.sleep(sleep)``, for each contender."""
    shell = Shell()
    try:
        shell.run("import time")
        background: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        total: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        available = {}
        for name, logger in CONTENDERS.items():
            with contextlib.suppress(ImportError):
                logger(shell)
                available[name] = logger
        for _ in range(repeat):
            for name, logger in available.items():
                start_cell, stop_cell = logger(shell)
                shell.run(start_cell)
                process, own = time.process_time(), time.thread_time()
                shell.run(f"time.sleep({sleep})")
                process, own = time.process_time() - process, time.thread_time() - own
                shell.run(stop_cell)
                background[name].append(max(0.0, process - own))  # clocks tick apart
                total[name].append(process)
        return [
            Row(name, statistics.median(background[name]), statistics.median(total[name]))
            if name in available
            else Row(name, None, None)
            for name in CONTENDERS
        ]
    finally:
        shell.close()


def table(rows: list[Row], sleep: float = 2.0) -> str:
    lines = [
        f"| contender | CPU s in other threads | CPU s in all (cell sleeps {sleep:g} s) |",
        "| --- | ---: | ---: |",
    ]
    for row in rows:
        if row.background is None or row.total is None:
            lines.append(f"| {row.contender} | not installed | - |")
        else:
            lines.append(f"| {row.contender} | {row.background:.3f} | {row.total:.3f} |")
    return "\n".join(lines)
