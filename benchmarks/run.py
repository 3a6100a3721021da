"""``torchmem run`` on the example training script (``examples/train.py``), as a user
runs it: each contender is a whole command in a new process (Python's start and
``import torch`` included), alternating, median of the rounds; ratio to plain
``python``. Targets on CPU: at most 1.2x without allocation sites (``--no-sites``), at
most 2x with them (the default)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.timing import Row

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
    found: dict[str, list[float]] = {name: [] for name in commands(steps)}
    for _ in range(repeat):
        for name, command in commands(steps).items():
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            found[name].append(time.perf_counter() - start)
    medians = {name: sorted(times)[len(times) // 2] for name, times in found.items()}
    case = f"examples/train.py --steps {steps}"
    return [(case, name, t, t / medians["python"]) for name, t in medians.items()]


def verdicts(rows: list[Row]) -> str:
    """One line per target: the ratio reached, met or missed."""
    lines = []
    for _, name, _, ratio in rows:
        if name in TARGETS and ratio is not None:
            verdict = "met" if ratio <= TARGETS[name] else "missed"
            lines.append(f"- {name}: {ratio:.2f}x (target {TARGETS[name]}x: {verdict})")
    return "\n".join(lines)
