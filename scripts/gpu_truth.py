"""Record real-GPU ground truth for the CPU test suite: a memory snapshot of a few known
training steps, with the caching allocator's own counters.

    python scripts/gpu_truth.py [OUT]   (default: tests/data/gpu_truth/recorded)

Each workload runs in a process of its own (as an estimate assumes: no cuBLAS workspace
or cached segment left by another): it builds its model on the GPU, then the allocator
history starts, the peak counters reset and the step runs. It writes
``<workload>.pickle.gz`` (``torch.cuda.memory._snapshot()``, gzipped) and one
``facts.json`` with, per workload, ``max_memory_allocated``, ``max_memory_reserved``,
the bytes allocated and reserved at the end, the device and the versions. The CPU tests
check torchmem's snapshot reader, allocator model and estimator against them.
"""

from __future__ import annotations

import gzip
import json
import pickle
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from gpu_workloads import WORKLOADS  # noqa: E402  (tests/ holds the workloads the tests share)


def record(name: str, out: Path) -> dict[str, object]:
    """Run workload `name` on the current GPU; write its snapshot; return its facts."""
    workload = WORKLOADS[name]
    state = workload.build("cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    workload.step(state)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(out / f"{name}.pickle.gz", "wb") as file:
        pickle.dump(snapshot, file)
    facts = {
        "workload": workload.description,
        "allocated_before_bytes": before,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "memory_allocated_at_end": torch.cuda.memory_allocated(),
        "memory_reserved_at_end": torch.cuda.memory_reserved(),
        "trace_entries": len(snapshot["device_traces"][torch.cuda.current_device()]),
    }
    return facts


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:  # in a process of its own: print the facts as JSON
        print(json.dumps(record(argv[1], Path(argv[2]))))
        return 0
    if not torch.cuda.is_available():
        print("gpu_truth: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    out = Path(argv[0]) if argv else ROOT / "tests" / "data" / "gpu_truth" / "recorded"
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "workloads": {},
    }
    for name in WORKLOADS:
        one = [sys.executable, __file__, "--one", name, str(out)]
        done = subprocess.run(one, capture_output=True, text=True, check=True)
        facts = json.loads(done.stdout)
        found["workloads"][name] = facts  # type: ignore[index]
        print(
            f"{name}: peak {facts['max_memory_allocated']:,} B,"
            f" reserved {facts['max_memory_reserved']:,} B"
        )
    (out / "facts.json").write_text(json.dumps(found, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
