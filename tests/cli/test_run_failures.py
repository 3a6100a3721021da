"""``torchmem run`` when things go wrong: what ``python`` would do, and the report kept.

Each test runs the real command in a subprocess, as a user would, and compares with what
``python`` itself does with the same script where python is the measure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

TITLE = "torchmem: where the memory went"
ZEROS = "import torch\nx = torch.zeros(1024, 1024)\n"
"""A script that keeps 4,194,304 bytes of CPU tensors to its end."""


def torchmem(*words: str, cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torchmem", *words]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300, **kwargs)  # type: ignore[call-overload]


def python(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *words]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)


def cpu_end(path: Path) -> int:
    return int(json.loads(path.read_text())["devices"]["cpu"]["end_bytes"])


@pytest.mark.parametrize("option", ["--json", "--html", "--snapshot"])
@pytest.mark.parametrize(
    "where", ["missing/report.out", "folder"], ids=["in a missing directory", "a directory"]
)
def test_an_unwritable_output_is_refused_before_the_script_runs(
    tmp_path: Path, option: str, where: str
) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "script.py").write_text("print('the script ran')\n")
    done = torchmem("run", option, where, "script.py", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith(f"torchmem run: error: cannot write {option} {tmp_path}")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_a_file_that_cannot_be_written_at_the_end_loses_only_itself(tmp_path: Path) -> None:
    # The directory is there when the run starts, and not when it ends: the summary is
    # printed first, and every other file is written.
    (tmp_path / "out").mkdir()
    (tmp_path / "script.py").write_text(ZEROS + "import os\nos.rmdir('out')\n")
    done = torchmem("run", "--json", "r.json", "--html", "out/r.html", "script.py", cwd=tmp_path)
    assert done.returncode == 1
    assert TITLE in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchmem run: error: --html not written: [Errno 2]"), last
    assert cpu_end(tmp_path / "r.json") >= 4_194_304


def test_a_missing_script_is_said_before_torch_is_imported(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "from torchmem.cli import main\n"
        "code = main(['run', 'nosuch.py'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = python("-c", probe, cwd=tmp_path)
    assert done.stdout == "2 False\n"
    assert done.stderr == "torchmem run: error: can't open file 'nosuch.py': no such file\n"


def test_a_missing_module_is_one_line_as_python_says_it_and_no_report(tmp_path: Path) -> None:
    done = torchmem("run", "-m", "nosuchmodule", cwd=tmp_path)
    theirs = python("-m", "nosuchmodule", cwd=tmp_path)
    assert (done.returncode, theirs.returncode) == (1, 1)
    assert done.stderr == "torchmem run: error: No module named nosuchmodule\n"
    assert theirs.stderr.endswith(": No module named nosuchmodule\n")
    assert TITLE not in done.stderr


@pytest.mark.slow
def test_a_directory_and_a_zip_file_with_a_main_run_as_python_runs_them(tmp_path: Path) -> None:
    main = ZEROS + textwrap.dedent(
        """\
        import os, sys
        import helper
        print(__name__, repr(__package__), sys.argv, os.path.relpath(__file__), helper.NAME)
        """
    )
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(main)
    (app / "helper.py").write_text("NAME = 'helper'\n")
    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as archive:
        archive.write(app / "__main__.py", "__main__.py")
        archive.write(app / "helper.py", "helper.py")
    for target in ("app", "app.pyz"):
        done = torchmem("run", "--json", f"{target}.json", target, "--flag", cwd=tmp_path)
        theirs = python(target, "--flag", cwd=tmp_path)
        assert done.returncode == theirs.returncode == 0, done.stderr
        assert done.stdout == theirs.stdout
        assert done.stdout.startswith(f"__main__ '' ['{target}', '--flag'] {target}/__main__.py")
        assert cpu_end(tmp_path / f"{target}.json") >= 4_194_304


def test_a_directory_without_a_main_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = torchmem("run", "empty", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == "torchmem run: error: can't find '__main__' module in 'empty'\n"


def test_an_excepthook_that_raises_keeps_the_report_and_both_tracebacks(tmp_path: Path) -> None:
    script = ZEROS + textwrap.dedent(
        """\
        import sys

        def hook(*args):
            raise RuntimeError("the hook failed")

        sys.excepthook = hook
        raise ValueError("the script failed")
        """
    )
    (tmp_path / "script.py").write_text(script)
    done = torchmem("run", "--json", "r.json", "script.py", cwd=tmp_path)
    theirs = python("script.py", cwd=tmp_path)
    assert done.returncode == theirs.returncode == 1
    for said in (done.stderr, theirs.stderr):
        hook, _, original = said.partition("Original exception was:")
        assert "Error in sys.excepthook:" in hook and "RuntimeError: the hook failed" in hook
        assert "ValueError: the script failed" in original
    assert TITLE in done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["exit_code"] == 1


def test_a_script_that_closes_stderr_keeps_its_exit_code_and_the_files(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(ZEROS + "import sys\nsys.stderr.close()\n")
    done = torchmem("run", "--json", "r.json", "script.py", cwd=tmp_path)
    theirs = python("script.py", cwd=tmp_path)
    assert done.returncode == theirs.returncode == 0
    assert done.stderr == ""
    assert cpu_end(tmp_path / "r.json") >= 4_194_304


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT is a console event there")
def test_ctrl_c_ends_it_by_sigint_as_python_after_the_report_and_atexit(tmp_path: Path) -> None:
    script = ZEROS + textwrap.dedent(
        """\
        import atexit
        atexit.register(print, "atexit ran", flush=True)
        raise KeyboardInterrupt
        """
    )
    (tmp_path / "script.py").write_text(script)
    done = torchmem("run", "--json", "r.json", "script.py", cwd=tmp_path)
    theirs = python("script.py", cwd=tmp_path)
    assert done.returncode == theirs.returncode == -signal.SIGINT
    assert done.stdout == theirs.stdout == "atexit ran\n"
    assert done.stderr.count("\nKeyboardInterrupt\n") == 1, done.stderr  # the script's own
    assert TITLE in done.stderr.partition("KeyboardInterrupt")[2]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["exit_code"] == 130
    assert report["devices"]["cpu"]["end_bytes"] >= 4_194_304


@pytest.mark.parametrize(
    ("command", "said"),
    [("run", "list N sites, tensors, modules"), ("snapshot", "list N sites and segments")],
)
def test_help_gives_the_defaults(tmp_path: Path, command: str, said: str) -> None:
    done = torchmem(command, "--help", cwd=tmp_path)
    assert f"{said} (default: 10)" in " ".join(done.stdout.split())
