"""The benchmarks run (in a tiny configuration), so they cannot rot. No times asserted.

The whole suite runs once, in a fresh process, as ``python -m benchmarks`` runs it; what the
cases it runs in processes of their own (``torchmem run``, torchrun, the long runs, tiny
allocations, a recording's fixed cost, the model zoo) returned there is checked case by case
(a subtest each), rather than by running each case again."""

import base64
import pickle
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from benchmarks import (
    allocations,
    cells,
    fixed,
    lines,
    long,
    meters,
    peaks,
    ranks,
    run as run_command,
    sharded,
    suite,
    zoo,
)

import torchmem
from standins import call_in_fresh_process_without_gpu, hide_gpus

pytestmark = pytest.mark.slow  # the benchmarks themselves, in tiny configurations
KEPT: tuple[ModuleType, ...] = (run_command, ranks, long, allocations, fixed, zoo, sharded)
"""The cases whose ``measure`` results the whole suite's run hands back."""


def test_meter_benchmark_runs_and_tabulates():
    rows = meters.measure(repeat=1, scale=0.01)
    assert [(case, name) for case, name, _, _ in rows] == [
        (case, name) for case in meters.CASES for name in meters.contenders("cpu")
    ]
    assert list(meters.contenders("cpu"))[1:3] == [
        "torchmem CpuAllocatorMeter",
        "torchmem CpuDispatchMeter",
    ]
    assert [ratio for case, name, _, ratio in rows if name == "unwatched"] == [1.0, 1.0]
    text = meters.table(rows).splitlines()
    assert text[0] == "| case | contender | median | ratio |"
    assert len(text) == 2 + len(rows)
    verdicts = meters.verdicts(rows).splitlines()
    assert [line.split(":")[0] for line in verdicts] == [f"- {case}" for case in meters.CASES]
    assert all(line.endswith(("(met)", "(missed)")) for line in verdicts)
    per_op = meters.per_op(rows, ops=100).splitlines()
    assert [line.split(":")[0] for line in per_op] == [
        "- torchmem CpuAllocatorMeter",
        "- torchmem CpuDispatchMeter",
        "- torch.profiler(profile_memory=True)",
    ]
    assert per_op[0].endswith(("µs: met)", "µs: missed)"))


def test_line_benchmark_runs_and_tabulates():
    rows = lines.measure(repeat=1, scale=0.02)
    pairs = [(case, name) for case in lines.CASES for name in lines.CONTENDERS]
    assert [(case, name) for case, name, _, _ in rows] == pairs
    assert [ratio for case, name, _, ratio in rows if name == "unprofiled"] == [1.0, 1.0]
    text = lines.table(rows).splitlines()
    assert text[0] == "| case | contender | median | ratio |"
    assert [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in text[2:]] == pairs
    assert len(lines.targets(rows).splitlines()) == len(lines.CASES)


def test_line_benchmark_shows_a_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "memory_profiler", None)  # importing it now fails
    rows = lines.measure(repeat=1, scale=0.02)
    missing = [(case, t, r) for case, name, t, r in rows if name.startswith("memory_profiler")]
    assert missing == [(case, None, None) for case in lines.CASES]
    assert f"| {next(iter(lines.CASES))} | memory_profiler" in lines.table(rows)
    assert "| not installed | - |" in lines.table(rows)


def test_peak_benchmark_catches_tensor_spikes_to_the_byte(monkeypatch):
    hide_gpus(monkeypatch)  # else the logger's tensor row is the GPU's
    size = 2**26  # above glibc's largest mmap threshold (32 MiB), so freeing returns it
    results = peaks.measure(repeat=1, size=size)
    names = [
        "torchmem MemTrace (RAM, VmHWM)",
        "torchmem MemTrace (CPU tensors)",
        "torchmem CellLogger (RAM row)",
        "torchmem CellLogger (tensor row)",
        "ipyexperiments CellLogger (RSS thread)",
        "1 ms RSS polling thread",
    ]
    assert [(r.spike, r.contender) for r in results] == [
        (spike, name)
        for spike in ("GIL held (bytes)", "F.cross_entropy", "numpy")
        for name in names
    ]
    found = {(r.spike, r.contender): r for r in results}
    # The temporary log_softmax of 4 MiB of logits, and nll_loss's two 4-byte scalars.
    for row in ("torchmem MemTrace (CPU tensors)", "torchmem CellLogger (tensor row)"):
        assert found["F.cross_entropy", row].found == (size + 8,)
        assert found["F.cross_entropy", row].worst_error == 0
        assert found["numpy", row].found is None
        assert found["numpy", row].note == "not a tensor"
    if torchmem.meter("ram").exact:  # the kernel's high-water mark, not a sampling thread
        for spike in ("GIL held (bytes)", "numpy"):
            for row in ("torchmem MemTrace (RAM, VmHWM)", "torchmem CellLogger (RAM row)"):
                assert found[spike, row].caught == 1
    text = peaks.table(results).splitlines()
    assert text[0] == "| spike | contender | caught | worst error |"
    assert "| F.cross_entropy | torchmem MemTrace (CPU tensors) | 1/1 | +0 B |" in text
    assert len(text) == 2 + len(results)


