"""The pytest plugin (entry point ``torchmem`` of ``pytest11``): memory limits for tests,
and the tests with the highest peaks.

- ``@pytest.mark.limit_memory("24 MB", device=None, setup=False)``: the test fails if its
  peak rises above the limit over what was in use when it started.
- ``@pytest.mark.limit_leaks("1 MB", device=None, setup=False)``: the test fails if that
  much more stays in use after it returns (and ``gc.collect()``).
- ``--torchmem``: measure every test and print the highest peaks per device
  (``--torchmem-top N``); ``--torchmem-json PATH`` writes every test's numbers.

It does nothing unless a test carries a marker or the run passes an option: importing it
imports neither PyTorch nor the rest of torchmem. The hooks only measure and attach; the
limits are :mod:`torchmem.limits`, the text :mod:`torchmem.render.limits`. Under
pytest-xdist each worker measures its tests and sends the numbers with its reports, so
the controller prints the summary and writes the JSON.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from torchmem.records.limits import MARKERS

if TYPE_CHECKING:
    from torchmem.limits import Span
    from torchmem.meters import Meter
    from torchmem.records.limits import Limit, Usage, Verdict

MARKER_HELP = (
    "limit_memory(limit, *, device=None, setup=False): fail the test if its peak on the"
    " device (default: the current GPU, else CPU tensors; 'ram' for the process) rises more"
    " than limit ('24 MB', '1.5 GiB', bytes) above what was in use when it started; setup=True"
    " charges its fixtures too. See torchmem.limits.limit_memory.",
    "limit_leaks(limit, *, device=None, setup=False): fail the test if, after it returns and"
    " gc.collect(), more than limit stays in use on the device that was not in use before it."
    " See torchmem.limits.limit_leaks.",
)
MEMRAY = (
    "pytest-memray is loaded and acts on limit_memory and limit_leaks too: torchmem leaves"
    " them to it. Run pytest with -p no:memray for torchmem's limits (GPU and tensor memory)."
)
TOP = 5
"""How many tests per device ``--torchmem`` lists by default."""
JSON_VERSION = 1
"""The version of the ``--torchmem-json`` file's layout."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchmem", "memory of tests (torchmem)")
    group.addoption(
        "--torchmem",
        action="store_true",
        default=False,
        help="measure every test's peak memory per device (the current GPU, CPU tensors, the"
        " process's RAM) and list the tests with the highest peaks at the end",
    )
    group.addoption(
        "--torchmem-top",
        type=int,
        default=TOP,
        metavar="N",
        help=f"how many tests per device --torchmem lists (default: {TOP})",
    )
    group.addoption(
        "--torchmem-json",
        default=None,
        metavar="PATH",
        help="measure every test and write each one's start, peak and end bytes per device,"
        " and its limits' verdicts, to PATH as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKER_HELP:
        config.addinivalue_line("markers", line)
    top = config.getoption("torchmem_top")
    if top < 1:
        raise pytest.UsageError(f"--torchmem-top must be at least 1, not {top}")
    config.pluginmanager.register(Plugin(config), "torchmem-limits")


@dataclass
class _Test:
    """One test's measurements, kept on its item from setup to teardown."""

    limits: list[Limit]
    spans: dict[str, Span] = field(default_factory=dict)
    """Open spans by name: a limit's kind, or ``"summary"``."""
    verdicts: list[Verdict] = field(default_factory=list)
    """Verdicts not yet put on a report."""
    usage: dict[str, Usage] = field(default_factory=dict)
    """What the test body did on each device (``--torchmem``)."""
    failed: bool = False
    """Whether the test failed or errored by itself: its limits are then not judged."""

    def open(self, name: str, span: Span) -> None:
        span.start(collect=name == "limit_leaks")
        self.spans[name] = span

    def close(self, name: str, **stop: Any) -> None:
        """Stop span `name`, if open, and judge its limit unless the test failed."""
        span = self.spans.pop(name, None)
        if span is None:
            return
        judged = [x for x in self.limits if x.kind == name and not self.failed]
        self.verdicts += span.stop(judged, **stop)
        if name == "summary":
            self.usage = span.usage


_TEST = pytest.StashKey[_Test]()


class Plugin:
    """The plugin's state for one pytest run (one per process: the controller and each
    xdist worker)."""

    def __init__(self, config: pytest.Config) -> None:
        self.path = config.getoption("torchmem_json")
        self.summary = bool(config.getoption("torchmem"))
        self.every = self.summary or self.path is not None
        self.top: int = config.getoption("torchmem_top")
        self.worker = hasattr(config, "workerinput")
        self.results: dict[str, dict[str, Any]] = {}
        """Per test id, what its reports carried (``--torchmem-json``'s ``tests``)."""
        self._meters: list[Meter] = []
        """What every test is measured on (``--torchmem``): the current GPU where there is
        one, CPU tensors and the process's RAM."""
        self._running: dict[str, _Test] = {}
        """Tests set up and not yet torn down (an interrupted session leaves some)."""
        self._memray = config.pluginmanager.has_plugin("memray")
        """pytest-memray is loaded: it acts on the same two markers, and they are its."""
        self._warned = False

    def _limits(self, item: pytest.Item) -> list[Limit]:
        if not self._memray:
            return _read_limits(item)
        if any(map(item.get_closest_marker, MARKERS)) and not self._warned:
            self._warned = True
            item.warn(pytest.PytestWarning(MEMRAY))
        return []

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.every:
            from torchmem.limits import device_name
            from torchmem.meters import meter

            # Once, before any test runs: a test may hide or fake the GPU.
            devices = dict.fromkeys([device_name(None), "cpu", "ram"])
            self._meters = [meter(device) for device in devices]

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, None]:
        limits = self._limits(item)
        if not limits and not self.every:
            yield
            return
        test = item.stash[_TEST] = self._running[item.nodeid] = _Test(limits)
        for limit in limits:
            if limit.setup:
                test.open(limit.kind, _span(limit))
        outcome = yield
        test.failed = outcome.excinfo is not None

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, None]:
        test = item.stash.get(_TEST, None)
        if test is None:
            yield
            return
        from torchmem.limits import Span
        from torchmem.meters import meter

        ok = False
        try:
            for limit in test.limits:
                if not limit.setup:
                    test.open(limit.kind, _span(limit))
            if self.every:
                limited = [meter(x.device) for x in test.limits]
                test.open("summary", Span(self._meters + limited))
            outcome = yield
            ok = outcome.excinfo is None
        finally:
            test.failed |= not ok
            later = {x.kind for x in test.limits if x.kind == "limit_leaks" and x.setup}
            for name, span in test.spans.items():
                if name not in later:
                    span.freeze()  # before the recording's log and report are made
            names = item.funcargs if isinstance(item, pytest.Function) else None
            test.close("limit_memory", variables=names)  # frees what its recording kept
            if "limit_leaks" not in later:
                test.close("limit_leaks", collect=True)
            test.close("summary")

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, Any, None]:
        outcome = yield
        test = item.stash.get(_TEST, None)
        if test is None:
            return
        test.failed |= outcome.excinfo is not None
        # A leak limit with setup=True ends here; so does any span of a test that never ran.
        try:
            for name in list(test.spans):
                test.close(name, collect=True)
        finally:
            self._running.pop(item.nodeid, None)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, Any, None]:
        # tryfirst: after pytest's own wrappers (xfail's) have made the report what it is.
        outcome = yield
        test = item.stash.get(_TEST, None)
        if test is None:
            return
        report: pytest.TestReport = outcome.get_result()
        verdicts, test.verdicts = test.verdicts, []
        _fail(report, [v for v in verdicts if not v.passed])
        if self.every:
            usage = test.usage if report.when == "call" else {}
            report.torchmem = {  # type: ignore[attr-defined]  # xdist sends it to the controller
                "devices": {device: found.to_json() for device, found in usage.items()},
                "limits": [v.to_json() for v in verdicts],
            }

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = getattr(report, "torchmem", None)
        if found is None or self.worker:
            return
        entry = self.results.setdefault(
            report.nodeid, {"nodeid": report.nodeid, "outcome": None, "devices": {}, "limits": []}
        )
        entry["devices"].update(found["devices"])
        entry["limits"] += found["limits"]
        if report.when == "call":
            entry["outcome"] = report.outcome
        elif report.failed:
            entry["outcome"] = "error"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.summary or self.worker:
            return
        from torchmem.records.limits import Usage
        from torchmem.render.limits import summary

        tests = [
            (nodeid, {d: Usage(d, **numbers) for d, numbers in entry["devices"].items()})
            for nodeid, entry in self.results.items()
        ]
        terminalreporter.write_sep("=", "torchmem: highest peaks")
        terminalreporter.write(summary(tests, self.top))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        for test in self._running.values():  # interrupted: close what is open, judge nothing
            test.failed = True
            for name in list(test.spans):
                test.close(name)
        self._running.clear()
        if self.path is None or self.worker:
            return
        document = {"version": JSON_VERSION, "tests": list(self.results.values())}
        Path(self.path).write_text(json.dumps(document, indent=1) + "\n")


