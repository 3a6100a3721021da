"""The command line, through main() and once as the installed script and as a module.

Every test here is about a machine without a GPU, so each hides the GPUs itself: the
in-process ones with :func:`standins.hide_gpus`, the subprocesses with
``CUDA_VISIBLE_DEVICES=""`` (:func:`standins.environ_without_gpu`).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import psutil
import pytest

from standins import environ_without_gpu, hide_gpus
from torchmem import __version__
from torchmem.cli import main

NO_GPU_LINE = "No CUDA GPU is visible (torch.cuda.is_available() is False)."


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no GPU, whatever the machine has."""
    hide_gpus(monkeypatch)


def test_devices_without_a_gpu_says_so_and_shows_ram(no_gpu, capsys):
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == NO_GPU_LINE
    assert re.fullmatch(
        r"RAM: this process \d+\.\d\d[MG] resident; machine \d+\.\d\d[GT] total, "
        r"\d+\.\d\d[MGT] available\.",
        lines[1],
    )
    assert len(lines) == 2


def test_devices_json(no_gpu, capsys):
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"] == []
    assert data["ram"]["total"] == psutil.virtual_memory().total
    assert 0 < data["ram"]["process"] < data["ram"]["total"]


def test_usage_errors_return_2(capsys):
    assert main([]) == 2
    assert main(["nope"]) == 2
    assert main(["devices", "--nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"torchmem {__version__}\n"
    assert main(["devices", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


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
