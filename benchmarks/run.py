"""``torchmem run`` on the example training script (``examples/train.py``), as a user
runs it: each contender is a whole command in a new process (Python's start and
``import torch`` included), alternating, median of the rounds; ratio to plain
``python``. Targets on CPU: at most 1.2x without allocation sites (``--no-sites``), at
most 2x with them (the default)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.timing import Row, command_medians, ratio_verdicts, rows

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"
TARGETS = {"torchmem run --no-sites": 1.2, "torchmem run": 2.0}
"""Highest ratio to plain python each contender may reach."""


def commands(steps: int) -> dict[str, list[str]]:
    """Each contender's command line."""
    script = [str(EXAMPLE), "--steps", str(steps)]
    run = [sys.executable, "-m", "torchmem", "run", "-q"]
    return {
        "python": [sys.executable, *script],
        "torchmem run --no-sites": [*run, "--no-sites", *script],
        "torchmem run": [*run, *script],
    }


def measure(repeat: int, steps: int) -> list[Row]:
    """Median wall seconds of each command, `repeat` rounds, alternating."""
    medians = command_medians(commands(steps), repeat)
    case = f"examples/train.py --steps {steps}"
    return rows(case, list(medians), medians, "python")


def verdicts(found: list[Row]) -> str:
    """One line per target: the ratio reached, met or missed."""
    return ratio_verdicts(found, TARGETS)
