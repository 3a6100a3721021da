"""``torchmem run`` leaves a program's life as ``python`` gives it: ``__file__`` stays
valid after ``os.chdir``, the report's files go where torchmem started, and a forked
child prints no report of its own. Each script runs under plain ``python`` too, in a
subprocess, and the two must agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from standins import MiB
from torchmem.meters import meter

counting = pytest.mark.skipif(
    getattr(meter("cpu"), "backend", "") != "allocator",
    reason="needs the counting CPU allocator (a C++ compiler)",
)
forks = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
TITLE = "torchmem: where the memory went"


def python(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *words], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def torchmem_run(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return python("-m", "torchmem", "run", *words, cwd=cwd)


def project(tmp_path: Path, source: str) -> Path:
    """`source` as job/job.py; the directory to run it in (`tmp_path`)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "__init__.py").write_text("")
    (job / "job.py").write_text(source)
    return tmp_path


def test_file_is_absolute_and_report_paths_are_where_torchmem_started(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """\
        import os
        import sys

        here = os.path.dirname(__file__)
        os.chdir(sys.argv[1])
        with open(os.path.join(here, "data.txt")) as file:
            print(file.read(), os.path.isabs(__file__), sys.argv[0])
        """
    )
    cwd = project(tmp_path, script)
    (cwd / "job" / "data.txt").write_text("data")
    (cwd / "elsewhere").mkdir()
    plain = python("job/job.py", "elsewhere", cwd=cwd)
    done = torchmem_run(
        "-q", "--json", "r.json", "--html", "r.html", "job/job.py", "elsewhere", cwd=cwd
    )
    assert plain.stdout == "data True job/job.py\n", plain.stderr
    assert (done.returncode, done.stdout) == (0, plain.stdout), done.stderr
    assert json.loads((cwd / "r.json").read_text())["command"] == ["job/job.py", "elsewhere"]
    assert (cwd / "r.html").is_file()
    assert list((cwd / "elsewhere").iterdir()) == []


@counting
def test_a_relative_snapshot_path_is_where_torchmem_started(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    script = "import os, torch\nx = torch.ones(1024)\nos.chdir('elsewhere')\n"
    (tmp_path / "s.py").write_text(script)
    done = torchmem_run("-q", "--snapshot", "s.pickle", "s.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "s.pickle").is_file()
    assert list((tmp_path / "elsewhere").iterdir()) == []


@counting
@forks
def test_a_forked_child_that_outlives_its_parent_prints_no_report(tmp_path: Path) -> None:
    (tmp_path / "forks.py").write_text(
        textwrap.dedent(
            """\
            import os
            import time

            import torch

            block = torch.zeros(16, 1024, 1024)  # 64 MiB, in the parent's recording
            del block
            if os.fork() == 0:
                time.sleep(1)  # the parent has reported by now
            print("end", flush=True)
            """
        )
    )
    done = torchmem_run("--json", "r.json", "forks.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "end\nend\n"
    assert done.stderr.count(TITLE) == 1, done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["devices"]["cpu"]["peak_bytes"] >= 64 * MiB
