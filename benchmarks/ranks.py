"""``torchmem run`` under ``torchrun`` on the DistributedDataParallel example
(``examples/ddp.py``, 2 ranks on CPU with gloo), as a user runs it: each contender is a
whole ``torchrun`` job (the launcher's and every rank's start, ``import torch``, the
gathering on rank 0 included), alternating, median of the rounds; ratio to plain
``torchrun``. Target: at most 1.5x (every rank records with allocation sites, and rank 0
waits for the others' reports and prints the table)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.timing import Row, command_medians, ratio_verdicts, rows

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp.py"
RANKS = 2
TARGETS = {"torchrun -m torchmem run": 1.5}
"""Highest ratio to plain torchrun each contender may reach."""


def commands(steps: int) -> dict[str, list[str]]:
    """Each contender's command line."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun.append(f"--nproc-per-node={RANKS}")
    script = [str(EXAMPLE), "--steps", str(steps)]
    return {
        "torchrun": [*torchrun, *script],
        "torchrun -m torchmem run": [*torchrun, "-m", "torchmem", "run", "-q", *script],
    }


def measure(repeat: int, steps: int) -> list[Row]:
    """Median wall seconds of each job, `repeat` rounds, alternating."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    medians = command_medians(commands(steps), repeat, environ)
    case = f"examples/ddp.py --steps {steps}, {RANKS} ranks"
    return rows(case, list(medians), medians, "torchrun")


def verdicts(found: list[Row]) -> str:
    """One line per target: the ratio reached, met or missed."""
    return ratio_verdicts(found, TARGETS)
