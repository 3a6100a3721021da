"""The command line, through main() and once as the installed script and as a module.

Every test here is about a machine without a GPU, so each hides the GPUs itself: the
in-process ones with :func:`standins.hide_gpus`, the subprocesses with
``CUDA_VISIBLE_DEVICES=""`` (:func:`standins.environ_without_gpu`).
"""

import argparse
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

import torchmem.cli
from standins import environ_without_gpu
from torchmem import __version__
from torchmem.cli import COMMANDS, main
from torchmem.errors import CommandError

NO_GPU_LINE = "No CUDA GPU is visible (torch.cuda.is_available() is False)."
NAMES = [command.name for command in COMMANDS]
TOP_USAGE = "usage: torchmem [-h] [--version] COMMAND ..."


def test_devices_without_a_gpu_says_so_and_shows_ram(no_gpu, capsys):
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == NO_GPU_LINE
    assert re.fullmatch(
        r"RAM: this process \d+\.\d\d[MG] resident; machine \d+\.\d\d[GT] total, "
        r"\d+\.\d\d[MGT] available\.",
        lines[1],
    )
    assert re.fullmatch(
        r"CPU tensors: \d+\.\d\d[BKMG], counted by the counting CPU allocator"
        r" \(backend 'allocator': /.+/cpu_allocator-torch.+\.so\)\.",
        lines[2],
    )
    assert len(lines) == 3


def test_devices_json_names_the_cpu_backend(no_gpu, capsys, monkeypatch, isolated_meters):
    monkeypatch.setenv("TORCHMEM_CPU_METER", "dispatch")
    assert main(["devices", "--json"]) == 0
    cpu = json.loads(capsys.readouterr().out)["cpu"]
    assert (cpu["backend"], cpu["detail"]) == ("dispatch", "chosen by TORCHMEM_CPU_METER")


@pytest.mark.slow  # a build
def test_build_builds_into_the_cache_and_self_tests(tmp_path):
    env = {**os.environ, "TORCHMEM_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "torchmem", "build"], capture_output=True, text=True, env=env
    )
    (built,) = tmp_path.iterdir()
    assert (done.returncode, done.stdout) == (0, f"built and self-tested: {built}\n")


