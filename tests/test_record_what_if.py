"""A recording of a GPU: its allocator history replayed under other allocator settings in
the run's report (the fragmentation at the peak, each setting's reserved peak), in text,
HTML and JSON. Without a GPU the history is a real one: the MLP's Adam step recorded on an
H100 (``tests/data/gpu_truth/recorded``), as ``torch.cuda.memory._snapshot()`` returns it
and as the recording keeps it; its figures are in ``test_snapshot_whatif``'s docstring
(under ``expandable_segments:True`` the real run reserved 4 MiB less)."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from test_snapshot_whatif import LINES
from torchmem.estimator.whatif import what_if
from torchmem.recording import RunReport, _what_ifs
from torchmem.records.run import DeviceRun, RunRecord

RECORDED = Path(__file__).resolve().parent / "data" / "gpu_truth" / "recorded"


def history() -> dict[str, Any]:
    """The real history: plain data (dicts, lists, numbers, strings)."""
    data = gzip.decompress((RECORDED / "mlp-adam-step.pickle.gz").read_bytes())
    return pickle.loads(data)  # the project's own test data


def device(name: str) -> DeviceRun:
    return DeviceRun(name, 0, 106_238_464, 0.5, 98_783_232, ((1.0, 106_238_464),))


def test_each_gpu_of_a_recording_gets_its_historys_what_if() -> None:
    found = _what_ifs({"cuda:0": device("cuda:0"), "cpu": device("cpu")}, history())
    assert found["cpu"] == device("cpu")
    gpu = found["cuda:0"].what_if
    assert gpu == what_if(history(), device=0)
    assert gpu is not None and gpu.reproduced
    assert gpu.reserved_peak_bytes == 117_440_512  # max_memory_reserved() of the real run
    expandable = next(o for o in gpu.alternatives if o.settings == "expandable_segments:True")
    assert expandable.reserved_peak_bytes == 113_246_208  # the real run under that setting
    assert _what_ifs({"cpu": device("cpu")}, None) == {"cpu": device("cpu")}


def test_the_run_report_shows_and_saves_the_what_if(tmp_path: Path) -> None:
    devices = _what_ifs({"cuda:0": device("cuda:0")}, history())
    report = RunReport(devices, (), 1.0)
    assert LINES in str(report)
    html = report._repr_html_()
    assert "with expandable_segments:True the reserved peak would be 108.00M" in html
    report.save_json(tmp_path / "run.json")
    back = RunRecord.from_json(json.loads((tmp_path / "run.json").read_text()))
    assert back.devices["cuda:0"].what_if == devices["cuda:0"].what_if


@pytest.mark.cuda
def test_a_recorded_gpu_step_has_its_what_if() -> None:
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.Adam(model.parameters())
    with torchmem.record("cuda:0") as rec:
        for _ in range(2):
            model(torch.randn(256, 1024, device="cuda")).sum().backward()
            optimizer.step()
        torch.cuda.synchronize()
    found = rec.report().devices["cuda:0"].what_if
    assert found is not None and found.reproduced, found
    assert found.today is not None
    assert found.today.allocated_peak_bytes >= rec.report().devices["cuda:0"].peak_bytes
