"""The fixed cost of a recording: one training step of a small MLP on the CPU (256 -> 512
-> 10, batch 64, Adam), bare and as ``with torchmem.record() as rec: step()`` then
``str(rec.report())``, with allocation sites (the default) and without, alternating in
one process, median of the rounds after a first round not counted; the cost is a
recording's median minus the bare step's. The process is a new one (``python -m
benchmarks.fixed``), holding what a small training script holds (a recording that
walked every Python object would cost more with more of them: their count is shown),
with one thread. Target: under 50 ms, sites on and off."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.timing import Row, rows

ROOT = Path(__file__).resolve().parent.parent
BASE = "step()"
CONTENDERS = (BASE, "record() + report()", "record(sites=False) + report()")
TARGET_MS = 50
"""Most milliseconds a recording may add to the step."""


def measure(repeat: int) -> tuple[list[Row], int]:
    """Each contender's median seconds over `repeat` rounds in a new process, and the
    number of Python objects alive there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "benchmarks.fixed", str(repeat)]
    done = subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    found = json.loads(done.stdout.splitlines()[-1])
    case = "MLP training step (256-512-10, batch 64, Adam)"
    return rows(case, list(CONTENDERS), found["medians"], BASE), found["objects"]


def verdicts(found: list[Row], objects: int) -> str:
    """A line per recording: its cost over the bare step, against the target."""
    seconds = {name: median for _, name, median, _ in found if median is not None}
    lines = []
    for name in CONTENDERS[1:]:
        cost = (seconds[name] - seconds[BASE]) * 1e3
        met = "met" if cost < TARGET_MS else "missed"
        lines.append(f"- {name}: {cost:+.1f} ms over the bare step (target {TARGET_MS} ms: {met})")
    lines.append(f"\n{objects:,} Python objects alive in the process.")
    return "\n".join(lines)


def main(repeat: int) -> None:
    """Print each contender's median seconds as JSON (the last line)."""
    import torch

    import torchmem
    from benchmarks.timing import medians

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.Adam(model.parameters())
    inputs = torch.randn(64, 256)

    def step() -> None:
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def recorded(sites: bool) -> contextlib.AbstractContextManager:
        @contextlib.contextmanager
        def context() -> Iterator[None]:
            with torchmem.record(sites=sites) as rec:
                yield
            str(rec.report())

        return context()

    contenders = dict(
        zip(
            CONTENDERS,
            (contextlib.nullcontext, lambda: recorded(True), lambda: recorded(False)),
            strict=True,
        )
    )
    medians(step, contenders, 1)  # the first round: imports, the optimizer's state
    found = medians(step, contenders, repeat)
    print(json.dumps({"medians": found, "objects": len(gc.get_objects())}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
