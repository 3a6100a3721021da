"""``torchmem estimate --advice``: the changes that lower a step's memory, each with its
estimated saving, through main() and once as a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from standins import environ_without_gpu
from torchmem.cli import main

STEP = textwrap.dedent(
    """
    import torch
    from torch import nn


    def step(batch, device="cpu"):
        model = nn.Linear(1024, 1024, bias=False, device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch, 1024, device=device)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            model(x).sum().backward()
            optimizer.step()


    def gpu_step(batch):
        step(batch, "cuda")
    """
)


@pytest.fixture
def steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module with the step, in the working folder, named for the test (a module
    imported by an earlier test stays in sys.modules)."""
    name = f"advice_steps_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(STEP)
    monkeypatch.chdir(tmp_path)
    return name


def _timeless(text: str) -> str:
    return re.sub(r"\(\d+\.\d\ds\)", "(Ts)", text)


def test_advice_prints_each_saving(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Batch 1: 4 MiB of weights, and 4 MiB of gradient kept by zero_grad(set_to_none=False)
    while the second backward pass makes the new one (4 MiB) and adds it in."""
    code = main(["estimate", "--device", "cpu", f"{steps}:step", "--batch", "1", "--advice"])
    out = capsys.readouterr().out
    assert code == 0
    lines = _timeless(out).splitlines()
    assert lines[:6] == [
        "torchmem advice: step on cpu (Ts)",
        "",
        "Estimated peak 12.00M (reserved 12.00M) as the step is; 8.00M (reserved 8.00M) with"
        " every change below.",
        "",
        "change       saves   peak  saves reserved  reserved  what to do",
        "set_to_none  4.00M  8.00M           4.00M     8.00M  Zero gradients with"
        " zero_grad(set_to_none=True), the default, not False",
    ]
    assert "  - checkpoint: not tried: no module below the outermost one" in out
    assert "Largest batch" not in out


def test_advice_with_a_gpu_finds_the_largest_batch(
    steps: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "advice.html"
    words = ["estimate", f"{steps}:gpu_step", "--batch", "1", "--advice", "--capacity", "H100-80GB"]
    assert main([*words, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"Largest batch that fits H100-80GB \(79\.18G\): (\d+) as the step is", out)
    assert found is not None and int(found.group(1)) > 1000
    assert "torchmem advice: gpu_step on cuda" in page.read_text()


@pytest.mark.parametrize(
    ("words", "code", "said"),
    [
        (["--advice", "--capacity", "80 GiB"], 1, "--advice with --capacity takes a MODULE:"),
        (["--capacity", "80 GiB", "--batch", "2"], 1, "--capacity takes a MODULE:FUNCTION and no"),
        (["--advice", "--capacity", "H300", "--batch", "2"], 2, "invalid size 'H300'"),
    ],
)
def test_bad_options_are_one_line(
    steps: str, capsys: pytest.CaptureFixture[str], words: list[str], code: int, said: str
) -> None:
    assert main(["estimate", f"{steps}:step", *words]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"torchmem estimate: error: {said}"), err
    assert len(err.splitlines()) == 1


def test_a_gpu_name_is_a_capacity_without_advice(
    steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", f"{steps}:gpu_step", "--capacity", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"largest batch size that fits h100-80gb on cuda: \d+\n", out)


def test_the_installed_command_advises(steps: str) -> None:
    words = ["estimate", "--device", "cpu", f"{steps}:step", "--batch", "1", "--advice"]
    run = subprocess.run(
        [sys.executable, "-m", "torchmem", *words],
        capture_output=True,
        text=True,
        env=environ_without_gpu(),
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "set_to_none  4.00M  8.00M" in run.stdout