def test_peak_benchmark_shows_a_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipyexperiments", None)
    results = peaks.measure(repeat=1, size=2**20)
    missing = [r for r in results if r.contender.startswith("ipyexperiments")]
    assert [(r.found, r.note) for r in missing] == [(None, "not installed")] * 3


def test_cell_benchmark_runs_each_logger_in_a_real_shell():
    rows = cells.measure(repeat=1, sleep=0.01)
    assert [row.contender for row in rows] == list(cells.CONTENDERS)
    assert all(row.background is not None and row.background >= 0 for row in rows)
    assert all(row.total is not None and row.total >= row.background for row in rows)
    text = cells.table(rows, 0.01).splitlines()
    assert text[0] == "| contender | CPU s in other threads | CPU s in all (cell sleeps 0.01 s) |"
    assert len(text) == 2 + len(cells.CONTENDERS)


def test_cell_benchmark_shows_a_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipyexperiments", None)
    rows = cells.measure(repeat=1, sleep=0.01)
    assert [(row.contender, row.background) for row in rows if row.background is None] == [
        ("ipyexperiments CellLogger", None)
    ]
    assert "| ipyexperiments CellLogger | not installed | - |" in cells.table(rows, 0.01)


class Whole(NamedTuple):
    """One run of the tiny suite: its report, the sections it showed as it went (joined),
    and what each of :data:`KEPT`'s ``measure`` returned, by module."""

    report: str
    shown: str
    measured: dict[ModuleType, Any]


def whole_suite() -> list[str]:
    """Run in a fresh process: :class:`Whole`'s fields, ``measured`` pickled (base64)."""
    measured: dict[str, Any] = {}
    for module in KEPT:

        def keeping(*args: Any, _measure: Any = module.measure, _name: str = module.__name__):
            measured[_name] = _measure(*args)
            return measured[_name]

        module.measure = keeping
    shown: list[str] = []
    report = suite.run(suite.TINY, show=shown.append)
    return [report, "\n".join(shown) + "\n", base64.b64encode(pickle.dumps(measured)).decode()]


def test_the_whole_suite_runs_and_each_case_tabulates(subtests: pytest.Subtests) -> None:
    report, shown, measured = call_in_fresh_process_without_gpu(whole_suite)
    by_name = pickle.loads(base64.b64decode(measured))
    whole = Whole(report, shown, {module: by_name[module.__name__] for module in KEPT})
    with subtests.test("sections"):
        sections_are_written(whole)
    for module, check in CHECKS.items():
        with subtests.test(module.__name__):
            check(whole.measured[module])


def sections_are_written(whole: Whole) -> None:
    report = whole.report
    assert report.startswith("# Benchmark results\n\n- Date: ")
    headings = [line for line in report.splitlines() if line.startswith("## ")]
    assert headings == [
        "## 1. Peak exactness",
        "## 2. Line profiler overhead",
        "## 3. CPU meter overhead per operator",
        "## 4. Background cost of the cell logger",
        "## 5. Tensor reporter",
        "## 6. torchmem run",
        "## 7. Estimator",
        "## 8. pytest plugin",
        "## 9. torchmem run under torchrun",
        "## 10. Reading a memory snapshot",
        "## 11. torchmem run on long training runs",
        "## 12. Many tiny allocations",
        "## 13. A recording's fixed cost",
        "## 14. Estimator model zoo",
        "## 15. Each rank of a sharded step, estimated",
    ]
    assert report.count("Skipped: no CUDA device on this machine.") == 3
    assert whole.shown == report  # each section shown as it was measured
    assert report.rstrip().splitlines()[-1].startswith("Whole run: ")


@pytest.mark.cuda
def test_cuda_variants_run_on_a_real_gpu():
    size = 2**26
    results = peaks.measure_cuda(repeat=1, size=size)
    traced = results[0]
    assert traced.contender == "torchmem MemTrace (CUDA allocator)"
    # The temporary, and nll_loss's two scalars in a 512-byte block each.
    assert traced.found == (size + 2 * 512,)
    rows = meters.measure(repeat=1, scale=0.01, device="cuda")
    assert [name for _, name, _, _ in rows][:3] == list(meters.contenders("cuda"))
    rows = lines.measure(repeat=1, scale=0.02, device="cuda")
    assert all(ratio is not None for _, name, _, ratio in rows if name.startswith("torchmem"))


