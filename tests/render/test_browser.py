"""The pages in a real browser: the run, estimate and snapshot pages opened from disk in
headless Chromium, in a narrow and a wide window, load with no console error and no request
(nothing from the network), and the run's timeline shows an interval's exact values on hover.

Needs Chromium at /usr/bin/chromium (Debian's ``chromium`` package) and the ``playwright``
package, which drives it (its own browsers are never downloaded); skipped without them.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import torchmem
from test_snapshot import snapshot_dict
from torchmem.records.run import RunRecord
from torchmem.snapshot import Snapshot

pytestmark = pytest.mark.integration

SCREENSHOTS = Path(__file__).resolve().parents[2] / "scripts" / "screenshots.py"


def _screenshots() -> ModuleType:
    """``scripts/screenshots.py``: this check opens the pages as the screenshots do (the
    same Chromium, switches, windows, and list of a page's problems)."""
    spec = importlib.util.spec_from_file_location("screenshots", SCREENSHOTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


screenshots = _screenshots()
WINDOWS: dict[str, tuple[int, int]] = screenshots.WINDOWS


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not Path(screenshots.CHROMIUM).exists():
        pytest.skip(f"no Chromium at {screenshots.CHROMIUM} (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    with screenshots.browser() as browser:
        yield browser


def train() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        model(torch.randn(64, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], RunRecord]:
    folder = tmp_path_factory.mktemp("pages")
    with torchmem.record("cpu") as recording:
        train()
    report = recording.report()
    found = {name: folder / f"{name}.html" for name in ("run", "estimate", "snapshot")}
    report.save_html(found["run"])
    torchmem.estimate(train, device="cpu").save_html(found["estimate"])
    Snapshot.from_dict(snapshot_dict(), "snapshot.pickle").save_html(found["snapshot"])
    return found, report


def open_page(chromium: Any, path: Path, window: str) -> Any:
    """`path` opened from disk in a window of :data:`WINDOWS`: the page, and its problems
    (console errors, uncaught exceptions, and every request that is not for a file)."""
    return screenshots.opened(chromium, path, WINDOWS[window])


def test_the_check_sees_an_error_and_a_request(chromium: Any, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>x</title></head><body>'
        '<img src="https://example.invalid/x.png"><script>undefinedFunction();</script>'
        "</body></html>"
    )
    with open_page(chromium, broken, "wide") as (_, problems):
        pass
    assert any("undefinedFunction is not defined" in p for p in problems)
    assert "https://example.invalid/x.png" in problems


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", ["run", "estimate", "snapshot"])
def test_each_page_opens_offline_without_errors(
    chromium: Any, pages: tuple[dict[str, Path], RunRecord], name: str, window: str
) -> None:
    with open_page(chromium, pages[0][name], window) as (page, problems):
        assert problems == []
        assert page.locator("svg").count() >= 1
        # No horizontal scroll bar for the page itself: wide tables scroll on their own.
        assert page.evaluate("document.documentElement.scrollWidth") <= WINDOWS[window][0]


@pytest.mark.parametrize("window", WINDOWS)
def test_hovering_the_timeline_shows_the_intervals_exact_values(
    chromium: Any, pages: tuple[dict[str, Path], RunRecord], window: str
) -> None:
    found, record = pages
    run = record.devices["cpu"]
    assert run.timeline_categories is not None  # a recording with an event log
    with open_page(chromium, found["run"], window) as (page, problems):
        chart = page.locator('.torchmem-chart[data-device="cpu"]')
        tip = chart.locator(".torchmem-tip")
        assert tip.is_hidden()
        box = chart.locator("svg").bounding_box()
        seconds = float(chart.locator("svg").get_attribute("viewBox").split()[2])
        x = box["x"] + run.peak_time / seconds * box["width"]
        page.mouse.move(x, box["y"] + box["height"] / 2)
        assert tip.is_visible()
        shown = tip.inner_text()
        # Milliseconds where the run took under 0.1 s (a warm process), else seconds.
        value, unit = re.match(r"([\d.]+)(ms|s) to ", shown).groups()  # type: ignore[union-attr]
        start = float(value) / (1e3 if unit == "ms" else 1)
        # The interval under the pointer (the timeline's times, to the millisecond).
        index = min(range(len(run.timeline)), key=lambda i: abs(_start(run, i) - start))
        total, row = run.timeline[index][1], run.timeline_categories[index]
        assert f"total: {total:,} bytes" in shown
        assert f"parameters: {row[0]:,} bytes" in shown
        assert f"optimizer_state: {row[2]:,} bytes" in shown
        page.mouse.move(1, 1)
        assert tip.is_hidden()
        assert problems == []


def _start(run: Any, index: int) -> float:
    return 0.0 if index == 0 else float(run.timeline[index - 1][0])
