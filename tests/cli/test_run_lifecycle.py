"""``torchmem run`` leaves a program's life as ``python`` gives it: its threads and atexit
handlers run with its ``__main__``, ``sys.argv`` and ``sys.path``; ``__file__`` stays
valid after ``os.chdir``; a forked child prints no report of its own. Each script runs
under plain ``python`` too, in a subprocess, and the two must agree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from standins import MiB

counting = pytest.mark.counting
forks = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
TITLE = "torchmem: where the memory went"

NEIGHBOUR = "NAME = 'neighbour'\n"
"""A module next to the script: only ``sys.path[0]`` (the script's directory) finds it."""

AT_EXIT = textwrap.dedent(
    """\
    import atexit
    import importlib
    import sys

    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)


    model = Net()


    @atexit.register
    def save():
        torch.save(model, sys.argv[1])  # pickles __main__.Net
        where = "neighbour" if __spec__ is None else "job.neighbour"
        print("atexit", sys.argv[1:], importlib.import_module(where).NAME, flush=True)


    END
    """
)

THREAD = textwrap.dedent(
    """\
    import sys
    import threading
    import time

    import torch


    def work():
        time.sleep(0.5)  # long after the body has returned
        import neighbour

        block = torch.zeros(16, 1024, 1024)  # 64 MiB
        print("thread", sys.argv[1:], neighbour.NAME, flush=True)
        del block


    threading.Thread(target=work).start()
    print("body done", flush=True)
    """
)


def python(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *words], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def torchmem_run(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return python("-m", "torchmem", "run", *words, cwd=cwd)


def project(tmp_path: Path, source: str) -> Path:
    """`source` as job/job.py, with job/neighbour.py beside it; the directory to run in
    (`tmp_path`, where neither module is importable but through the script's path)."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "__init__.py").write_text("")
    (job / "job.py").write_text(source)
    (job / "neighbour.py").write_text(NEIGHBOUR)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(("end", "code"), [("", 0), ("sys.exit(3)", 3), ("raise KeyError('k')", 1)])
@pytest.mark.parametrize("how", [["job/job.py"], ["-m", "job.job"]], ids=["script", "-m"])
def test_atexit_handlers_run_with_the_scripts_main_argv_and_path(
    tmp_path: Path, how: list[str], end: str, code: int
) -> None:
    cwd = project(tmp_path, AT_EXIT.replace("END", end))
    plain = python(*how, "plain.pt", cwd=cwd)
    done = torchmem_run("-q", *how, "measured.pt", cwd=cwd)
    assert plain.stdout == "atexit ['plain.pt'] neighbour\n", plain.stderr
    assert (done.returncode, done.stdout) == (code, "atexit ['measured.pt'] neighbour\n")
    assert "Exception ignored" not in done.stderr, done.stderr
    assert (cwd / "measured.pt").stat().st_size > 0


@counting
def test_a_thread_that_outlives_the_body_is_recorded_and_reported_after(
    tmp_path: Path,
) -> None:
    cwd = project(tmp_path, THREAD)
    plain = python("job/job.py", "a", cwd=cwd)
    assert plain.stdout == "body done\nthread ['a'] neighbour\n", plain.stderr
    done = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--json", "r.json", "job/job.py", "a"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    before, title, _ = done.stdout.partition(TITLE)
    assert title, done.stdout
    assert before.strip() == plain.stdout.strip()
    report = json.loads((cwd / "r.json").read_text())
    assert report["devices"]["cpu"]["peak_bytes"] >= 64 * MiB


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT is a console event there")
def test_ctrl_c_while_waiting_for_threads_ends_it_with_the_report(tmp_path: Path) -> None:
    script = tmp_path / "waits.py"
    script.write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
    )
    command = [sys.executable, "-m", "torchmem", "run", str(script)]
    started = time.monotonic()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        time.sleep(1)  # the body is over: Python waits for the thread
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert time.monotonic() - started < 30
    assert TITLE in err.partition("KeyboardInterrupt")[2], err  # the wait is recorded


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
