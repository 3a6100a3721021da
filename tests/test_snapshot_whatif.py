"""A snapshot's what-if in its report: text, HTML and JSON, from a real GPU snapshot (the
MLP's Adam step of ``tests/data/gpu_truth/recorded``, default settings).

The figures are the real run's (``facts.json``): 117,440,512 bytes reserved at the peak
(112.00M) and 106,238,464 allocated (101.32M); under ``expandable_segments:True`` the real
run reserved 113,246,208 (108.00M), 4 MiB less. At the allocated peak the replay holds
117,440,512 - 106,238,464 = 11,202,048 bytes (10.68M) reserved but not allocated.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from torchmem.records.snapshot import DEVICE_NAMES
from torchmem.records.snapshot_file import SnapshotUnpickler
from torchmem.snapshot import Snapshot, load_snapshot

RECORDED = Path(__file__).resolve().parent / "data" / "gpu_truth" / "recorded"
LINES = """\
Allocator settings on cuda:0: the trace's 42 allocations replayed through the model of PyTorch's caching allocator, under each setting alone
  recorded under PyTorch's defaults: reserved peak 112.00M, allocated peak 101.32M; the replay reproduces both
  at the allocated peak 10.68M were reserved but not allocated; the largest free block was 2.81M
  with expandable_segments:True the reserved peak would be 108.00M instead of 112.00M (-4.00M)
  with max_split_size_mb:64 the reserved peak would be 112.00M instead of 112.00M (no change)
  with garbage_collection_threshold:0.6 the reserved peak would be 112.00M instead of 112.00M (no change): it acts only where a memory fraction is set"""  # noqa: E501


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.pickle"
    path.write_bytes(gzip.decompress((RECORDED / "mlp-adam-step.pickle.gz").read_bytes()))
    return path


def test_the_text_report_ends_with_the_what_if(mlp: Path) -> None:
    snapshot = load_snapshot(mlp, what_if=True)
    assert str(snapshot).endswith("\n\n" + LINES)
    assert "Allocator settings" not in str(load_snapshot(mlp))


def test_the_html_report_has_the_what_if(mlp: Path) -> None:
    page = load_snapshot(mlp, what_if=True)._repr_html_()
    assert (
        "<code>with expandable_segments:True the reserved peak would be 108.00M instead of"
        " 112.00M (-4.00M)</code>" in page
    )
    assert "PyTorch&#x27;s caching allocator, under each setting alone" in page


def test_the_json_report_has_the_what_if(mlp: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp.json"
    load_snapshot(mlp, what_if=True).save_json(out)
    found = json.loads(out.read_text())["devices"]["0"]["what_if"]
    assert (found["settings"], found["reproduced"], found["kept"]) == ("", True, False)
    assert (found["reserved_peak_bytes"], found["allocated_peak_bytes"]) == (
        117_440_512,
        106_238_464,
    )
    assert found["today"]["fragmentation_bytes"] == 11_202_048
    assert [(a["settings"], a["reserved_peak_bytes"]) for a in found["alternatives"]] == [
        ("expandable_segments:True", 113_246_208),
        ("max_split_size_mb:64", 117_440_512),
        ("garbage_collection_threshold:0.6", 117_440_512),
    ]
    assert json.loads(json.dumps(load_snapshot(mlp).to_json()))["devices"]["0"]["what_if"] is None


def test_a_snapshot_in_memory_has_its_what_if(mlp: Path) -> None:
    with open(mlp, "rb") as file:
        data = SnapshotUnpickler(file, str(mlp)).load()
    device = Snapshot.from_dict(data, "mlp", what_if=True).devices[0]
    assert device.what_if is not None and device.what_if.reproduced
    assert device.what_if.alternatives[0].reserved_peak_bytes == 113_246_208
    assert Snapshot.from_dict(data, "mlp").devices[0].what_if is None


def test_odd_values_the_reader_does_not_check_are_passed_over(mlp: Path) -> None:
    """A stream or a request that is not a number (a file may say anything the reader does
    not read) is taken as stream 0 and the block's size: the what-if still reproduces."""
    with open(mlp, "rb") as file:
        data = SnapshotUnpickler(file, str(mlp)).load()
    for entry in data["device_traces"][0]:
        entry["stream"] = "a stream"
    for segment in data["segments"]:
        for block in segment["blocks"]:
            block["requested_size"] = -1
    found = Snapshot.from_dict(data, "mlp", what_if=True).devices[0].what_if
    assert found is not None and found.reproduced
    assert found.reserved_peak_bytes == 117_440_512


def test_a_cpu_device_has_no_what_if(mlp: Path) -> None:
    """The CPU of a snapshot torchmem saved (named by ``torchmem_device_names``) has no
    caching allocator: no what-if, where the same trace on ``cuda:0`` has one."""
    with open(mlp, "rb") as file:
        data = SnapshotUnpickler(file, str(mlp)).load()
    data[DEVICE_NAMES] = ["cpu"]
    device = Snapshot.from_dict(data, "cpu", what_if=True).devices[0]
    assert (device.name, device.entries, device.what_if) == ("cpu", 90, None)
