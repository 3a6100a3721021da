"""The report of a recording, rendered: exact text, an SVG timeline that parses, a page
with no network reference, and that page in a real browser (headless Chromium, where one
is installed)."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from standins import MiB
from torchmem.records.run import DeviceRun, Held, ModulePeak, RunRecord, Site
from torchmem.render import run


def sample() -> RunRecord:
    cpu = DeviceRun(
        device="cpu",
        start_bytes=1 * MiB,
        peak_bytes=300 * MiB,
        peak_time=2.5,
        end_bytes=40 * MiB,
        timeline=((1.0, 10 * MiB), (2.0, 120 * MiB), (3.0, 300 * MiB), (4.0, 40 * MiB)),
        categories_at_peak={
            "parameters": 8 * MiB,
            "gradients": 8 * MiB,
            "optimizer_state": 8 * MiB,
            "activations": 20 * MiB,
            "other": 256 * MiB,
        },
        categories_at_end={
            "parameters": 8 * MiB,
            "gradients": 8 * MiB,
            "optimizer_state": 16 * MiB,
            "activations": 0,
            "other": 8 * MiB,
        },
        sites_at_peak=(
            Site("train.py", 42, "step", 256 * MiB),
            Site("model.py", 10, "Net.forward", 20 * MiB),
            Site("<before recording>", 0, "", 1 * MiB),
        ),
        largest_at_peak=(
            Held("big", 256 * MiB, "other", (1024, 65536), "torch.float32", "train.py:42"),
            Held("fc1.weight", 8 * MiB, "parameters", (2048, 1024), "torch.float32", None),
        ),
    )
    ram = DeviceRun(
        "ram",
        100 * MiB,
        500 * MiB,
        2.5,
        450 * MiB,
        ((2.0, 200 * MiB), (4.0, 500 * MiB)),
        exact=False,
    )
    modules = (
        ModulePeak("", "Net", "cpu", 280 * MiB, 300 * MiB, 1),
        ModulePeak("fc1", "Linear", "cpu", 100 * MiB, None, 1),
    )
    return RunRecord(
        {"cpu": cpu, "ram": ram},
        modules,
        4.0,
        0,
        ("train.py", "--lr", "0.1"),
        ("Something was not seen.",),
    )


EXPECTED = """\
torchmem: where the memory went (4.00s, exit code 0)
command: train.py --lr 0.1

device    start      peak     at      end
cpu       1.00M   300.00M  2.50s   40.00M
ram     100.00M  ~500.00M  2.50s  450.00M
~ sampled, not exact: the true peak may be higher.

What the memory on cpu was:
  category         at the peak  at the end
  parameters             8.00M       8.00M
  gradients              8.00M       8.00M
  optimizer_state        8.00M      16.00M
  activations           20.00M       0.00B
  other                256.00M       8.00M

Allocation sites alive at the peak on cpu:
  256.00M  train.py:42         step
   20.00M  model.py:10         Net.forward
    1.00M  <before recording>

Largest allocations alive at the peak on cpu:
  256.00M  big         other       (1024, 65536)  torch.float32  train.py:42
    8.00M  fc1.weight  parameters  (2048, 1024)   torch.float32  -

Modules: highest memory in use on cpu while each ran:
  module  type    forward  backward  calls
  (top)   Net     280.00M   300.00M      1
  fc1     Linear  100.00M         -      1

Notes:
  - Something was not seen.
"""


def test_text_is_the_whole_summary() -> None:
    assert run.text(sample()) + "\n" == EXPECTED


def test_text_of_an_empty_block() -> None:
    empty = RunRecord({}, (), 0.5)
    assert run.text(empty).splitlines()[0] == "torchmem: where the memory went (0.50s)"


def test_svg_is_valid_and_marks_the_peak() -> None:
    cpu = sample().devices["cpu"]
    root = ET.fromstring(run.svg(cpu))
    assert root.tag.endswith("svg")
    texts = "".join(root.itertext())
    assert "peak 300.00M at 2.50s" in texts
    for timeline in ((), ((1.0, 5),)):
        ET.fromstring(run.svg(DeviceRun("cpu", 0, 5, 1.0, 5, timeline)))


def test_the_page_is_self_contained(tmp_path: Path) -> None:
    page = run.page(sample())
    assert page.startswith("<!DOCTYPE html>")
    for reference in ("http:", "https:", "<script", "<link", "src=", "url("):
        assert reference not in page
    assert page.count("<svg") == 2


def browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.slow
@pytest.mark.skipif(browser() is None, reason="no headless Chromium on PATH")
def test_the_page_renders_in_chromium_without_console_errors(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(run.page(sample()), encoding="utf-8")
    shot = tmp_path / "report.png"
    done = subprocess.run(
        [
            str(browser()),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={shot}",
            "--window-size=1000,1400",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Chromium logs what a page prints or throws as ":CONSOLE" lines (an uncaught error too).
    assert [line for line in done.stderr.splitlines() if ":CONSOLE" in line] == []
    assert shot.stat().st_size > 20_000  # a page with text, tables and two charts
