"""The suite's three lanes, and the guard that keeps the unit lane what it says.

- ``unit``: records, renderers, rules, the architecture, the stand-ins. In the test's own
  process, no other process is started and the counting CPU allocator is never loaded.
  Every test not marked otherwise is a unit test.
- ``integration``: real meters, real processes, real IPython shells. The tests of
  ``meters/``, ``events/``, ``lines/``, ``notebook/`` and ``cli/``, which measure for real,
  and tests marked ``integration``, ``counting`` or ``cuda`` (a module marks all its tests
  with ``pytestmark``).
- ``slow``: tests of seconds each: stress, torchrun, a Jupyter kernel, the benchmarks, the
  2.7B estimates, the C++ builds, the live terminal view, loops of 100,000 steps, whole
  programs estimated or run many ways. Tests marked ``slow``, whatever else they are
  marked. They run first, so that parallel workers finish together.

``pytest --lane unit`` runs one lane (``--lane integration --lane slow`` two; ``-m "not
slow"`` the first two). Under ``coverage run``, slow tests and the processes they start are
not measured (:func:`slow_tests_unmeasured`). A unit test that starts a process, forks or
loads the counting allocator fails at teardown, naming what it did: mark it
``integration``. The guard is an audit hook (:func:`sys.addaudithook`): it sees every
thread, and records only while a unit test runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

LANES = ("unit", "integration", "slow")
MEASURING = {"meters", "events", "lines", "notebook", "cli"}
"""The folders of ``tests/`` whose tests all measure for real."""
STARTS = {
    "subprocess.Popen": "started a process",
    "os.fork": "forked",
    "os.forkpty": "forked",
    "os.posix_spawn": "spawned a process",
    "os.spawn": "spawned a process",
    "os.system": "ran a shell command",
    "os.exec": "replaced the process",
}
"""Audit events of a process being made, and what the test did."""

_seen: list[str] | None = None
"""What the unit test now running did that a unit test must not; None between unit tests."""


def lane(item: pytest.Item) -> str:
    """The lane `item` runs in."""
    if item.get_closest_marker("slow") is not None:
        return "slow"
    if any(item.get_closest_marker(name) for name in ("integration", "counting", "cuda")):
        return "integration"
    if item.path.parent.name in MEASURING and item.path.parent.parent.name == "tests":
        return "integration"
    return "unit"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        action="append",
        choices=LANES,
        help="run only this lane's tests: unit, integration or slow (may be given again)",
    )


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_audit)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.getoption("lane") or LANES
    dropped = [item for item in items if lane(item) not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = sorted(
        (item for item in items if lane(item) in chosen), key=lambda item: lane(item) != "slow"
    )


@pytest.fixture(autouse=True)
def unit_lane_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a unit test that started a process or loaded the counting allocator."""
    global _seen
    if lane(request.node) != "unit":
        yield
        return
    _seen = []
    try:
        yield
    finally:
        seen, _seen = _seen, None
    if seen:
        pytest.fail(
            f"a unit test {', '.join(sorted(set(seen)))}: mark it integration (tests/lanes.py)",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def slow_tests_unmeasured(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``coverage run``, a slow test runs unmeasured, and so do the processes it
    starts: coverage.py follows the others (``patch = ["subprocess"]``), but measured, the
    slow lane's hundreds of processes (benchmarks, stress, torchrun ranks) took as long again
    as the rest of the suite, and its long loops a fifth longer, running the code the
    integration lane runs. (pytest-cov's ``no_cover`` pauses coverage.py the same way.)"""
    if lane(request.node) != "slow":
        yield
        return
    try:
        from coverage import Coverage

        measuring = Coverage.current()
    except ImportError:  # coverage.py is not installed: nothing measures
        measuring = None
    if measuring is not None:
        measuring.stop()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)
            yield
    finally:
        if measuring is not None:
            # As coverage.py's own start in a subprocess: no check of the modules imported
            # already, which fails on torch's operator namespaces in sys.modules.
            measuring._warn_preimported_source = False
            measuring.start()


def _audit(event: str, args: tuple[object, ...]) -> None:
    seen = _seen
    if seen is None:
        return
    if event in STARTS:
        seen.append(STARTS[event])
    elif event == "ctypes.dlopen" and "cpu_allocator-" in str(args[0]):
        seen.append("loaded the counting CPU allocator")
