"""Hostile memory snapshots: names that are not UTF-8 are written, escaped, where reports
go."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchmem.records.run import DeviceRun, Site
from torchmem.snapshot import Snapshot

NOT_UTF8 = os.fsdecode(b"/tmp/x\xff/train.py")
"""A script's path in a folder whose name is not UTF-8, as Python names it (U+DCFF)."""


def block(size: int, frames: object = (), **more: Any) -> dict[str, Any]:
    return {"address": 0, "size": size, "state": "active_allocated", "frames": frames, **more}


def segment(*blocks: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"device": 0, "address": 0, "total_size": 512, "blocks": list(blocks), **more}


def entry(action: str, **more: Any) -> dict[str, Any]:
    return {"action": action, "addr": 0, "size": 512, "time_us": 1, **more}


def written(tmp_path: Path, content: bytes | object, name: str = "evil.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else pickle.dumps(content))
    return path


# -- names that are not UTF-8 ----------------------------------------------------------------


def not_utf8_snapshot() -> dict[str, Any]:
    frames = [{"filename": NOT_UTF8, "line": 3, "name": "main"}]
    return {
        "segments": [segment(block(512, frames))],
        "device_traces": [[entry("alloc", frames=frames)]],
    }


def test_a_file_name_that_is_not_utf8_is_written_escaped(tmp_path: Path) -> None:
    snapshot = Snapshot.from_dict(not_utf8_snapshot(), os.fsdecode(b"s\xff.pickle"))
    page = tmp_path / "page.html"
    snapshot.save_html(page)
    text = page.read_text(encoding="utf-8")
    assert "<title>torchmem: memory snapshot of s\\xff.pickle</title>" in text
    assert "/tmp/x\\xff/train.py:3" in text
    assert "  512.00B  /tmp/x\\xff/train.py:3  main" in str(snapshot).splitlines()
    assert json.loads(json.dumps(snapshot.to_json()))["devices"]["0"]["sites"][0] == {
        "file": NOT_UTF8,
        "line": 3,
        "function": "main",
        "bytes": 512,
        "stack": [[NOT_UTF8, 3, "main"]],
    }


def test_the_command_writes_names_that_are_not_utf8(tmp_path: Path) -> None:
    """Out through a strict UTF-8 stdout, into the JSON (as escapes) and the page."""
    folder = tmp_path / os.fsdecode(b"d\xff")
    try:
        folder.mkdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes UTF-8 names only")
    written(folder, not_utf8_snapshot(), "s.pickle")
    command = [sys.executable, "-m", "torchmem", "snapshot", "--json", "o.json"]
    command += ["--html", "o.html", os.path.join(folder.name, "s.pickle")]
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torchmem: memory snapshot of d\\xff/s.pickle"
    assert "  512.00B  /tmp/x\\xff/train.py:3  main" in lines
    assert json.loads((tmp_path / "o.json").read_text())["source"] == os.fsdecode(b"d\xff/s.pickle")
    page = (tmp_path / "o.html").read_text(encoding="utf-8")
    assert "<title>torchmem: memory snapshot of d\\xff/s.pickle</title>" in page


def test_a_run_report_of_a_script_in_a_folder_that_is_not_utf8(tmp_path: Path) -> None:
    from torchmem import RunReport

    site = Site(NOT_UTF8, 3, "<module>", 512, ((NOT_UTF8, 3, "<module>"),))
    cpu = DeviceRun("cpu", 0, 512, 1.0, 0, ((1.0, 512),), sites_at_peak=(site,))
    report = RunReport({"cpu": cpu}, (), 1.0, 0, (NOT_UTF8,))
    report.save_html(tmp_path / "run.html")
    page = (tmp_path / "run.html").read_text(encoding="utf-8")
    assert (
        "<title>torchmem: where the memory went: &#x27;/tmp/x\\xff/train.py&#x27;</title>" in page
    )
    assert "/tmp/x\\xff/train.py:3" in page
    report.save_json(tmp_path / "run.json")
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["command"] == [NOT_UTF8]
    assert saved["sites_at_peak"][0]["file"] == NOT_UTF8
