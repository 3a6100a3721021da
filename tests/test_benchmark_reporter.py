"""The tensor reporter benchmark (case 5) runs, in a tiny configuration, and its sizes are
exact to the byte. No times asserted.

Its measures run in a fresh process, as ``python -m benchmarks`` runs them: pytorch_memlab's
reporter reads every tensor of its process and fails on a fake tensor, and the first
torch.compile of a process (an earlier test's) leaves hundreds alive for good.
"""

import contextlib
import dataclasses
import importlib.metadata
import io
import sys

import pytest
from benchmarks import cells, lines, meters, peaks, reporter, run as run_command, suite

from standins import call_in_fresh_process_without_gpu
from torchmem import MemReporter

pytestmark = pytest.mark.integration

FLOAT32 = 4
SHAPES = {"0.weight": (1024, 1024), "0.bias": (1024,), "2.weight": (10, 1024), "2.bias": (10,)}
NAMES = [
    *[f"{param}{grad}" for param in SHAPES for grad in ("", ".grad")],
    *[f"Adam.{param}.{key}" for param in SHAPES for key in ("step", "exp_avg", "exp_avg_sq")],
]
TIME_HEADER = "| case | contender | median | ratio to torchmem |"
SIZE_HEADER = (
    "| tensor | shape | true bytes | torchmem | torchmem error | pytorch_memlab "
    "| pytorch_memlab error | pytorch_memlab rows |"
)


def true_bytes(name: str) -> int:
    """A float32 tensor's bytes, from its name alone: Adam's step is a scalar."""
    if name.endswith(".step"):
        return FLOAT32
    param = name.removeprefix("Adam.").removesuffix(".grad")
    param = param.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")
    numel = 1
    for size in SHAPES[param]:
        numel *= size
    return numel * FLOAT32


def measures() -> dict:
    """The benchmark's times for 200 tensors (and what measuring them printed) and its
    sizes, with their tables; JSON, made in a fresh process by :func:`measured`."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        times = reporter.measure_time(n=200, repeat=1)
    sizes = reporter.measure_sizes()
    return {
        "times": times,
        "printed": printed.getvalue(),
        "time_table": reporter.table_time(times),
        "sizes": [dataclasses.asdict(row) for row in sizes],
        "size_table": reporter.table_sizes(sizes),
    }


@pytest.fixture(scope="module")
def measured() -> dict:
    found = call_in_fresh_process_without_gpu(measures)
    found["times"] = [tuple(row) for row in found["times"]]
    found["sizes"] = [
        reporter.SizeRow(
            **{**row, "shape": tuple(row["shape"]), "memlab_names": tuple(row["memlab_names"])}
        )
        for row in found["sizes"]
    ]
    return found


def test_time_runs_and_tabulates(measured):
    rows = measured["times"]
    assert [(case, name) for case, name, _, _ in rows] == [
        ("report 200 live CPU tensors", name) for name in reporter.CONTENDERS
    ]
    assert rows[0][1] == reporter.BASE
    assert rows[0][3] == 1.0
    assert all(median is not None and median > 0 for _, _, median, _ in rows)
    assert measured["time_table"] == reporter.table_time(rows)
    text = measured["time_table"].splitlines()
    assert text[0] == TIME_HEADER
    assert len(text) == 2 + len(rows)
    assert [row.split("|")[2].strip() for row in text[2:]] == list(reporter.CONTENDERS)


def test_time_prints_nothing(measured):
    assert measured["printed"] == ""


def test_sizes_are_exact_for_torchmem(measured):
    rows = measured["sizes"]
    assert [row.name for row in rows] == NAMES
    assert {row.name: row.truth for row in rows} == {name: true_bytes(name) for name in NAMES}
    assert rows[0].name == "0.weight"
    assert rows[0].shape == (1024, 1024)
    assert rows[0].truth == 4_194_304
    assert [row.torchmem for row in rows] == [row.truth for row in rows]
    assert sum(row.truth for row in rows) == 16_957_616


def test_rows_carry_torchmems_own_names():
    model, opt = reporter.known_model()
    mem = MemReporter(model, objects=lambda: ())
    mem.add_optimizer(opt)
    assert [record.name for record in mem.snapshot("cpu")] == NAMES
    assert [name for name, _ in reporter.named_tensors(model, opt)] == NAMES


def test_size_table_has_a_line_per_row_and_the_total(measured):
    assert measured["size_table"] == reporter.table_sizes(measured["sizes"])
    text = measured["size_table"].splitlines()
    assert text[0] == SIZE_HEADER
    assert len(text) == 2 + len(measured["sizes"]) + 1
    assert [line.split("|")[1].strip() for line in text[2:-1]] == NAMES
    assert text[2].startswith("| 0.weight | (1024, 1024) | 4,194,304 | 4,194,304 | 0 |")
    assert text[-1].startswith("| total of these 20 | | 16,957,616 | 16,957,616 | 0 |")


def test_memlab_sizes_as_pytorch_memlab_0_3_2_reports_them(measured):
    pytest.importorskip("pytorch_memlab")
    if importlib.metadata.version("pytorch_memlab") != "0.3.2":
        pytest.skip("pytorch_memlab's sizes below are those of its version 0.3.2")
    rows = {row.name: row for row in measured["sizes"]}
    # untyped_storage().size() is already bytes, times element_size(), rounded up to 512
    assert rows["0.weight"].memlab == 16_777_216
    assert rows["0.weight"].memlab_names == ("0.weight",)
    assert rows["2.bias"].memlab == 512
    assert rows["Adam.0.weight.step"].memlab == 512
    for row in rows.values():
        assert row.memlab == -(-row.truth * FLOAT32 // 512) * 512
    grad = rows["0.weight.grad"]
    assert grad.memlab == 16_777_216
    assert len(grad.memlab_names) == 2  # a row from its gc scan, and one as the .grad


def test_a_missing_pytorch_memlab_shows_as_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_memlab", None)  # importing it now fails
    rows = reporter.measure_time(n=200, repeat=1)
    missing = [(median, ratio) for _, name, median, ratio in rows if name != reporter.BASE]
    assert missing == [(None, None)]
    assert "| pytorch_memlab MemReporter" in reporter.table_time(rows)
    assert reporter.table_time(rows).endswith("| not installed | - |")

    sizes = reporter.measure_sizes()
    assert [row.memlab for row in sizes] == [None] * len(NAMES)
    assert [row.torchmem for row in sizes] == [row.truth for row in sizes]
    text = reporter.table_sizes(sizes).splitlines()
    assert text[0] == SIZE_HEADER
    assert all(line.endswith("| not installed | - | - |") for line in text[2:-1])
    assert text[-1].endswith("| not installed | - | |")


def test_benchmark_docstrings_print_as_written():
    # RESULTS.md quotes them: an escape in a non-raw docstring becomes a control byte there.
    for module in (cells, lines, meters, peaks, reporter, run_command):
        text = suite.doc(module)
        assert [c for c in text if ord(c) < 32 and c != "\n"] == [], module.__name__
