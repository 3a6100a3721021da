"""Reading a large memory snapshot: a synthetic one shaped like PyTorch's (each trace
entry with a two-frame Python stack; allocations of 512 B to 1 MiB, each freed later or
alive at the end), written to a file. Contenders, alternating, median of the rounds:
``pickle.load`` (what ``torch.cuda._memory_viz`` does: fast, and it runs whatever the
file asks), and ``torchmem.load_snapshot`` (an unpickler that builds plain data only,
then the whole analysis: totals, the trace's peak, sites at the peak, fragmentation, the
timeline). Target: at most 2x ``pickle.load``.

Where the real GPU snapshots are beside the clone (``../shared/gpu-truth``: a 2.7B
Transformer LM's forward and full steps, 4,657 to 19,936 trace entries each), each is read
too, against ``pickle.load`` plus ``torch.cuda._memory_viz.segsum`` (PyTorch's own summary
of the segments). Target: at most 1.5x that."""

from __future__ import annotations

import pickle
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.timing import Row, ratio_verdicts

TARGET = 2.0
REAL_TARGET = 1.5
REAL = Path(__file__).resolve().parents[2] / "shared" / "gpu-truth"
"""The real GPU snapshots, where the clone has them beside it."""
LOADER = "torchmem.load_snapshot (plain data only, analysed)"


def synthetic(entries: int, seed: int = 0) -> dict[str, Any]:
    """A snapshot whose trace has about `entries` entries (allocations, and two entries
    per free: requested, completed)."""
    rng = random.Random(seed)
    trace: list[dict[str, Any]] = []
    live: dict[int, int] = {}
    address, now = 0x7F0000000000, 1_700_000_000_000_000
    while len(trace) < entries:
        now += 10
        frames = [
            {"filename": "/home/me/train.py", "line": rng.randrange(1, 200), "name": "step"},
            {
                "filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py",
                "line": 1747,
                "name": "_call_impl",
            },
        ]
        if live and rng.random() < 0.5:
            freed = next(iter(live))
            size = live.pop(freed)
            for action in ("free_requested", "free_completed"):
                trace.append(
                    {
                        "action": action,
                        "addr": freed,
                        "size": size,
                        "stream": 0,
                        "time_us": now,
                        "frames": frames,
                    }
                )
        else:
            address += 1 << 20
            live[address] = 512 * rng.randrange(1, 2049)
            trace.append(
                {
                    "action": "alloc",
                    "addr": address,
                    "size": live[address],
                    "stream": 0,
                    "time_us": now,
                    "frames": frames,
                }
            )
    segments = [
        {
            "device": 0,
            "address": a,
            "total_size": size,
            "stream": 0,
            "blocks": [
                {
                    "address": a,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": [],
                }
            ],
        }
        for a, size in live.items()
    ]
    return {"segments": segments, "device_traces": [trace]}


def _medians(contenders: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each contender, alternating, `repeat` rounds."""
    found: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, read in contenders.items():
            start = time.perf_counter()
            read()
            found[name].append(time.perf_counter() - start)
    return {name: sorted(times)[len(times) // 2] for name, times in found.items()}


def measure(repeat: int, entries: int) -> list[Row]:
    """Median seconds of each contender reading the synthetic snapshot of `entries`
    entries, `repeat` rounds."""
    import torchmem

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "snapshot.pickle"
        with open(path, "wb") as file:
            pickle.dump(synthetic(entries), file)
        size = path.stat().st_size

        def plain() -> object:
            with open(path, "rb") as file:
                return pickle.load(file)

        contenders = {
            "pickle.load (runs what the file asks)": plain,
            LOADER: lambda: torchmem.load_snapshot(path),
        }
        medians = _medians(contenders, repeat)
    base = next(iter(medians.values()))
    case = f"{entries:,} trace entries, {size / 2**20:.0f} MiB"
    return [(case, name, t, t / base) for name, t in medians.items()]


def measure_real(repeat: int, folder: Path = REAL) -> list[Row]:
    """Median seconds of each contender reading each real snapshot in `folder`, `repeat`
    rounds; none where the folder is not there."""
    return [row for path in sorted(folder.glob("*.pickle")) for row in _real(path, repeat)]


def _real(path: Path, repeat: int) -> list[Row]:
    import torch.cuda._memory_viz as viz

    import torchmem

    def plain() -> object:
        with open(path, "rb") as file:
            return viz.segsum(pickle.load(file))

    contenders = {
        "pickle.load + _memory_viz.segsum (runs what the file asks)": plain,
        LOADER: lambda: torchmem.load_snapshot(path),
    }
    medians = _medians(contenders, repeat)
    base = next(iter(medians.values()))
    return [(path.name, name, t, t / base) for name, t in medians.items()]


def verdicts(found: list[Row]) -> str:
    """The loader's ratio to pickle.load on the synthetic snapshot (the first two rows of
    `found`), and to pickle.load plus segsum on each real one after them, met or missed."""
    lines = [ratio_verdicts(found[:2], {LOADER: TARGET})]
    for case, name, _, ratio in found[2:]:
        if name == LOADER and ratio is not None:
            verdict = "met" if ratio <= REAL_TARGET else "missed"
            lines.append(f"- {case}: {ratio:.2f}x (target {REAL_TARGET}x: {verdict})")
    return "\n".join(lines)
