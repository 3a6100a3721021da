"""``torchmem run`` as a user runs it: the installed command, in a subprocess, on scripts
whose bytes are known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from standins import KiB, MiB
from torchmem.cli import main

ROOT = Path(__file__).resolve().parents[2]
counting = pytest.mark.counting

KNOWN = textwrap.dedent(
    """\
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 1024)
    model(x).square().mean().backward()
    optimizer.step()
    big = torch.zeros(64, 1024, 1024)
    del big
    print(__name__, sys.argv)
    sys.exit(int(sys.argv[1]))
    """
)
BIG_LINE = 11


def torchmem_run(*words: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torchmem", "run", *words]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)


@counting
def test_a_script_runs_as_main_and_its_report_is_exact(tmp_path: Path) -> None:
    (tmp_path / "known.py").write_text(KNOWN)
    done = torchmem_run("--json", "out.json", "known.py", "3", "--lr", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "__main__ ['known.py', '3', '--lr']\n"
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["exit_code"] == 3
    assert report["command"] == ["known.py", "3", "--lr"]
    cpu = report["devices"]["cpu"]
    end = cpu["categories_at_end"]
    assert (end["parameters"], end["gradients"], end["optimizer_state"]) == (8 * MiB,) * 3
    assert end["activations"] == 256 * KiB  # x, which the first layer saved
    assert cpu["categories_at_peak"] == {**end, "other": end["other"] + 256 * MiB}
    assert cpu["peak_bytes"] == cpu["end_bytes"] + 256 * MiB
    top = report["sites_at_peak"][0]
    assert top.pop("stack")[0] == ["known.py", BIG_LINE, "<module>"]
    ((nbytes, stack),) = ((each["bytes"], each["stack"]) for each in top.pop("stacks"))
    assert (nbytes, stack[0]) == (256 * MiB, ["known.py", BIG_LINE, "<module>"])
    assert top == {
        "file": "known.py",
        "line": BIG_LINE,
        "function": "<module>",
        "bytes": 256 * MiB,
        "source": "big = torch.zeros(64, 1024, 1024)",
    }
    modules = [(m["name"], m["type"], m["forward_peak_bytes"]) for m in report["modules"]]
    before = 8 * MiB + 256 * KiB
    assert modules == [
        ("", "Sequential", before + 512 * KiB),
        ("0", "Linear", before + 256 * KiB),
        ("1", "Linear", before + 512 * KiB),
    ]
    assert all(m["backward_peak_bytes"] > before for m in report["modules"])
    assert max(b for _, b in report["timeline"]["cpu"]) == cpu["peak_bytes"]
    assert "ram" in report["devices"]
    assert "Allocation sites alive at the peak" in done.stderr


def test_an_uncaught_error_prints_its_traceback_and_the_summary(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text("import torch\nx = torch.zeros(1024)\nraise KeyError('k')\n")
    done = torchmem_run("fails.py", cwd=tmp_path)
    assert done.returncode == 1
    traceback = done.stderr[: done.stderr.index("KeyError: 'k'")]
    assert traceback == (
        "Traceback (most recent call last):\n"
        '  File "fails.py", line 3, in <module>\n'
        "    raise KeyError('k')\n"
    )
    assert "torchmem: where the memory went" in done.stderr


def test_a_module_runs_with_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    done = torchmem_run("-q", "--json", "o.json", "-m", "pkg.job", "--json", "x", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "__main__ ['--json', 'x']\n", "")
    assert json.loads((tmp_path / "o.json").read_text())["exit_code"] == 0


def test_the_html_page_is_self_contained(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text("import torch\nx = torch.ones(1024, 1024)\n")
    done = torchmem_run("-q", "--html", "r.html", "s.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page
    for reference in ("http:", "https:", "<link", "src="):
        assert reference not in page
    assert page.count("<script") == page.count("<script>") == 1  # the charts' hover, inline


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ([], "nothing to run: give a SCRIPT or -m MODULE"),
        (["missing.py"], "can't open file 'missing.py': no such file"),
        (["-m"], "-m needs a module name"),
        (["--top", "0", "x.py"], "--top must be at least 1, not 0"),
        (["--device", "gpu7", __file__], "'gpu7'"),
    ],
)
def test_usage_errors_are_one_line(words: list[str], message: str, capsys) -> None:
    assert main(["run", *words]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchmem run: error: ")
    assert message in err
    assert err.count("\n") == 1


@counting
def test_the_readme_example_runs(tmp_path: Path) -> None:
    example = ROOT / "examples" / "train.py"
    done = torchmem_run("--json", str(tmp_path / "o.json"), str(example), "--steps", "2", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "o.json").read_text())
    assert [m["type"] for m in report["modules"]].count("Linear") == 3
    cpu = report["devices"]["cpu"]
    state = cpu["categories_at_peak"]["optimizer_state"]
    parameters = cpu["categories_at_peak"]["parameters"]
    assert state == 2 * parameters + 6 * 4  # Adam: exp_avg, exp_avg_sq; a 4-byte step each
    # The model and optimizer are main()'s: gone at the end (torchmem holds nothing alive).
    assert cpu["end_bytes"] == 0 and set(cpu["categories_at_end"].values()) == {0}
    assert os.path.basename(report["sites_at_peak"][0]["file"]) == "train.py"
