"""``python -m benchmarks.cuda``: only the cases with a CUDA variant, on the current GPU
(the whole suite, ``python -m benchmarks``, runs them too); writes RESULTS-cuda.md.

Part of ``scripts/gpu_check.sh``, for a machine with a GPU at hand.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks import lines, meters, peaks, run as run_command
from benchmarks.suite import FULL, Config, header
from benchmarks.timing import table

RESULTS = Path(__file__).with_name("RESULTS-cuda.md")


def sections(config: Config) -> Iterator[str]:
    yield "## 1. Peak exactness, CUDA\n\n" + peaks.table(
        peaks.measure_cuda(config.repeat, config.spike)
    )
    yield "## 2. Line profiler overhead, CUDA (the caching allocator's counters)\n\n" + (
        lines.table(lines.measure(config.line_repeat, config.scale, "cuda"))
    )
    yield "## 3. Meter overhead, CUDA (the caching allocator's meter)\n\n" + meters.table(
        meters.measure(config.repeat, config.scale, "cuda")
    )
    rows = run_command.measure(config.repeat, config.steps)
    yield "## 6. torchmem run, on the GPU\n\n" + table(rows) + "\n\n" + run_command.verdicts(rows)


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks.cuda: no CUDA GPU here", file=sys.stderr)
        return 1
    started = time.perf_counter()
    parts = [header().replace("`python -m benchmarks`", "`python -m benchmarks.cuda`")]
    for section in sections(FULL):
        print("\n" + section, flush=True)
        parts.append(section)
    parts.append(f"Whole run: {time.perf_counter() - started:.0f} s.")
    RESULTS.write_text("\n\n".join(parts) + "\n")
    print(f"\nWrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
