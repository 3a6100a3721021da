"""``torchmem snapshot FILE --what-if`` as a subprocess, on a real GPU snapshot (the GPT-2
step of ``tests/data/gpu_truth/recorded``, default settings): the real run reserved
2,128,609,280 bytes (1.98G) at the peak; under ``max_split_size_mb:64`` the real run
reserved 2,891,972,608 (2.69G): 763,363,328 bytes (728.00M) more."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

RECORDED = Path(__file__).resolve().parents[1] / "data" / "gpu_truth" / "recorded"


def torchmem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchmem", "snapshot", *args], capture_output=True, text=True
    )


def test_the_what_if_of_a_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.pickle"
    path.write_bytes(gzip.decompress((RECORDED / "gpt2-2layers-adamw-step.pickle.gz").read_bytes()))
    done = torchmem(str(path), "--what-if", "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr
    assert (
        "  with max_split_size_mb:64 the reserved peak would be 2.69G instead of 1.98G"
        " (+728.00M)\n" in done.stdout
    )
    found = json.loads((tmp_path / "out.json").read_text())["devices"]["0"]["what_if"]
    assert found["reserved_peak_bytes"] == 2_128_609_280
    # The peaks are the real run's under max_split_size_mb:64 (facts.json); when its
    # allocated bytes peaked it held 2,128,609,280 reserved, 13,245,440 of them free.
    assert found["alternatives"][1] == {
        "settings": "max_split_size_mb:64",
        "reserved_peak_bytes": 2_891_972_608,
        "allocated_peak_bytes": 2_115_363_840,
        "reserved_at_peak_bytes": 2_128_609_280,
        "fragmentation_bytes": 13_245_440,
        "largest_free_at_peak_bytes": 2_097_152,
        "out_of_memory": False,
    }
    plain = torchmem(str(path))
    assert plain.returncode == 0 and "Allocator settings" not in plain.stdout


def test_what_if_reads_one_snapshot_not_a_diff(tmp_path: Path) -> None:
    done = torchmem("diff", "a.pickle", "b.pickle", "--what-if")
    assert done.returncode == 2
    assert done.stderr.strip().endswith("--what-if shows one snapshot, not a diff")
