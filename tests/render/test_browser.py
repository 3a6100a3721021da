"""The pages in a real browser: the run, estimate and snapshot pages opened from disk in
headless Chromium, in a narrow and a wide window, load with no console error and no request
(nothing from the network), and the run's timeline shows an interval's exact values on hover.

Needs Chromium at /usr/bin/chromium (Debian's ``chromium`` package) and the ``playwright``
package, which drives it (its own browsers are never downloaded); skipped without them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from test_snapshot import snapshot_dict
from torchmem.records.run import RunRecord
from torchmem.snapshot import Snapshot

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
WINDOWS = {"narrow": (400, 900), "wide": (1600, 900)}


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (the dev extra)"
    )
    with sync_api.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


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


def open_page(chromium: Any, path: Path, window: str) -> tuple[Any, list[str]]:
    """`path` opened from disk in a window of :data:`WINDOWS`, and its problems: console
    errors, uncaught exceptions, and every request that is not for a file."""
    width, height = WINDOWS[window]
    page = chromium.new_context(viewport={"width": width, "height": height}).new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
    page.on("request", lambda r: None if r.url.startswith("file:") else problems.append(r.url))
    page.goto(path.resolve().as_uri(), wait_until="load")
    return page, problems


def test_the_check_sees_an_error_and_a_request(chromium: Any, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>x</title></head><body>'
        '<img src="https://example.invalid/x.png"><script>undefinedFunction();</script>'
        "</body></html>"
    )
    page, problems = open_page(chromium, broken, "wide")
    page.context.close()
    assert any("undefinedFunction is not defined" in p for p in problems)
    assert "https://example.invalid/x.png" in problems


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", ["run", "estimate", "snapshot"])
def test_each_page_opens_offline_without_errors(
    chromium: Any, pages: tuple[dict[str, Path], RunRecord], name: str, window: str
) -> None:
    page, problems = open_page(chromium, pages[0][name], window)
    try:
        assert problems == []
        assert page.locator("svg").count() >= 1
        # No horizontal scroll bar for the page itself: wide tables scroll on their own.
        assert page.evaluate("document.documentElement.scrollWidth") <= WINDOWS[window][0]
    finally:
        page.context.close()


@pytest.mark.parametrize("window", WINDOWS)
def test_hovering_the_timeline_shows_the_intervals_exact_values(
    chromium: Any, pages: tuple[dict[str, Path], RunRecord], window: str
) -> None:
    found, record = pages
    run = record.devices["cpu"]
    assert run.timeline_categories is not None  # a recording with an event log
    page, problems = open_page(chromium, found["run"], window)
    try:
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
    finally:
        page.context.close()


def _start(run: Any, index: int) -> float:
    return 0.0 if index == 0 else float(run.timeline[index - 1][0])