def test_build_without_a_compiler_fails_with_one_line(tmp_path):
    env = {**os.environ, "TORCHMEM_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "none")}
    done = subprocess.run(
        [sys.executable, "-m", "torchmem", "build"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1
    assert done.stderr.startswith("torchmem build: error: cannot build the counting CPU")
    assert len(done.stderr.splitlines()) == 1


def test_devices_json(no_gpu, capsys):
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"] == []
    assert data["ram"]["total"] == psutil.virtual_memory().total
    assert 0 < data["ram"]["process"] < data["ram"]["total"]


def test_without_a_command_prints_the_help_listing_every_command(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == TOP_USAGE
    for command in COMMANDS:
        assert any(
            re.fullmatch(rf"\s+{command.name}\s+{re.escape(command.help)}", line) for line in lines
        )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_flags_print_that_help(capsys, flag):
    assert main([]) == 0
    bare = capsys.readouterr().out
    assert main([flag]) == 0
    assert capsys.readouterr() == (bare, "")


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"torchmem {__version__}\n"
    assert main(["devices", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


def test_without_argv_reads_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["torchmem", "--version"])
    assert main() == 0
    assert capsys.readouterr().out == f"torchmem {__version__}\n"


@pytest.mark.parametrize(
    "argv", [["--bogus"], ["--bogus", "devices"], ["--bogus", "devices", "--json"]]
)
def test_an_unknown_option_before_the_command_is_named_under_the_top_usage(capsys, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [TOP_USAGE, "torchmem: error: unrecognized arguments: --bogus"]


@pytest.mark.parametrize("argv", [["nope"], ["nope", "--json"], ["nope", "devices"]])
def test_an_unknown_command_is_named_with_the_commands(capsys, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    usage, error = err.splitlines()
    assert usage == TOP_USAGE
    assert error.startswith("torchmem: error: argument COMMAND: invalid choice: 'nope' (choose")
    assert all(name in error for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_commands_usage_error_shows_its_own_usage(capsys, name):
    assert main([name, "--bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"usage: torchmem {name} ")
    assert lines[-1] == f"torchmem {name}: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("extra", [["--json", "--bogus"], ["bogus"]])
def test_devices_usage_errors(capsys, extra):
    assert main(["devices", *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: torchmem devices [-h] [--json]",
        f"torchmem devices: error: unrecognized arguments: {extra[-1]}",
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=NAMES)
def test_each_command_has_its_own_help(capsys, command):
    assert main([command.name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: torchmem {command.name} ")
    assert " ".join(command.description.split()) in " ".join(out.split())


class Raising:
    """A command that raises `error` when run."""

    name = "fail"
    help = "raise an error"
    description = "Raise an error."
    intermixed = False

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--flag", action="store_true")

    def run(self, args: argparse.Namespace) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("error", "code"),
    [(CommandError("no snapshot at x.pickle"), 1), (CommandError("no snapshot at x.pickle", 3), 3)],
)
def test_a_command_error_is_one_line_and_its_exit_code(monkeypatch, capsys, error, code):
    monkeypatch.setattr(torchmem.cli, "COMMANDS", [*COMMANDS, Raising(error)])
    assert main(["fail", "--flag"]) == code
    assert capsys.readouterr() == ("", "torchmem fail: error: no snapshot at x.pickle\n")


def test_ctrl_c_in_a_command_exits_130_quietly(monkeypatch, capsys):
    monkeypatch.setattr(torchmem.cli, "COMMANDS", [*COMMANDS, Raising(KeyboardInterrupt())])
    assert main(["fail"]) == 130
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_the_module_runs_without_a_gpu():
    env = environ_without_gpu()
    text = subprocess.run(
        [sys.executable, "-m", "torchmem", "devices"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert text.stdout.splitlines()[0] == NO_GPU_LINE
    data = subprocess.run(
        [sys.executable, "-m", "torchmem", "devices", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert json.loads(data.stdout)["gpus"] == []


@pytest.mark.slow
def test_the_installed_script_runs_without_a_gpu():
    script = shutil.which("torchmem", path=os.path.dirname(sys.executable)) or shutil.which(
        "torchmem"
    )
    if script is None:
        pytest.skip(
            "no torchmem script next to this Python or on PATH: torchmem is importable "
            "here but not pip-installed (pip install -e . makes the script)"
        )
    result = subprocess.run(
        [script, "devices", "--json"], capture_output=True, text=True, env=environ_without_gpu()
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gpus"] == []


TORCH_IMPORT = re.compile(r"^import time:.*\|\s+torch(\.\S+)?$", re.MULTILINE)
"""A line of ``python -X importtime`` that imports torch or one of its submodules."""


def import_times(*argv):
    """Run ``python -X importtime -m torchmem *argv`` where no GPU is visible."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "torchmem", *argv],
        capture_output=True,
        text=True,
        env=environ_without_gpu(),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code"),
    [
        pytest.param("", 0, id="no-command"),
        ("--help", 0),
        ("-h", 0),
        ("--version", 0),
        ("devices --help", 0),
        ("--bogus", 2),
        ("devices --bogus", 2),
    ],
)
def test_help_version_and_usage_errors_do_not_import_torch(args, code):
    result = import_times(*args.split())
    assert result.returncode == code, result.stderr
    assert TORCH_IMPORT.findall(result.stderr) == []


@pytest.mark.slow
def test_running_a_command_imports_torch():
    """The check above would see torch: running ``devices`` imports it."""
    result = import_times("devices")
    assert result.returncode == 0, result.stderr
    assert TORCH_IMPORT.search(result.stderr)


# Output that cannot be written --------------------------------------------------------

NO_SPACE = os.strerror(errno.ENOSPC)
BROKEN_PIPE = 128 + signal.SIGPIPE if hasattr(signal, "SIGPIPE") else 1
"""The exit code a shell shows for a tool that SIGPIPE ended: 141."""


class Unwritable(io.StringIO):
    """A stdout whose writes fail with `error`, as a full disk's or a closed pipe's do."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


@pytest.mark.parametrize(
    ("argv", "prog"),
    [(["devices"], "torchmem devices"), ([], "torchmem"), (["--version"], "torchmem")],
)
def test_a_full_disk_is_one_line_and_exit_code_1(no_gpu, monkeypatch, capsys, argv, prog):
    monkeypatch.setattr(sys, "stdout", Unwritable(OSError(errno.ENOSPC, NO_SPACE)))
    assert main(argv) == 1
    assert capsys.readouterr().err == f"{prog}: error: {NO_SPACE}\n"


def test_a_broken_pipe_exits_quietly(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", Unwritable(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert main(["devices", "--json"]) == BROKEN_PIPE
    assert capsys.readouterr().err == ""


def run_module(argv, stdout, buffered=True):
    """``python -m torchmem *argv`` with its stdout on `stdout`, without a GPU."""
    env = environ_without_gpu()
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


PRINTING = [
    (["devices"], "torchmem devices"),
    (["devices", "--json"], "torchmem devices"),
    (["devices", "--help"], "torchmem devices"),
    ([], "torchmem"),
    (["--version"], "torchmem"),
]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    ("argv", "prog"), PRINTING, ids=[" ".join(a) or "no command" for a, _ in PRINTING]
)
def test_stdout_on_a_full_device_is_one_line_on_stderr(argv, prog, buffered):
    with open("/dev/full", "w") as full:
        result = run_module(argv, full, buffered)
    assert (result.returncode, result.stderr) == (1, f"{prog}: error: {NO_SPACE}\n")


@pytest.mark.slow
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["devices"], ["--version"]], ids=["devices", "--version"])
def test_a_reader_that_went_away_ends_it_quietly(argv, buffered):
    read, write = os.pipe()
    os.close(read)  # as `| head -0` does, but before the first write, every time
    try:
        result = run_module(argv, write, buffered)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (BROKEN_PIPE, "")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_scripts_output_on_a_full_device(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    with open("/dev/full", "w") as full:
        result = run_module(["run", "-q", str(script)], full)
    assert (result.returncode, result.stderr) == (1, f"torchmem run: error: {NO_SPACE}\n")
