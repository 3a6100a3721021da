"""The command line, through main() and once as the installed script."""

import json
import os
import re
import shutil
import subprocess
import sys

import psutil

from torchmem import __version__
from torchmem.cli import main


def test_devices_without_a_gpu_says_so_and_shows_ram(capsys):
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "No CUDA GPU is visible (torch.cuda.is_available() is False)."
    assert re.fullmatch(
        r"RAM: this process \d+\.\d\d[MG] resident; machine \d+\.\d\d[GT] total, "
        r"\d+\.\d\d[MGT] available\.",
        lines[1],
    )
    assert len(lines) == 2


def test_devices_json(capsys):
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


def test_the_installed_script_and_module_run():
    script = shutil.which("torchmem", path=os.path.dirname(sys.executable)) or shutil.which(
        "torchmem"
    )
    assert script, "the torchmem script is not installed"
    result = subprocess.run([script, "devices", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gpus"] == []
    module = subprocess.run(
        [sys.executable, "-m", "torchmem", "devices"], capture_output=True, text=True, check=True
    )
    assert module.stdout.startswith("No CUDA GPU is visible")
