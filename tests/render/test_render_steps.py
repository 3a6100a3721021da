"""The steps and the growth in a run's text, HTML and JSON, from records made by hand."""

from __future__ import annotations

import json

from torchmem.records.run import DeviceRun, Growth, GrowthSite, HeldGraph, RunRecord, Step
from torchmem.render import run as render

K = 1024
GROWTH = Growth(
    "cpu",
    196_612,
    1,
    5,
    True,
    (
        GrowthSite(
            "train.py",
            9,
            "<module>",
            131_076,
            "loss = model(x).square().mean()",
            "held by list `losses`; kept with the autograd graph of a tensor in list"
            " `losses` (saved tensors of 1 module: 1 (ReLU)), after a backward pass through"
            " it (retain_graph=True)",
        ),
        GrowthSite("train.py", 8, "<module>", 65_536, "x = torch.randn(64, 256)", None),
    ),
    ram_bytes_per_step=200 * K,
)
GRAPHS = Growth(
    "cpu",
    0,
    1,
    1999,
    False,
    ram_bytes_per_step=7 * K,
    graphs=(
        HeldGraph("`total_loss`", 2000, 58_026, chained=True),
        HeldGraph("list `train_losses`", 1200, 200_000, chained=False, complete=False),
    ),
)
"""Tensors flat, and the graphs of every step kept: by a sum, and by a list."""


def record(growth: Growth | None = GROWTH) -> RunRecord:
    steps = (
        Step(0, 512 * K, 2048 * K, 1024 * K, 0.0, 0.5, ram_bytes=300 * K * K),
        Step(1, 1024 * K, 1536 * K, 1216 * K, 0.5, 0.75, ram_bytes=301 * K * K),
        Step(2, 1216 * K, 1792 * K, 1408 * K, 0.75, 1.0, ram_bytes=None),
        Step(3, 1408 * K, 2560 * K, 1600 * K, 1.0, 1.5, count=3, ram_bytes=302 * K * K),
    )
    cpu = DeviceRun("cpu", 512 * K, 2560 * K, 1.2, 1600 * K, (), steps=steps, growth=growth)
    return RunRecord({"cpu": cpu}, (), 2.0, steps_by="optimizer.step()")


def test_the_text_shows_the_first_step_the_others_together_and_the_growth() -> None:
    text = render.text(record(), width=100)
    block = text.split("\n\n")[2]
    assert block == "\n".join(
        [
            "Steps on cpu (each ends where optimizer.step() returns):",
            "  steps        start   peak    end  ram at end",
            "  0 (first)  512.00K  2.00M  1.00M     300.00M",
            "  1 to 5       1.00M  2.50M  1.56M     302.00M",
            "  cpu grows 192.00K per step from step 1, exactly at each of 5 steps (RAM"
            " +200.00K per step):",
            "    128.00K each step from train.py:9 (`loss = model(x).square().mean()`), held by"
            " list `losses`; kept with the autograd graph of a tensor in list `losses` (saved"
            " tensors of 1 module: 1 (ReLU)), after a backward pass through it"
            " (retain_graph=True)",
            "    64.00K each step from train.py:8 (`x = torch.randn(64, 256)`)",
        ]
    )


def test_a_run_that_does_not_grow_has_the_table_alone() -> None:
    block = render.text(record(growth=None), width=100).split("\n\n")[2]
    assert block.splitlines()[-1] == "  1 to 5       1.00M  2.50M  1.56M     302.00M"


def test_graphs_kept_from_every_step_are_named_with_their_fix() -> None:
    block = render.text(record(growth=GRAPHS), width=100).split("\n\n")[2]
    assert block.splitlines()[4:] == [
        "  cpu tensors do not grow, autograd graphs of every step do (RAM +7.00K per step"
        " from step 1, over 1999 steps):",
        "    `total_loss` chains each step's autograd graph to the one before: it keeps the"
        " graphs of 2,000 steps (58,026 nodes); detach it each step (`.detach()`, or"
        " `.item()` for a number)",
        "    list `train_losses` keeps an autograd graph of each of at least 1,200 steps (at"
        " least 200,000 nodes); keep what it holds detached (`.detach()`, or `.item()` for"
        " a number)",
    ]
    data = json.loads(json.dumps(record(growth=GRAPHS).to_json()))
    assert data["growth"]["ram_bytes_per_step"] == 7 * K
    assert data["growth"]["graphs"][1] == {
        "holder": "list `train_losses`",
        "steps": 1200,
        "nodes": 200_000,
        "chained": False,
        "complete": False,
    }
    assert RunRecord.from_json(data) == record(growth=GRAPHS)


def test_the_html_has_the_steps_and_the_growth() -> None:
    html = render.html(record())
    assert "Steps on cpu (each ends where optimizer.step() returns):" in html
    assert (
        "cpu grows 192.00K per step from step 1, exactly at each of 5 steps (RAM +200.00K per"
        " step):<br>  128.00K" in html
    )
    assert "held by list `losses`" in html


def test_the_json_round_trips() -> None:
    data = json.loads(json.dumps(record().to_json()))
    assert data["steps_by"] == "optimizer.step()"
    assert data["devices"]["cpu"]["steps"][3] == {
        "index": 3,
        "count": 3,
        "start_bytes": 1408 * K,
        "peak_bytes": 2560 * K,
        "end_bytes": 1600 * K,
        "ram_bytes": 302 * K * K,
        "start_s": 1.0,
        "end_s": 1.5,
    }
    assert data["growth"] == data["devices"]["cpu"]["growth"]
    assert data["growth"]["sites"][1] == {
        "file": "train.py",
        "line": 8,
        "function": "<module>",
        "bytes_per_step": 65_536,
        "source": "x = torch.randn(64, 256)",
        "reason": None,
    }
    assert RunRecord.from_json(data) == record()
