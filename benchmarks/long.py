"""``torchmem run`` on long training runs: the small transformer language model of
``examples/train_lm.py`` (2 blocks, d_model 32, fused AdamW, batch 4 x 16 tokens; a few
milliseconds a step on one CPU core) for 2,000 and for 20,000 steps on the CPU. Each
contender is a whole command in a new process (Python's start and ``import torch``
included), alternating, median of the rounds: plain ``python``, ``torchmem run -q``
with allocation sites (the default) and with ``--no-sites``. For each: the wall time and
its ratio to plain; the peak RSS and how much it is over plain's (a recording that keeps
every event grows with the run); and how long after the script's last line the process
ended (for torchmem, the recording's stop and its report; for plain, Python's
shutdown). One thread (``OMP_NUM_THREADS=1``), GPUs hidden. A contender still running at
5x plain's time (at least 60 s) is stopped and shown as such (">": lower bounds).
Targets, at both lengths, sites on and off: at most 1.2x plain's time and at most
64 MiB more RSS."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from benchmarks import processes
from benchmarks.processes import Run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
STEPS = (2_000, 20_000)
"""The runs' lengths at full scale."""
RATIO = 1.2
"""Highest ratio to plain python either torchmem contender may reach."""
RSS_MIB = 64
"""Most MiB of peak RSS either torchmem contender may add to plain python's."""
WRAPPER = f"""
import runpy
import sys
import time

sys.argv[0] = {str(EXAMPLE)!r}
runpy.run_path(sys.argv[0], run_name="__main__")
print({processes.MARK!r}, time.monotonic(), flush=True)
"""
"""Runs the example as ``__main__``, then prints the time of its last line."""
CONTENDERS = ("python", "torchmem run --no-sites", "torchmem run")


def environ() -> dict[str, str]:
    """One thread, no GPU: a CPU training loop, the same for every contender."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def commands(wrapper: str, steps: int) -> dict[str, list[str]]:
    """Each contender's command line, running `wrapper` (:data:`WRAPPER`)."""
    script = [wrapper, "--steps", str(steps), "--device", "cpu"]
    run = [sys.executable, "-m", "torchmem", "run", "-q"]
    return dict(
        zip(
            CONTENDERS,
            ([sys.executable, *script], [*run, "--no-sites", *script], [*run, *script]),
            strict=True,
        )
    )


def measure(repeat: int, scale: float) -> list[Run]:
    """A row per length and contender: medians of `repeat` rounds, contenders
    alternating; the lengths are :data:`STEPS` times `scale`."""
    found: list[Run] = []
    with tempfile.TemporaryDirectory() as folder:
        wrapper = Path(folder, "train_lm_timed.py")
        wrapper.write_text(WRAPPER)
        for full in STEPS:
            steps = max(1, round(full * scale))
            case = f"examples/train_lm.py --steps {steps}"
            found += processes.measure(case, commands(str(wrapper), steps), repeat, environ())
    return found


def verdicts(runs: list[Run]) -> str:
    """A line per length and torchmem contender: time ratio and RSS over plain, against
    the targets."""
    targets = {name: RATIO for name in CONTENDERS[1:]}
    return processes.verdicts(runs, targets, RSS_MIB)
