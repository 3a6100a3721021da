"""``torchmem run`` on the example training script (``examples/train.py``), as a user
runs it: each contender is a whole command in a new process (Python's start and
``import torch`` included), alternating, median of the rounds; ratio to plain
``python``. Targets on CPU: at most 1.2x without allocation sites (``--no-sites``), at
most 2x with them (the default). Beside them, the page of memory by category over time
from each tool: ``torchmem run --html`` and PyTorch's profiler with
``export_memory_timeline`` (:mod:`benchmarks.memory_timeline`)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks.timing import Row, command_medians, ratio_verdicts, rows

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"
TARGETS = {"torchmem run --no-sites": 1.2, "torchmem run": 2.0}
"""Highest ratio to plain python each contender may reach."""


def commands(steps: int, out: Path) -> dict[str, list[str]]:
    """Each contender's command line; the pages go in the folder `out`."""
    script = [str(EXAMPLE), "--steps", str(steps)]
    run = [sys.executable, "-m", "torchmem", "run", "-q"]
    timeline = [sys.executable, "-m", "benchmarks.memory_timeline", str(out / "profiler.html")]
    return {
        "python": [sys.executable, *script],
        "torchmem run --no-sites": [*run, "--no-sites", *script],
        "torchmem run": [*run, *script],
        "torchmem run --html": [*run, "--html", str(out / "torchmem.html"), *script],
        "PyTorch profiler + export_memory_timeline": [*timeline, *script],
    }


def measure(repeat: int, steps: int) -> list[Row]:
    """Median wall seconds of each command, `repeat` rounds, alternating."""
    with tempfile.TemporaryDirectory() as out:
        medians = command_medians(commands(steps, Path(out)), repeat)
    case = f"examples/train.py --steps {steps}"
    return rows(case, list(medians), medians, "python")


def verdicts(found: list[Row]) -> str:
    """One line per target: the ratio reached, met or missed."""
    return ratio_verdicts(found, TARGETS)
