"""The examples of the README and of the manual (docs/*.md) work when pasted: each Python
block that a page follows with its output runs alone, as a script in a fresh process
without GPUs, and prints exactly that output. Figures of this machine (its total and free
memory) are the only thing masked."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The README and every page of the manual."""
MACHINE = re.compile(r"\d+\.\d\d[KMGTP]?")
"""A size in the lines that describe this machine's memory."""

pytestmark = pytest.mark.slow  # a fresh process per example


def examples(pages: list[Path] = PAGES) -> list[tuple[str, str, str]]:
    """(where, code, output) for each Python block directly followed by an output block,
    where is ``page:line``."""
    found = []
    for page in pages:
        text = page.read_text()
        blocks = list(re.finditer(r"```(\w*)\n(.*?)```", text, re.S))
        for block, after in itertools.pairwise(blocks):
            if block.group(1) == "python" and not text[block.end() : after.start()].strip():
                line = text.count("\n", 0, block.start()) + 2
                where = f"{page.relative_to(ROOT)}:{line}"
                found.append((where, block.group(2), after.group(2)))
    return found


def masked(output: str) -> str:
    """`output` without what only this machine decides: its memory and the traceback."""
    output = output.split("Traceback (most recent call last):")[0]
    lines = output.rstrip("\n").splitlines()
    mine = [line.startswith("Device:") or "whole device" in line for line in lines]
    return "\n".join(MACHINE.sub("<size>", t) if m else t for t, m in zip(lines, mine, strict=True))


def test_the_readme_and_the_manual_have_examples_with_output() -> None:
    assert len(examples([README])) >= 2
    assert len(examples()) >= 9


@pytest.mark.parametrize(
    ("where", "code", "output"), examples(), ids=[where for where, _, _ in examples()]
)
def test_an_example_prints_what_its_page_shows(
    where: str, code: str, output: str, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    shown = done.stderr if output.startswith("Out of memory") else done.stdout
    assert masked(shown) == masked(output), where


def test_the_devices_sample_has_every_line_the_command_prints() -> None:
    # The quick start showed two of its three lines.
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    sample = quickstart.split("$ torchmem devices\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-m", "torchmem", "devices"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )

    def shape(text: str) -> list[str]:
        """Each line up to what this machine decides: sizes, and the CPU meter's backend."""
        return [MACHINE.sub("<size>", line.split(" counted by ")[0]) for line in text.splitlines()]

    assert shape(sample) == shape(done.stdout)
