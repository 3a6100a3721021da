"""The set-up scripts' choice of environment and of PyTorch (``scripts/env.sh``), run by bash
in throwaway virtual environments that hold a stand-in torch: a distribution's metadata
only, which is all the script reads. Each environment has no pip, so a script that tried to
install anything there would fail. The path that creates ``.venv`` and installs torch runs
in CI, which starts from a clean clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def environment(path: Path, torch_version: str | None) -> Path:
    """A virtual environment without pip, holding torch's metadata at `torch_version`."""
    venv.create(path, with_pip=False, symlinks=True)
    if torch_version is not None:
        (site,) = path.glob("lib/python*/site-packages")
        info = site / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n"
        )
    return path


def source_env(project: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Source a copy of env.sh in `project`, as demo.sh and test.sh do; print PY."""
    (project / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "env.sh", project / "scripts" / "env.sh")
    clean = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "CONDA_PREFIX"}}
    return subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source scripts/env.sh; echo "PY=$PY"'],
        cwd=project,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_active_environment_keeps_its_supported_torch(tmp_path: Path) -> None:
    user = environment(tmp_path / "user", "2.99.0")
    done = source_env(tmp_path, VIRTUAL_ENV=str(user))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"torchmem setup: using the active virtual environment {user}",
        "torchmem setup: keeping the installed torch 2.99.0",
        f"PY={user}/bin/python",
    ]
    assert not (tmp_path / ".venv").exists()


def test_a_torch_older_than_supported_stops_the_script(tmp_path: Path) -> None:
    user = environment(tmp_path / "user", "2.9.1+cpu")
    done = source_env(tmp_path, VIRTUAL_ENV=str(user))
    assert done.returncode == 1
    assert "PY=" not in done.stdout
    assert "has torch 2.9.1+cpu; torchmem needs torch>=2.10" in done.stderr


def test_outside_an_environment_the_project_venv_is_used(tmp_path: Path) -> None:
    environment(tmp_path / ".venv", "2.13.0")
    done = source_env(tmp_path, PYTHON=sys.executable)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "torchmem setup: using .venv (activate it with: source .venv/bin/activate)",
        "torchmem setup: keeping the installed torch 2.13.0",
        f"PY={tmp_path}/.venv/bin/python",
    ]


@pytest.mark.parametrize("name", ["demo.sh", "test.sh"])
def test_both_set_up_scripts_choose_their_environment_with_env_sh(name: str) -> None:
    lines = (ROOT / "scripts" / name).read_text().splitlines()
    assert "source scripts/env.sh" in lines
    assert not [line for line in lines if "pip install" in line and "torch" in line]


def test_the_scripts_floor_is_the_projects() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    script = (ROOT / "scripts" / "env.sh").read_text()
    floor = re.search(r'"torch>=([\d.]+)"', pyproject)
    assert floor is not None
    assert f'TORCH_FLOOR="{floor.group(1)}"' in script