def run_tabulates(rows: list[Any]) -> None:
    assert [name for _, name, _, _ in rows] == [
        "python",
        "torchmem run --no-sites",
        "torchmem run",
        "torchmem run --html",
        "PyTorch profiler + export_memory_timeline",
    ]
    assert rows[0][3] == 1.0
    verdicts = run_command.verdicts(rows).splitlines()
    assert [line.split(":")[0] for line in verdicts] == [
        "- torchmem run --no-sites",
        "- torchmem run",
    ]


def torchrun_tabulates(rows: list[Any]) -> None:
    assert [name for _, name, _, _ in rows] == ["torchrun", "torchrun -m torchmem run"]
    assert rows[0][3] == 1.0
    assert ranks.verdicts(rows).startswith("- torchrun -m torchmem run: ")


def test_snapshot_benchmark_runs_and_tabulates():
    from benchmarks import snapshot

    data = snapshot.synthetic(1000)
    assert len(data["device_traces"][0]) >= 1000
    rows = snapshot.measure(repeat=1, entries=1000)
    assert [name.split(" ")[0] for _, name, _, _ in rows] == [
        "pickle.load",
        "torchmem.load_snapshot",
    ]
    assert rows[0][3] == 1.0
    assert snapshot.verdicts(rows).startswith(
        "- torchmem.load_snapshot (plain data only, analysed): "
    )


def test_a_process_run_weighs_the_child_alone_and_times_its_last_line():
    from benchmarks import processes

    big = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    last = f"import time; print({processes.MARK!r}, time.monotonic())"
    large = processes.run([sys.executable, "-c", f"{big}; {last}"])
    small = processes.run([sys.executable, "-c", "pass"])
    assert large.rss > 200 * processes.MiB > small.rss  # not the largest child so far
    assert large.tail is not None and 0 <= large.tail < large.seconds
    assert small.tail is None
    with pytest.raises(subprocess.CalledProcessError, match="exit status 3"):
        processes.run([sys.executable, "-c", "raise SystemExit(3)"])


def test_a_process_past_its_limit_is_stopped_and_not_run_again(monkeypatch):
    from benchmarks import processes

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    stopped = processes.run(sleep, limit=0.5)
    assert stopped.stopped
    assert 0.5 <= stopped.seconds < 30
    assert stopped.tail is None
    monkeypatch.setattr(processes, "FLOOR", 0.5)
    commands = {"plain": [sys.executable, "-c", "pass"], "slow": sleep}
    base, slow = processes.measure("case", commands, repeat=2)
    assert not base.stopped
    assert slow.stopped
    assert slow.ratio > 1
    assert processes.table([base, slow]).splitlines()[3].endswith("| stopped |")


def test_process_tables_and_verdicts():
    from benchmarks import processes
    from benchmarks.processes import MiB, Run

    runs = [
        Run("case", "python", 2.0, 1.0, 300 * MiB, 0, 0.05),
        Run("case", "fast", 2.2, 1.1, 310 * MiB, 10 * MiB, 0.25),
        Run("case", "slow", 4.0, 2.0, 700 * MiB, 400 * MiB, None),
        Run("case", "stopped", 10.0, 5.0, 330 * MiB, 30 * MiB, None, stopped=True),
    ]
    text = processes.table(runs).splitlines()
    assert text[0].startswith("| case | contender | median | ratio | peak RSS | RSS over plain |")
    assert text[3] == "| case | fast | 2.20 s | 1.10x | 310 MiB | +10 MiB | 250 ms |"
    assert text[4].endswith("| 700 MiB | +400 MiB | - |")
    assert text[5] == "| case | stopped | >10.00 s | >5.00x | >330 MiB | >+30 MiB | stopped |"
    targets = {"fast": 1.2, "slow": 1.2, "stopped": 1.2}
    assert processes.verdicts(runs, targets, 64).splitlines() == [
        "- case, fast: 1.10x (target 1.2x: met), +10 MiB RSS (target +64 MiB: met)",
        "- case, slow: 2.00x (target 1.2x: missed), +400 MiB RSS (target +64 MiB: missed)",
        "- case, stopped: more than 5.00x (stopped before its end) (target 1.2x: missed),"
        " more than +30 MiB RSS (target +64 MiB: not known)",
    ]
    assert processes.verdicts(runs, {"slow": float("inf")}, 64) == (
        "- case, slow: 2.00x, +400 MiB RSS (target +64 MiB: missed)"
    )


