"""Many tiny allocations: a script that makes 5,000,000 one-element CPU tensors, one after
the other (``torch.empty(1)``, each freed as the next is made: 10,000,000 events for a
recorder), as whole commands in new processes, alternating, median of the rounds: plain
``python``, ``torchmem run -q`` with allocation sites (the default) and with
``--no-sites``. For each: the wall time and its ratio to plain, the peak RSS and how
much it is over plain's, and how long after the script's last line the process ended.
One thread, GPUs hidden; a contender still running at 5x plain's time (at least 60 s) is
stopped (">": lower bounds). Targets, sites on and off: at most 1.5x plain's time, and
at most 64 MiB more RSS than plain (a recording's memory bounded whatever the number of
events)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks import processes
from benchmarks.long import environ
from benchmarks.processes import Run

COUNT = 5_000_000
"""Allocations at full scale."""
RSS_MIB = 64
"""Most MiB of peak RSS either torchmem contender may add to plain python's."""
RATIO = 1.5
"""Most time either torchmem contender may take, as a multiple of plain python's."""
CONTENDERS = ("python", "torchmem run --no-sites", "torchmem run")
SCRIPT = f"""
import sys
import time

import torch

for _ in range(int(sys.argv[1])):
    torch.empty(1)
print({processes.MARK!r}, time.monotonic(), flush=True)
"""


def commands(script: str, count: int) -> dict[str, list[str]]:
    """Each contender's command line, running `script` (:data:`SCRIPT`)."""
    run = [sys.executable, "-m", "torchmem", "run", "-q"]
    return dict(
        zip(
            CONTENDERS,
            (
                [sys.executable, script, str(count)],
                [*run, "--no-sites", script, str(count)],
                [*run, script, str(count)],
            ),
            strict=True,
        )
    )


def measure(repeat: int, scale: float) -> list[Run]:
    """A row per contender: medians of `repeat` rounds, alternating; :data:`COUNT` times
    `scale` allocations."""
    count = max(1, round(COUNT * scale))
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "tiny_allocations.py")
        script.write_text(SCRIPT)
        case = f"{count:,} x torch.empty(1)"
        return processes.measure(case, commands(str(script), count), repeat, environ())


def verdicts(runs: list[Run]) -> str:
    """A line per torchmem contender: its time ratio, and its RSS over plain against the
    target."""
    return processes.verdicts(runs, dict.fromkeys(CONTENDERS[1:], RATIO), RSS_MIB)
