"""Screenshots of torchmem's three pages (a run, an estimate, a snapshot) in headless
Chromium, each in a narrow and a wide window, to look at after a change to the renderers.

    python scripts/screenshots.py OUT_DIR [--chromium /usr/bin/chromium]

Writes ``OUT_DIR/<page>.html`` and ``OUT_DIR/<page>-<narrow|wide>.png``, and prints each
page's console errors and failed requests (there should be none). Needs the ``playwright``
package (the ``dev`` extra) and a Chromium of the system's: playwright's own browsers are
never downloaded.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Iterator
from contextlib import chdir, contextmanager
from pathlib import Path
from typing import Any

import torchmem

CHROMIUM = "/usr/bin/chromium"
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
"""Chromium's switches: no sandbox (containers), and nothing that reaches the network."""
WINDOWS = {"narrow": (400, 900), "wide": (1600, 900)}


TRAIN = """\
import torch


def train(steps=4, batch=256):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        x = torch.randn(batch, 512)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""
"""A small training loop, written to the output folder as ``train.py`` so that the pages
name its lines as a user's script would be named."""


def make_pages(folder: Path) -> dict[str, Path]:
    """The run page of a real recording of ``train.py``'s loop, the estimate page of the
    same loop, and the snapshot page of the recording's memory snapshot, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(TRAIN)
    pages = {name: (folder / f"{name}.html").resolve() for name in ("run", "estimate", "snapshot")}
    with chdir(folder):
        train = runpy.run_path("train.py")["train"]
        train(steps=1)  # PyTorch's first calls are slow: the recording shows the loop instead
        with torchmem.record("cpu") as recording:
            train()
        recording.report().save_html(pages["run"])
        recording.save_snapshot("snapshot.pickle")
        torchmem.load_snapshot("snapshot.pickle").save_html(pages["snapshot"])
        torchmem.estimate(train, device="cpu").save_html(pages["estimate"])
    return pages


@contextmanager
def browser(executable: str = CHROMIUM) -> Iterator[Any]:
    """Chromium of the system through playwright, headless and offline."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable, args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@contextmanager
def opened(chromium: Any, path: Path, size: tuple[int, int]) -> Iterator[tuple[Any, list[str]]]:
    """`path` open from disk in a window of `size`, and the list of its problems so far:
    console errors, uncaught exceptions and failed requests."""
    width, height = size
    context = chromium.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else 0)
    page.on("pageerror", lambda e: problems.append(f"error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("request", lambda r: 0 if r.url.startswith("file:") else problems.append(r.url))
    try:
        page.goto(path.resolve().as_uri())
        page.wait_for_load_state("load")
        yield page, problems
    finally:
        context.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder for the pages and screenshots")
    parser.add_argument("--chromium", default=CHROMIUM, help="Chromium's executable")
    args = parser.parse_args(argv)
    pages = make_pages(args.out)
    failed = False
    with browser(args.chromium) as chromium:
        for name, path in pages.items():
            for window, size in WINDOWS.items():
                with opened(chromium, path, size) as (page, problems):
                    dot = page.locator(".torchmem-peak-dot").first.bounding_box()
                    if dot is not None:  # the values at the peak, where the page has hover
                        page.mouse.move(dot["x"] + dot["width"] / 2, dot["y"] + 30)
                    png = args.out / f"{name}-{window}.png"
                    page.screenshot(path=str(png), full_page=True)
                print(f"{png}: {'; '.join(problems) or 'no errors'}")
                failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
