"""``%load_ext torchmem`` and ``%mlrun`` / ``%%mlrun`` in a real IPython shell, on CPU
tensors whatever the machine has."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("IPython")  # the notebook extra

from IPython.core.interactiveshell import InteractiveShell

from standins import MiB
from torchmem import LineProfiler, LineReport, meter
from torchmem.units import readable_size

SETUP = """\
import torch

def allocate():
    a = torch.zeros(1024, 1024)
    return a
"""


def report(base: int) -> str:
    """The report of one call of `allocate`, with `base` bytes of CPU tensors alive before
    it: the CPU meter counts every tensor of the process, earlier tests' leftovers too."""
    peak = f"{readable_size(base + 4 * MiB):>12}"
    return f"""\
## allocate

active_bytes active_bytes hits line code
         all          all
        peak        delta
{"":34}3 def allocate():
{peak}        4.00M    1    4     a = torch.zeros(1024, 1024)
{peak}        0.00B    1    5     return a
"""


def alive() -> int:
    """Bytes of CPU tensors alive in the process now, as the profiler's meter counts."""
    gc.collect()
    return meter("cpu").used()


@pytest.fixture
def shell(ipython: InteractiveShell, no_gpu: None, isolated_meters: None) -> InteractiveShell:
    """A fresh shell with torchmem loaded and `allocate` defined; no GPU visible, so the
    profiler measures CPU tensors."""
    ipython.run_line_magic("load_ext", "torchmem")
    run(ipython, SETUP)
    return ipython


def run(ipython: InteractiveShell, code: str) -> object:
    """Run a cell; its result, raising what it raised."""
    result = ipython.run_cell(code, store_history=True)
    result.raise_error()
    return result.result


def usage_error(ipython: InteractiveShell, code: str, capsys: pytest.CaptureFixture) -> str:
    """Run a cell that fails with a UsageError; what IPython printed."""
    capsys.readouterr()
    result = ipython.run_cell(code, store_history=True)
    assert type(result.error_in_exec).__name__ == "UsageError"
    return capsys.readouterr().err


def test_line_mode_returns_the_report(shell):
    base = alive()
    shown = run(shell, "%mlrun -f allocate allocate()")
    assert isinstance(shown, LineReport)
    assert str(shown) == report(base)
    assert "<table" in shown._repr_html_()


def test_cell_mode_runs_the_cell_in_the_user_namespace(shell):
    base = alive()
    shown = run(shell, "%%mlrun -f allocate\nkept = allocate()\nkept = allocate()\n")
    lines = str(shown).splitlines()
    peak = f"{readable_size(base + 8 * MiB):>12}"  # the second call, the first's kept alive
    assert lines[6:] == [
        f"{peak}        8.00M    2    4     a = torch.zeros(1024, 1024)",
        f"{peak}        0.00B    2    5     return a",
    ]
    assert run(shell, "tuple(kept.shape)") == (1024, 1024)


def test_the_statement_is_run_as_typed(shell):
    run(shell, "def make(n, text):\n    return torch.zeros(n, 256), text\n")
    run(shell, '%mlrun -f make pair = make(4 * 1024 - 1 + 1, "a  -q  b")')
    assert run(shell, "pair[1]") == "a  -q  b"
    assert run(shell, "pair[0].shape[0]") == 4096


def test_columns_follow_the_defaults(shell):
    shown = run(shell, "%mlrun -f allocate -c active_bytes.all.allocated allocate()")
    assert shown.columns == (
        "active_bytes.all.peak",
        "active_bytes.all.delta",
        "active_bytes.all.allocated",
    )


def test_return_profiler(shell):
    base = alive()
    profiler = run(shell, "%mlrun -r -f allocate allocate()")
    assert isinstance(profiler, LineProfiler)
    assert str(profiler.display()) == report(base)


def test_quiet_shows_nothing(shell, capsys):
    capsys.readouterr()
    assert run(shell, "%mlrun -q -f allocate allocate()") is None
    assert capsys.readouterr().out == ""
    assert isinstance(run(shell, "%mlrun -q -r -f allocate allocate()"), LineProfiler)


