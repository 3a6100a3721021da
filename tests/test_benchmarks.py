"""The benchmarks run (in a tiny configuration), so they cannot rot. No times asserted."""

from benchmarks import meters


def test_meter_benchmark_runs_and_tabulates():
    rows = meters.measure(repeat=1, scale=0.01)
    assert [(case, name) for case, name, _, _ in rows] == [
        (case, name) for case in meters.CASES for name in meters.CONTENDERS
    ]
    assert [ratio for case, name, _, ratio in rows if name == "unwatched"] == [1.0, 1.0]
    lines = meters.table(rows).splitlines()
    assert lines[0] == "| case | contender | median | ratio |"
    assert len(lines) == 2 + len(rows)