def _read_limits(item: pytest.Item) -> list[Limit]:
    """The limits `item` carries, read from its closest markers; a bad one fails it."""
    markers = [m for m in map(item.get_closest_marker, MARKERS) if m is not None]
    if not markers:
        return []
    from torchmem import limits

    read = {"limit_memory": limits.limit_memory, "limit_leaks": limits.limit_leaks}
    found = []
    for marker in markers:
        try:
            found.append(read[marker.name](*marker.args, **marker.kwargs))
        except (TypeError, ValueError) as exc:
            error = f"@pytest.mark.{marker.name}: {exc}"
            break
    else:
        return found
    pytest.fail(error, pytrace=False)  # outside the except: no chained traceback


def _span(limit: Limit) -> Span:
    """What a limit measures: a peak, with a recording to explain it; or what stays, with
    the live tensors listed to name them."""
    from torchmem.limits import Span
    from torchmem.meters import meter

    if limit.kind == "limit_memory":
        return Span([meter(limit.device)], record=limit.device)
    return Span([meter(limit.device)], tensors=limit.device)


def _fail(report: pytest.TestReport, failed: list[Verdict]) -> None:
    """Make a passing `report` fail with the `failed` verdicts' messages, and add what
    explains each as a section."""
    if not failed or not report.passed:
        return
    from torchmem.render.limits import explanation, failure

    report.outcome = "failed"
    report.longrepr = "\n".join(failure(v) for v in failed)
    for verdict in failed:
        section = explanation(verdict)
        if section is not None:
            report.sections.append(section)