def test_dump_profile_uses_the_chosen_columns(shell, tmp_path):
    path = tmp_path / "profile.txt"
    shown = run(
        shell,
        f"%mlrun -q -T {path} -c active_bytes.all.allocated -D -f allocate allocate()",
    )
    assert shown is None
    assert path.read_text() == (
        "## allocate\n"
        "\n"
        "active_bytes hits line code\n"
        "         all\n"
        "   allocated\n"
        f"{'':21}3 def allocate():\n"
        "       4.00M    1    4     a = torch.zeros(1024, 1024)\n"
        "       0.00B    1    5     return a\n"
    )


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        ("/nonexistent/x", "no directory /nonexistent"),
        (".", "it is a directory"),
    ],
)
def test_dump_profile_to_a_path_that_cannot_be_written_runs_nothing(
    shell, capsys, tmp_path, monkeypatch, where, problem
):
    monkeypatch.chdir(tmp_path)
    err = usage_error(shell, f"%mlrun -T {where} -f allocate ran = allocate()", capsys)
    assert f"UsageError: -T {where}: cannot write the profile there: {problem}\n" in err
    assert run(shell, "'ran' in dir()") is False  # the statement did not run


def test_device_option(shell):
    base = alive()
    shown = run(shell, "%mlrun -d cpu -f allocate allocate()")
    assert str(shown) == report(base)


def test_unknown_function(shell, capsys):
    err = usage_error(shell, "%mlrun -f missing allocate()", capsys)
    assert "UsageError: Could not find function 'missing'.\n" in err
    assert "NameError: name 'missing' is not defined" in err


def test_unknown_column(shell, capsys):
    err = usage_error(shell, "%mlrun -f allocate -c nope allocate()", capsys)
    assert "UsageError: unknown column(s) 'nope' for device 'cpu'; valid columns:" in err
    assert run(shell, "'a' in dir()") is False  # nothing ran


def test_no_default_columns_needs_columns(shell, capsys):
    err = usage_error(shell, "%mlrun -D -f allocate allocate()", capsys)
    assert "-c COL" in err


def test_nothing_to_run_or_to_profile(shell, capsys):
    assert "Nothing to run" in usage_error(shell, "%mlrun -f allocate", capsys)
    assert "-f FUNC" in usage_error(shell, "%mlrun allocate()", capsys)


def test_an_error_in_the_code_propagates(shell):
    result = shell.run_cell("%mlrun -f allocate 1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)


def test_help_text(shell):
    doc = shell.find_line_magic("mlrun").__doc__
    assert "%mlrun [-f FUNC] [-c COLS] [-D] [-r] [-g GPU_ID]" in doc
    assert "Don't print out profile results" in doc
    assert "Hide the default columns of active_bytes.all.peak" in doc


def test_import_alone_registers_no_magic():
    import torchmem  # noqa: F401

    ipython = InteractiveShell.instance()
    try:
        assert ipython.find_magic("mlrun") is None
    finally:
        InteractiveShell.clear_instance()


def test_register_returns_a_handle(shell):
    from torchmem.notebook import magics

    shell.magics_manager.magics["line"].pop("mlrun")
    shell.magics_manager.magics["cell"].pop("mlrun")
    with magics.register(shell) as handle:
        assert shell.find_line_magic("mlrun") is not None
        assert shell.find_cell_magic("mlrun") is not None
    assert shell.find_magic("mlrun") is None
    handle.remove()  # twice is harmless


def test_unload_ext_removes_what_load_ext_registered(shell):
    memlog = shell.find_line_magic("memlog").handle
    shell.run_line_magic("memlog", "on")
    assert memlog.logger.running
    shell.run_line_magic("unload_ext", "torchmem")
    assert shell.find_magic("mlrun") is None and shell.find_magic("memlog") is None
    assert not memlog.logger.running  # its IPython callbacks are gone too
    shell.run_line_magic("load_ext", "torchmem")
    assert shell.find_line_magic("mlrun") is not None
    assert shell.find_line_magic("memlog").handle is not memlog  # a new logger
    shell.run_line_magic("unload_ext", "torchmem")
