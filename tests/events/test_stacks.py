"""The stacks at the peak are those of the allocations alive at the peak: a line reached
from two callers shows the caller whose memory is alive, or both with their own bytes, on
CPU (the counting allocator's log) and CUDA (PyTorch's allocator history, real H100 data);
the icicle draws what the JSON says."""

from __future__ import annotations

import gzip
import html
import json
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_sites import ALLOCATOR, cpp, py

import torchmem
from standins import MiB
from torchmem.events.analysis import Names, device_run
from torchmem.events.hooks import Watcher
from torchmem.events.sources import Log, cuda_events
from torchmem.records.frames import SiteKey, Stack, located, shown, stack_site
from torchmem.records.run import Site, SiteStack
from torchmem.render.icicle import SMALLEST, UNNAMED

counting = pytest.mark.counting
HERE = shown(__file__)
RECORDED = Path(__file__).resolve().parents[1] / "data" / "gpu_truth" / "recorded"

TWO_CALLERS = textwrap.dedent(
    """\
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    kept = []


    def forward(x):
        return model(x)  # the line both callers reach


    def evaluate():
        with torch.no_grad():
            return forward(torch.randn(64, 256)).sum().item()


    def train_step():
        out = forward(torch.randn(64, 256))
        kept.append(out)  # alive at the peak, with what autograd saved


    def main():
        evaluate()
        for _ in range(4):
            train_step()
        big = torch.zeros(1024, 1024)  # the peak
        del big


    main()
    """
)
"""A forward called first from a ``no_grad`` ``evaluate()``, which keeps nothing, then from
``train_step()``, which keeps each step's output and the activations saved for it."""


