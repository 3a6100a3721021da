"""The benchmarks run (in a tiny configuration), so they cannot rot. No times asserted."""

import sys

from benchmarks import lines, meters


def test_meter_benchmark_runs_and_tabulates():
    rows = meters.measure(repeat=1, scale=0.01)
    assert [(case, name) for case, name, _, _ in rows] == [
        (case, name) for case in meters.CASES for name in meters.CONTENDERS
    ]
    assert [ratio for case, name, _, ratio in rows if name == "unwatched"] == [1.0, 1.0]
    text = meters.table(rows).splitlines()
    assert text[0] == "| case | contender | median | ratio |"
    assert len(text) == 2 + len(rows)


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