def long_runs_tabulate(runs: list[Any]) -> None:
    cases = [  # suite.TINY's, the last of long.CASES (the others differ only in options)
        "examples/train_lm.py --steps 2 " + " ".join(long.NANOGPT_CPU),
    ]
    assert [(run.case, run.contender) for run in runs] == [
        (case, name) for case in cases for name in long.CONTENDERS
    ]
    assert [run.ratio for run in runs if run.contender == "python"] == [1.0]
    assert all(run.rss > 0 and run.tail is not None and run.tail >= 0 for run in runs)
    verdicts = long.verdicts(runs).splitlines()
    assert [line.split(":")[0] for line in verdicts] == [
        f"- {case}, {name}" for case in cases for name in long.CONTENDERS[1:]
    ]
    # The hooks that do nothing are the floor: no time target, an RSS one.
    assert [line.count("(target ") for line in verdicts] == [1, 2, 2]


def tiny_allocations_tabulate(runs: list[Any]) -> None:
    assert [run.contender for run in runs] == list(allocations.CONTENDERS)
    assert {run.case for run in runs} == {"1,000 x torch.empty(1)"}
    assert all(run.tail is not None for run in runs)
    verdicts = allocations.verdicts(runs).splitlines()
    assert len(verdicts) == 2
    assert all(line.endswith(("MiB: met)", "MiB: missed)")) for line in verdicts)
    assert [line.count("(target ") for line in verdicts] == [2, 2]


def fixed_cost_tabulates(measured: tuple[list[Any], int]) -> None:
    rows, objects = measured
    assert [name for _, name, _, _ in rows] == list(fixed.CONTENDERS)
    assert rows[0][3] == 1.0
    assert objects > 1000
    verdicts = fixed.verdicts(rows, objects).splitlines()
    assert [line.split(":")[0] for line in verdicts[:2]] == [
        f"- {name}" for name in fixed.CONTENDERS[1:]
    ]
    assert all(line.endswith(("ms: met)", "ms: missed)")) for line in verdicts[:2])


def test_plugin_verdict_holds_torchmem_to_pytest_memray_in_the_same_run():
    from benchmarks import plugin

    def found(ours: float, theirs: float | None) -> list:
        seconds = {plugin.BASE: 10.0, plugin.OURS: ours, plugin.THEIRS: theirs}
        return [("case", name, t, None) for name, t in seconds.items()]

    assert plugin.verdicts(found(12.0, 14.0), tests=20).splitlines() == [
        "- pytest, torchmem's limit_memory: +100 ms per test"
        " (target at most pytest-memray's +200 ms, same run: met)",
        "- pytest, pytest-memray's limit_memory: +200 ms per test",
    ]
    assert (
        plugin.verdicts(found(14.0, 12.0), tests=20)
        .splitlines()[0]
        .endswith("(target at most pytest-memray's +100 ms, same run: missed)")
    )
    assert plugin.verdicts(found(12.0, None), tests=20) == (
        "- pytest, torchmem's limit_memory: +100 ms per test"
        " (target at most pytest-memray's, same run: pytest-memray is not installed)"
    )


def zoo_estimates_real_architectures_as_measured(rows: list[Any]) -> None:
    pytest.importorskip("transformers")
    assert [row.model for row in rows] == list(zoo.MODELS)[:3]
    for row in rows:
        assert row.estimated is not None, row.error
        assert abs(row.estimated - row.measured) <= 0.02 * row.measured
    assert [line.endswith(": met)") for line in zoo.verdicts(rows).splitlines()] == [True] * 3
    assert zoo.table(rows).count("\n") == 2 + 3 - 1


def sharded_estimates_are_each_ranks_real_peak(found: list[Any]) -> None:
    contenders = ["real ranks (torchrun, gloo)", "torchmem.estimate", "FSDPMemTracker"]
    assert [(f.ranks, f.contender) for f in found] == [(2, name) for name in contenders]
    real, estimated, tracker = found
    assert len(real.peaks) == 2 and estimated.peaks == real.peaks
    assert tracker.peaks is not None and len(tracker.peaks) == 1
    text = sharded.table(found).splitlines()
    assert text[3].startswith(
        f"| 2 | torchmem.estimate | {real.peaks[0]:,} B | +0 B (+0.00%) | yes |"
    )
    assert sharded.verdicts(found) == "- 2 ranks: every rank's peak exact (met)"


CHECKS: dict[ModuleType, Callable[[Any], None]] = {
    run_command: run_tabulates,
    ranks: torchrun_tabulates,
    long: long_runs_tabulate,
    allocations: tiny_allocations_tabulate,
    fixed: fixed_cost_tabulates,
    zoo: zoo_estimates_real_architectures_as_measured,
    sharded: sharded_estimates_are_each_ranks_real_peak,
}
"""What each of :data:`KEPT`'s results must be."""
