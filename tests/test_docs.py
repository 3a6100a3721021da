"""The README stays short, and the links of the README and of the manual (docs/*.md) lead
somewhere: every relative link names a file of the repository. The manual's examples run in
tests/test_readme.py; the site builds with `mkdocs build --strict` in scripts/test.sh."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
"""A Markdown link's target: ``[text](target)``."""


def links(page: Path) -> list[str]:
    """The link targets of `page`, outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def relative(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith(("#", "/"))


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move the detail into docs/"


def test_the_link_finder_finds_links() -> None:
    assert "docs/index.md" in links(README)
    assert "CHANGELOG.md" in links(README)
    assert "process.md" in links(ROOT / "docs" / "architecture.md")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_names_a_file(page: Path) -> None:
    broken = [
        target
        for target in links(page)
        if relative(target) and not (page.parent / target.split("#", 1)[0]).exists()
    ]
    assert broken == [], f"{page.relative_to(ROOT)} links to missing files: {broken}"
