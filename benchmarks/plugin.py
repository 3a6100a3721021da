"""The pytest plugin on a small suite: each test is a training step of a small MLP on CPU
tensors, marked ``limit_memory("1 GB")``. Each contender is a whole ``pytest`` run in a
new process (Python's start, ``import torch`` and collection included), alternating,
median of the rounds; ratio to the same suite with neither plugin loaded, and the cost
per test over it. pytest-memray acts on the same marker, so each run loads one plugin
only. Target: torchmem's cost per marked test (a recording with allocation sites) at
most pytest-memray's, measured in the same run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import Row

TEST = """
import pytest
import torch


@pytest.mark.limit_memory("1 GB")
@pytest.mark.parametrize("seed", range({tests}))
def test_step(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range({steps}):
        loss = model(torch.randn(64, 256)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""
BASE = "pytest (no memory plugin)"
OURS = "pytest, torchmem's limit_memory"
THEIRS = "pytest, pytest-memray's limit_memory"


def commands() -> dict[str, list[str]]:
    """Each contender's command line (run in the suite's folder)."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_suite.py"]
    return {
        BASE: [*pytest, "-p", "no:torchmem", "-p", "no:memray"],
        OURS: [*pytest, "-p", "no:memray"],
        "pytest --torchmem, torchmem's limit_memory": [*pytest, "-p", "no:memray", "--torchmem"],
        THEIRS: [*pytest, "-p", "no:torchmem"],
    }


def measure(repeat: int, tests: int, steps: int) -> list[Row]:
    """Median wall seconds of each command, `repeat` rounds, alternating; a contender
    whose plugin is not installed gets None."""
    try:
        import pytest_memray  # noqa: F401
    except ImportError:
        missing = {THEIRS}
    else:
        missing = set()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    found: dict[str, list[float]] = {name: [] for name in commands() if name not in missing}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "test_suite.py").write_text(TEST.format(tests=tests, steps=steps))
        for _ in range(repeat):
            for name in found:
                start = time.perf_counter()
                subprocess.run(
                    commands()[name], cwd=folder, env=env, check=True, capture_output=True
                )
                found[name].append(time.perf_counter() - start)
    medians = {name: sorted(times)[len(times) // 2] for name, times in found.items()}
    case = f"{tests} tests x {steps} steps"
    return [
        (case, name, medians[name], medians[name] / medians[BASE])
        if name in medians
        else (case, name, None, None)
        for name in commands()
    ]


def verdicts(rows: list[Row], tests: int) -> str:
    """The cost per test of each plugin over the baseline, and torchmem's against its
    target: at most pytest-memray's, from the same run."""
    seconds = {name: median for _, name, median, _ in rows if median is not None}
    cost = {
        name: (seconds[name] - seconds[BASE]) / tests * 1e3
        for name in (OURS, THEIRS)
        if name in seconds
    }
    if THEIRS in cost:
        met = "met" if cost[OURS] <= cost[THEIRS] else "missed"
        target = f"at most pytest-memray's {cost[THEIRS]:+.0f} ms, same run: {met}"
    else:
        target = "at most pytest-memray's, same run: pytest-memray is not installed"
    lines = [f"- {OURS}: {cost[OURS]:+.0f} ms per test (target {target})"]
    if THEIRS in cost:
        lines.append(f"- {THEIRS}: {cost[THEIRS]:+.0f} ms per test")
    return "\n".join(lines)
