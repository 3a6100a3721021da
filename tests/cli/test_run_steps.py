"""``torchmem run`` on a script whose memory grows each step: the installed command in a
subprocess, its JSON's steps and growth, and the summary's words."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.counting

LEAKS = textwrap.dedent(
    """\
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    history = []
    for step in range(8):
        out = model(torch.randn(64, 256))
        history.append(out)
        optimizer.zero_grad()
        out.square().mean().backward()
        optimizer.step()
    """
)
"""Each step keeps its output, 64 x 256 float32: 65,536 bytes, in ``history``."""


def test_the_json_and_the_summary_name_the_growth(tmp_path: Path) -> None:
    (tmp_path / "leaks.py").write_text(LEAKS)
    command = [sys.executable, "-m", "torchmem", "run", "--json", "out.json", "leaks.py"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["steps_by"] == "optimizer.step()"
    cpu = report["devices"]["cpu"]
    steps = cpu["steps"]
    assert [s["index"] for s in steps] == list(range(8))
    assert all(s["count"] == 1 for s in steps)
    ends = [s["end_bytes"] for s in steps]
    assert [b - a for a, b in itertools.pairwise(ends)] == [65_536] * 7
    assert all(s["start_bytes"] <= s["peak_bytes"] >= s["end_bytes"] for s in steps)
    assert [s["start_bytes"] for s in steps[1:]] == ends[:-1]
    growth = cpu["growth"]
    assert report["growth"] == growth
    assert {k: growth[k] for k in ("device", "bytes_per_step", "first_step", "exact")} == {
        "device": "cpu",
        "bytes_per_step": 65_536,
        "first_step": 1,
        "exact": True,
    }
    assert growth["steps"] == 7
    assert growth["sites"] == [
        {
            "file": "leaks.py",
            "line": 9,
            "function": "<module>",
            "bytes_per_step": 65_536,
            "source": "out = model(torch.randn(64, 256))",
            "reason": "held by list `history`",
        }
    ]
    assert re.search(
        r"cpu grows 64\.00K per step from step 1, exactly at each of 7 steps \(RAM"
        r" [+-]?\d+\.\d\d[BKMGT] per step\):\n",
        done.stderr,
    )
    assert (
        "64.00K each step from leaks.py:9 (`out = model(torch.randn(64, 256))`), held by list"
        " `history`" in done.stderr
    )


KEEPS_BATCHES = textwrap.dedent(
    """\
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 256), torch.randn(512, 256))
    loader = DataLoader(data, batch_size=64, num_workers=int(sys.argv[1]), in_order=False)
    model = torch.nn.Linear(256, 256, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for x, y in loader:
        loss = (model(x) - y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kept.append(x)
    """
)
"""Each step keeps its batch's inputs, 64 x 256 float32: 65,536 bytes, in ``kept``; from
DataLoader workers (argument 2) they arrive in shared memory, each step the batch that came
first (``in_order=False``)."""


@pytest.mark.slow
def test_batches_from_dataloader_workers_grow_at_the_loops_line_as_without(
    tmp_path: Path,
) -> None:
    (tmp_path / "keeps.py").write_text(KEEPS_BATCHES)
    reports, said = [], []
    for workers in ("0", "2"):
        out = f"out{workers}.json"
        command = [sys.executable, "-m", "torchmem", "run", "--json", out, "keeps.py", workers]
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        reports.append(json.loads((tmp_path / out).read_text()))
        said.append(done.stderr)
    growth = reports[1]["growth"]
    assert {k: growth[k] for k in ("bytes_per_step", "first_step", "exact")} == {
        "bytes_per_step": 65_536,
        "first_step": 1,
        "exact": True,
    }
    assert growth["sites"] == [
        {
            "file": "keeps.py",
            "line": 11,
            "function": "<module>",
            "bytes_per_step": 65_536,
            "source": "for x, y in loader:",
            "reason": "held by list `kept`",
        }
    ]
    for report in reports:  # the process's RSS is not the same with workers (nor exact)
        report["devices"]["cpu"]["growth"].pop("ram_bytes_per_step")
    for key in ("start_bytes", "peak_bytes", "end_bytes", "growth", "categories_at_end"):
        assert len({json.dumps(r["devices"]["cpu"][key]) for r in reports}) == 1, key
    bytes_of = ("start_bytes", "peak_bytes", "end_bytes")
    steps = [[[s[k] for k in bytes_of] for s in r["devices"]["cpu"]["steps"]] for r in reports]
    assert steps[0] == steps[1] and len(steps[0]) == 8
    workers = reports[1]["workers"]
    assert workers["interval_s"] == 0.05 and not workers["exact"]
    assert len(workers["processes"]) == 2
    assert all(w["peak_rss_bytes"] > 0 for w in workers["processes"])
    assert reports[0]["workers"] == {"interval_s": 0.05, "exact": False, "processes": []}
    assert "DataLoader workers (processes of their own):" in said[1]
    assert "DataLoader workers" not in said[0]


TOTAL = textwrap.dedent(
    """\
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    total_loss = 0.0
    for step in range(8):
        loss = model(torch.randn(64, 256)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total_loss += loss
    """
)
"""PyTorch's FAQ: ``total_loss += loss`` after the backward pass keeps no tensor (the
backward pass freed what the graph saved) but every step's graph: 8 steps of
``MeanBackward0``, ``PowBackward0``, ``ReluBackward0``, ``MmBackward0``, ``TBackward0``
and the sum's ``AddBackward0``, and the weight's gradient accumulator: 49 nodes."""


def test_a_loss_summed_with_its_graph_is_named_though_no_tensor_grows(tmp_path: Path) -> None:
    (tmp_path / "total.py").write_text(TOTAL)
    command = [sys.executable, "-m", "torchmem", "run", "--json", "out.json", "total.py"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    cpu = report["devices"]["cpu"]
    ends = [s["end_bytes"] for s in cpu["steps"]]
    assert len(set(ends[1:])) == 1  # the tensors do not grow
    assert all(isinstance(s["ram_bytes"], int) for s in cpu["steps"])
    growth = report["growth"]
    assert isinstance(growth.pop("ram_bytes_per_step"), int)
    assert growth == {
        "device": "cpu",
        "bytes_per_step": 0,
        "first_step": 1,
        "steps": 7,
        "exact": False,
        "sites": [],
        "graphs": [
            {"holder": "`total_loss`", "steps": 8, "nodes": 49, "chained": True, "complete": True}
        ],
    }
    assert re.search(
        r"cpu tensors do not grow, autograd graphs of every step do \(RAM [+-]?\d+\.\d\d[BKMGT]"
        r" per step from step 1, over 7 steps\):\n",
        done.stderr,
    )
    assert (
        "`total_loss` chains each step's autograd graph to the one before: it keeps the graphs"
        " of 8 steps (49 nodes); detach it each step (`.detach()`, or `.item()` for a number)"
        in done.stderr
    )
