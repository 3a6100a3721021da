"""Reading a large memory snapshot: a synthetic one shaped like PyTorch's (each trace
entry with a two-frame Python stack; allocations of 512 B to 1 MiB, each freed later or
alive at the end), written to a file. Contenders, alternating, median of the rounds:
``pickle.load`` (what ``torch.cuda._memory_viz`` does: fast, and it runs whatever the
file asks), and ``torchmem.load_snapshot`` (an unpickler that builds plain data only,
then the whole analysis: totals, the trace's peak, sites at the peak, fragmentation, the
timeline). Target: at most 2x ``pickle.load``."""

from __future__ import annotations

import pickle
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.timing import Row, ratio_verdicts

TARGET = 2.0


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


def measure(repeat: int, entries: int) -> list[Row]:
    """Median seconds of each contender reading the same file, `repeat` rounds."""
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
            "torchmem.load_snapshot (plain data only, analysed)": lambda: torchmem.load_snapshot(
                path
            ),
        }
        found: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(repeat):
            for name, read in contenders.items():
                start = time.perf_counter()
                read()
                found[name].append(time.perf_counter() - start)
    medians = {name: sorted(times)[len(times) // 2] for name, times in found.items()}
    base = next(iter(medians.values()))
    case = f"{entries:,} trace entries, {size / 2**20:.0f} MiB"
    return [(case, name, t, t / base) for name, t in medians.items()]


def verdicts(found: list[Row]) -> str:
    """The loader's ratio to pickle.load, met or missed."""
    return ratio_verdicts(found, {found[-1][1]: TARGET})
