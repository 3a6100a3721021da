"""Record real-GPU ground truth for the CPU test suite: a memory snapshot of a few known
training steps, with the caching allocator's own counters.

    python scripts/gpu_truth.py [OUT]   (default: tests/data/gpu_truth/recorded)

Each workload runs in a process of its own (as an estimate assumes: no cuBLAS workspace
or cached segment left by another): it builds its model on the GPU, then the allocator
history starts, the peak counters reset and the step runs. It writes
``<workload>.pickle.gz`` (``torch.cuda.memory._snapshot()``, gzipped) and one
``facts.json`` with, per workload, ``max_memory_allocated``, ``max_memory_reserved``,
the bytes allocated and reserved at the end, the device and the versions. Each workload
runs again under each of :data:`SETTINGS` (``PYTORCH_CUDA_ALLOC_CONF``): its counters go
under ``"settings"`` and its snapshot in ``<workload>.<setting>.pickle.gz``, the truth for
the allocator model's what-ifs. The CPU tests check torchmem's snapshot reader, allocator
model and estimator against them.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from gpu_workloads import WORKLOADS  # noqa: E402  (tests/ holds the workloads the tests share)

SETTINGS = {
    "expandable": "expandable_segments:True",
    "max-split-64": "max_split_size_mb:64",
    "gc-0.6": "garbage_collection_threshold:0.6",
}
"""Allocator settings each workload is also recorded under (name in file names: value)."""
COUNTERS = (
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated_at_end",
    "memory_reserved_at_end",
    "trace_entries",
)
"""What ``facts.json`` keeps of a run under one of :data:`SETTINGS`."""


def record(name: str, out: Path, setting: str = "") -> dict[str, object]:
    """Run workload `name` on the current GPU; write its snapshot (``<name>.pickle.gz``,
    or ``<name>.<setting>.pickle.gz`` under one of :data:`SETTINGS`); return its facts."""
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
    stem = f"{name}.{setting}" if setting else name
    with gzip.open(out / f"{stem}.pickle.gz", "wb") as file:
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


def one(name: str, out: Path, setting: str = "") -> dict[str, object]:
    """Record workload `name` in a process of its own, under allocator `setting`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    }
    if setting:
        env["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[setting]
    command = [sys.executable, __file__, "--one", name, str(out), *([setting] if setting else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    facts = json.loads(done.stdout)
    print(
        f"{name} {setting or 'default'}: peak {facts['max_memory_allocated']:,} B,"
        f" reserved {facts['max_memory_reserved']:,} B",
        flush=True,
    )
    return facts


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:  # in a process of its own: print the facts as JSON
        print(json.dumps(record(argv[1], Path(argv[2]), *argv[3:])))
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
        facts = one(name, out)
        facts["settings"] = {
            conf: {key: one(name, out, setting)[key] for key in COUNTERS}
            for setting, conf in SETTINGS.items()
        }
        found["workloads"][name] = facts  # type: ignore[index]
        (out / "facts.json").write_text(json.dumps(found, indent=1) + "\n")  # kept if cut short
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