def run_two_callers(tmp_path: Path) -> tuple[dict[str, Any], str]:
    """The JSON and the HTML page of ``torchmem run`` on :data:`TWO_CALLERS`."""
    (tmp_path / "two.py").write_text(TWO_CALLERS)
    command = [sys.executable, "-m", "torchmem", "run", "-q", "--json", "r.json"]
    done = subprocess.run(
        [*command, "--html", "r.html", "two.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    return report, (tmp_path / "r.html").read_text()


def script_frames(stack: list[list[Any]], script: str) -> list[tuple[int, str]]:
    """The lines and functions of `script` in a JSON stack, innermost first."""
    return [(line, function) for file, line, function in stack if file == script]


@counting
def test_the_stack_of_a_line_is_its_caller_whose_memory_is_alive_at_the_peak(
    tmp_path: Path,
) -> None:
    report, _ = run_two_callers(tmp_path)
    (forward,) = (s for s in report["devices"]["cpu"]["sites_at_peak"] if s["line"] == 9)
    # 4 steps: ReLU's output (saved for backward, 64 x 1024 floats) and the model's output
    # (64 x 256 floats); evaluate's were freed long before the peak.
    assert (forward["file"], forward["bytes"]) == ("two.py", 4 * (256 + 64) * 1024)
    through = {}
    for stack in forward["stacks"]:
        path = tuple(script_frames(stack["stack"], "two.py"))
        through[path] = through.get(path, 0) + stack["bytes"]
    assert through == {
        ((9, "forward"), (18, "train_step"), (25, "main"), (30, "<module>")): 1_310_720
    }
    assert forward["stack"] == forward["stacks"][0]["stack"]  # the largest, as before


def keep(size: int) -> torch.Tensor:
    return torch.zeros(size)  # one line, two callers


def small_caller(kept: list[torch.Tensor]) -> None:
    kept.append(keep(MiB // 4))


def large_caller(kept: list[torch.Tensor]) -> None:
    kept.append(keep(3 * MiB // 4))


@counting
def test_a_line_reached_two_ways_alive_at_the_peak_shows_both_with_their_bytes() -> None:
    kept: list[torch.Tensor] = []
    with torchmem.record("cpu") as rec:
        for caller in (small_caller, large_caller, small_caller):
            caller(kept)  # one line: small_caller's two calls have one stack
    line = keep.__code__.co_firstlineno + 1
    (site,) = (s for s in rec.report().devices["cpu"].sites_at_peak if s.file == HERE)
    assert (site.line, site.function, site.bytes) == (line, "keep", 5 * MiB)
    callers = [
        (nbytes, [(f[1], f[2]) for f in stack if f[0] == HERE][:2]) for nbytes, stack in site.stacks
    ]
    large, small = (f.__code__.co_firstlineno + 1 for f in (large_caller, small_caller))
    assert callers == [
        (3 * MiB, [(line, "keep"), (large, "large_caller")]),
        (2 * MiB, [(line, "keep"), (small, "small_caller")]),
    ]


def icicle_boxes(page: str) -> list[tuple[int, str, int]]:
    """The boxes of a page's icicle: depth, the frame they name (the first two lines of
    their tooltip) and bytes, the root left out."""
    found = []
    box = r'<div class="torchmem-box" data-bytes="(\d+)" data-depth="(\d+)" title="([^"]*)"'
    for nbytes, depth, title in re.findall(box, page):
        lines = html.unescape(title).split("\n")
        if int(depth):
            named = lines[:1] if re.match(r"[\d,]+ bytes", lines[1]) else lines[:2]
            found.append((int(depth), "\n".join(named), int(nbytes)))
    return sorted(found)


def json_boxes(device: dict[str, Any]) -> list[tuple[int, str, int]]:
    """The boxes the icicle must draw from a device's ``sites_at_peak`` and their
    ``stacks``: each stack's frames from the outermost in, down to its site's line, with
    its bytes; a site's bytes no stack holds, and the peak's bytes no site names, under
    the root. Boxes narrower than 1/SMALLEST of the peak are not drawn."""
    paths: dict[Stack, int] = {}
    named = 0
    for site in device["sites_at_peak"]:
        own = (site["file"], site["line"], site["function"])
        for each in site["stacks"]:
            path = [tuple(f) for f in reversed(each["stack"])]
            if not any(f[:2] == own[:2] for f in path):
                path.append(own)
            for depth in range(1, len(path) + 1):
                prefix = tuple(path[:depth])
                paths[prefix] = paths.get(prefix, 0) + each["bytes"]
        rest = site["bytes"] - sum(each["bytes"] for each in site["stacks"])
        if rest > 0 or not site["stacks"]:
            paths[(own,)] = paths.get((own,), 0) + rest
        named += site["bytes"]
    if device["peak_bytes"] > named:
        paths[((UNNAMED, 0, ""),)] = device["peak_bytes"] - named
    found = []
    for path, nbytes in paths.items():
        if nbytes * SMALLEST >= device["peak_bytes"]:
            file, line, function = path[-1]
            where = located(file, line)
            found.append((len(path), f"{function}\n{where}" if function else where, nbytes))
    return sorted(found)


@counting
def test_the_icicle_draws_the_stacks_the_json_holds(tmp_path: Path) -> None:
    report, page = run_two_callers(tmp_path)
    cpu = report["devices"]["cpu"]
    drawn = icicle_boxes(page)
    assert drawn == json_boxes(cpu)
    assert not [box for box in drawn if box[1].startswith("evaluate\n")]
    # train_step's line: the forward's bytes below it, and its own input (saved by layer 0).
    assert [box[2] for box in drawn if box[1] == "train_step\ntwo.py:18"] == [1_572_864]


def test_cuda_allocations_keep_their_own_stacks() -> None:
    """One line of the model reached through two callers: each allocation's stack, not the
    first one seen."""
    line = py("/home/u/model.py", 22, "forward")
    train = [*ALLOCATOR, cpp("at::empty"), line, py("/home/u/train.py", 40, "train_step")]
    evaluate = [*ALLOCATOR, cpp("at::empty"), line, py("/home/u/train.py", 12, "evaluate")]
    trace = [
        {"action": "alloc", "addr": a, "size": s, "time_us": t, "frames": f}
        for a, s, t, f in (
            (0, MiB, 1, evaluate),
            (MiB, 4 * MiB, 2, train),
            (5 * MiB, 2 * MiB, 3, evaluate),
        )
    ]
    events, sites = cuda_events(trace, 0, 0)
    assert events[:, 3].tolist() == [0, 1, 0]
    assert [sites[i].stack[1][2] for i in (0, 1)] == ["evaluate", "train_step"]
    found = Log("cuda:0", 0, 0, events, sites).tally()
    run = device_run(found, 10_000, Names(Watcher()), Watcher().names, {}, 10)
    frame = ("/home/u/model.py", 22, "forward")
    stacks = (
        SiteStack(4 * MiB, (frame, ("/home/u/train.py", 40, "train_step"))),
        SiteStack(3 * MiB, (frame, ("/home/u/train.py", 12, "evaluate"))),
    )
    assert run.sites_at_peak == (Site(*frame, 7 * MiB, stacks),)
    assert run.sites_at_peak[0].stacks == stacks


def test_a_real_cuda_historys_stacks_at_the_peak_are_its_allocations() -> None:
    """An H100's history of a language model's training step: each site's stacks at the
    peak are those of the allocations alive there, told from the trace alone."""
    packed = (RECORDED / "lm-small-fullstep-fp32.pickle.gz").read_bytes()
    data = pickle.loads(gzip.decompress(packed))  # the project's own test data
    trace = data["device_traces"][0]
    own = [s for s in data["segments"] if s.get("device") == 0]
    events, sites = cuda_events(trace, 0, 0, own)
    rows = events.numpy()
    peak = int(np.argmax(np.cumsum(rows[:, 2])))
    alive: dict[tuple[tuple[str, int, str], Stack], int] = {}
    allocs = [e for e in trace if e["action"] == "alloc"]
    made = np.flatnonzero(rows[:, 2] > 0)
    assert len(made) == len(allocs)
    for k, entry in zip(made.tolist(), allocs, strict=True):
        frames = [(f["filename"], int(f["line"]), f["name"]) for f in entry["frames"]]
        key = SiteKey(*stack_site(frames))
        assert (sites[int(rows[k, 3])], sites[int(rows[k, 3])].stack) == (key, key.stack)
        freed = int(rows[k, 4])
        if key.stack and k <= peak and (freed < 0 or freed > peak):
            mine = (tuple(key), key.stack)
            alive[mine] = alive.get(mine, 0) + int(rows[k, 2])
    found = Log("cuda:0", 0, 0, events, sites).tally()
    run = device_run(found, 10**12, Names(Watcher()), Watcher().names, {}, 10)
    recorded = {
        ((s.file, s.line, s.function), each.stack): each.bytes
        for s in run.sites_at_peak
        for each in s.stacks
    }
    assert recorded == alive
    several = [s for s in run.sites_at_peak if len(s.stacks) > 1]
    assert several and all(sum(e.bytes for e in s.stacks) == s.bytes for s in several)


def test_a_sites_stacks_travel_in_the_json_and_an_older_reports_stack_loads() -> None:
    line = ("model.py", 9, "forward")
    stacks = (
        SiteStack(3 * MiB, (line, ("train.py", 18, "train_step"))),
        SiteStack(MiB, (line, ("train.py", 12, "evaluate"))),
    )
    site = Site(*line, 4 * MiB, stacks, "return model(x)")
    written = json.loads(json.dumps(site.to_json()))
    assert written["stack"] == [list(f) for f in stacks[0].stack]
    back = Site.from_json(written)
    assert (back, back.stacks, back.source) == (site, stacks, "return model(x)")
    older = {k: v for k, v in written.items() if k != "stacks"}  # before stacks were kept
    assert Site.from_json(older).stacks == (SiteStack(4 * MiB, stacks[0].stack),)
