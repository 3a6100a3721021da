"""The pytest plugin (entry point ``torchmem`` of ``pytest11``): memory limits for tests,
and the tests with the highest peaks.

- ``@pytest.mark.limit_memory("24 MB", device=None, setup=False, current_thread_only=False)``:
  the test fails if its peak rises above the limit over what was in use when it started.
- ``@pytest.mark.limit_leaks("1 MB", device=None, setup=False, current_thread_only=False)``:
  the test fails if that much more stays in use after it returns (and ``gc.collect()``).
- ``torchmem_limit_memory`` and ``torchmem_limit_leaks``: the same, and torchmem's
  wherever pytest-memray is loaded too (see :meth:`Plugin.pytest_runtest_call`).
- ``--torchmem``: measure every test and print the highest peaks per device
  (``--torchmem-top N``); ``--torchmem-json PATH`` writes every test's numbers.

It does nothing unless a test carries a marker or the run passes an option: importing it
imports neither PyTorch nor the rest of torchmem. The hooks only measure and attach; the
limits are :mod:`torchmem.limits`, the text :mod:`torchmem.render.limits`. A limit a test
goes over fails the phase that measured it (its call, or its teardown for a leak with
``setup=True``) as an exception of that phase would, so that ``xfail`` holds for it too.
Under pytest-xdist each worker measures its tests and sends the numbers with its reports,
so the controller prints the summary and writes the JSON.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

import pytest

from torchmem.records.limits import MARKERS, PREFIX

if TYPE_CHECKING:
    from torchmem.limits import Span
    from torchmem.meters import Meter
    from torchmem.records.limits import Limit, Usage, Verdict

SIGNATURE = "(limit, *, device=None, setup=False, current_thread_only=False)"
MARKER_HELP = (
    f"limit_memory{SIGNATURE}: fail the test if its peak on the device (default: the current"
    " GPU, else CPU tensors; 'ram' for the process) rises more than limit ('24 MB', '1.5 GiB',"
    " bytes) above what was in use when it started; setup=True charges its fixtures too;"
    " current_thread_only=True counts the test's thread alone. See"
    " torchmem.limits.limit_memory.",
    f"limit_leaks{SIGNATURE}: fail the test if, after it returns and gc.collect(), more than"
    " limit stays in use on the device that was not in use before it. See"
    " torchmem.limits.limit_leaks.",
    f"{PREFIX}limit_memory{SIGNATURE}: limit_memory, torchmem's where pytest-memray is loaded.",
    f"{PREFIX}limit_leaks{SIGNATURE}: limit_leaks, torchmem's where pytest-memray is loaded.",
)
MEMRAY = (
    "pytest-memray is loaded and judges the limit_memory and limit_leaks markers that it can"
    " read (those without device or setup): torchmem leaves them to it. Mark tests with"
    f" {PREFIX}limit_memory and {PREFIX}limit_leaks for torchmem's limits (GPU and tensor"
    " memory), or run pytest with -p no:memray."
)
TOP_TESTS = 5
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
        default=TOP_TESTS,
        metavar="N",
        help=f"how many tests per device --torchmem lists (default: {TOP_TESTS})",
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
    over: list[Verdict] = field(default_factory=list)
    """The failed verdicts the phase ending now raised for: its report shows them."""
    tracebacks: list[TracebackType] = field(default_factory=list)
    """What the test's setup and call raised: its teardown clears their frames."""

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

    def judge(self) -> None:
        """Fail the phase ending now if a limit it judged was gone over, as the test's own
        exception would: pytest then makes of it what it makes of one (``xfail``)."""
        over = [v for v in self.verdicts if not v.passed]
        if over:  # none where the test failed by itself: nothing was judged
            from torchmem.render.limits import failure

            self.over = over
            pytest.fail("\n".join(failure(v) for v in over), pytrace=False)


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
        self._memray: ModuleType | None = config.pluginmanager.get_plugin("memray")
        """pytest-memray's plugin, where it is loaded: it acts on markers of the same names."""
        self._warned = False

    def _ours(self, marker: pytest.Mark) -> bool:
        """Whether `marker` is one of torchmem's limits: a ``torchmem_`` one, or one of
        :data:`MARKERS` that pytest-memray is not loaded to read."""
        if marker.name in MARKERS:
            return self._memray is None or not _memray_reads(self._memray, marker)
        return marker.name.startswith(PREFIX) and marker.name[len(PREFIX) :] in MARKERS

    def _limits(self, item: pytest.Item) -> list[Limit]:
        """The limits `item` carries: the closest marker of each kind that is torchmem's;
        a bad one fails it. Warns, once, where pytest-memray takes a marker."""
        markers = []
        for kind in MARKERS:
            names = (kind, PREFIX + kind)
            found = (m for m in item.iter_markers() if m.name in names and self._ours(m))
            marker = next(found, None)
            if marker is not None:
                markers.append(marker)
        theirs = self._memray is not None and any(
            m.name in MARKERS and not self._ours(m) for m in item.iter_markers()
        )
        if theirs and not self._warned:
            self._warned = True
            item.warn(pytest.PytestWarning(MEMRAY))
        return self._read(markers)

    def _read(self, markers: list[pytest.Mark]) -> list[Limit]:
        """The limits `markers` stand for; a bad one fails the test. (Read before any is
        renamed by :meth:`_hide`: one renamed has been read well already.)"""
        if not markers:
            return []
        from torchmem import limits

        found = []
        for marker in markers:
            kind = marker.name.removeprefix(PREFIX)
            read = limits.limit_memory if kind == "limit_memory" else limits.limit_leaks
            try:
                found.append(read(*marker.args, **marker.kwargs))
            except (TypeError, ValueError) as exc:
                error = f"@pytest.mark.{marker.name}: {exc}"
                break
        else:
            return found
        pytest.fail(error, pytrace=False)  # outside the except: no chained traceback

    def _hide(self, item: pytest.Item) -> None:
        """Rename torchmem's limit markers that have pytest-memray's names, on `item` and
        the nodes above it, to their ``torchmem_`` names: pytest-memray's hooks read
        every marker of its names that the test's ``iter_markers()`` gives, and call
        its own function with its arguments."""
        for node in item.listchain():
            for i, marker in enumerate(node.own_markers):
                if marker.name in MARKERS and self._ours(marker):
                    renamed = getattr(pytest.mark, PREFIX + marker.name)
                    node.own_markers[i] = renamed(*marker.args, **marker.kwargs).mark

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.every:
            from torchmem.meters import meter
            from torchmem.resolve import measured

            # Once, before any test runs: a test may hide or fake the GPU.
            devices = dict.fromkeys([measured(None), "cpu", "ram"])
            self._meters = [meter(device) for device in devices]

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        limits = self._limits(item)
        if not limits and not self.every:
            return (yield)
        from torchmem.limits import Span

        test = item.stash[_TEST] = self._running[item.nodeid] = _Test(limits)
        for limit in limits:
            if limit.setup:
                test.open(limit.kind, Span.of(limit))
        try:
            return (yield)
        except BaseException:
            test.failed = True
            raise

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """Measure the test body. Where pytest-memray is loaded, first :meth:`_hide`
        torchmem's markers from it: it reads them while the body runs, and after."""
        if self._memray is not None:
            self._hide(item)
        test = item.stash.get(_TEST, None)
        if test is None:
            return (yield)
        from torchmem.limits import Span
        from torchmem.meters import meter

        try:
            for limit in test.limits:
                if not limit.setup:
                    test.open(limit.kind, Span.of(limit))
            if self.every:
                limited = [meter(x.device) for x in test.limits]
                test.open("summary", Span(self._meters + limited))
            result = yield
        except BaseException:
            test.failed = True
            raise
        finally:
            later = {x.kind for x in test.limits if x.kind == "limit_leaks" and x.setup}
            for name, span in test.spans.items():
                if name not in later:
                    span.freeze()  # before the recording's log and report are made
            names = item.funcargs if isinstance(item, pytest.Function) else None
            test.close("limit_memory", variables=names)  # frees what its recording kept
            if "limit_leaks" not in later:
                test.close("limit_leaks", collect=True)
            test.close("summary")
        test.judge()
        return result

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        """End what is open, and let go of the test's frames: a test that raised is held
        by its traceback in a reference cycle (pluggy's frames hold the exception), which
        the measuring after it lets age out of gc's young generation: the test's locals
        (its model) would stay until a full collection, into later tests."""
        test = item.stash.get(_TEST, None)
        if test is None:
            return (yield)
        for raised in test.tracebacks:  # reported, and past --pdb's post-mortem
            _clear_frames(raised)
        test.tracebacks.clear()
        try:
            result = yield
        except BaseException:
            test.failed = True
            raise
        finally:
            # A leak limit with setup=True ends here; so does any span of a test that
            # never ran.
            try:
                for name in list(test.spans):
                    test.close(name, collect=True)
            finally:
                self._running.pop(item.nodeid, None)
        test.judge()
        return result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, Any]:
        # tryfirst: after pytest's own wrappers (xfail's) have made the report what it is.
        report: pytest.TestReport = yield
        test = item.stash.get(_TEST, None)
        if test is None:
            return report
        if call.excinfo is not None and call.when != "teardown":
            test.tracebacks.append(call.excinfo.tb)
        verdicts, test.verdicts = test.verdicts, []
        over, test.over = test.over, []
        if over and report.failed:
            _explain(report, over)
        if self.every:
            usage = test.usage if report.when == "call" else {}
            report.torchmem = {  # type: ignore[attr-defined]  # xdist sends it to the controller
                "devices": {device: found.to_json() for device, found in usage.items()},
                "limits": [v.to_json() for v in verdicts],
            }
        return report

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


def _memray_reads(plugin: ModuleType, marker: pytest.Mark) -> bool:
    """Whether pytest-memray's own function for `marker` takes its arguments: its
    keywords, and a limit its parser reads (pytest-memray 1.x ends the whole run with
    an INTERNALERROR on any other)."""
    function = getattr(plugin, "MARKERS", {}).get(marker.name)
    if function is None:
        return False
    signature = inspect.signature(function)
    # Its parameters named with "_" are the ones its hook passes (the result file).
    public = [p for p in signature.parameters.values() if not p.name.startswith("_")]
    try:
        bound = signature.replace(parameters=public).bind(*marker.args, **marker.kwargs)
    except TypeError:
        return False
    limit = next(iter(bound.arguments.values()), None)
    parse = getattr(sys.modules.get("pytest_memray.utils"), "parse_memory_string", None)
    if parse is None:  # another layout than 1.x's: its parser cannot be asked
        return isinstance(limit, str)
    try:
        parse(limit)
    except (TypeError, ValueError):
        return False
    return True


def _clear_frames(raised: TracebackType | None) -> None:
    """Let go of the locals of the frames `raised` went through, as
    ``traceback.clear_frames`` does, and before Python 3.13 of the copy of a function's
    locals that reading its ``f_locals`` (pytest's report does) leaves on its frame, which
    ``frame.clear()`` leaves alive."""
    while raised is not None:
        frame = raised.tb_frame
        try:
            if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
                frame.f_locals.clear()
            frame.clear()
        except RuntimeError:  # still running
            pass
        raised = raised.tb_next


def _explain(report: pytest.TestReport, over: list[Verdict]) -> None:
    """Give the failed `report` the `over` verdicts' messages, without pytest's
    ``Failed:``, and add what explains each as a section."""
    from torchmem.render.limits import explanation, failure

    report.longrepr = "\n".join(failure(v) for v in over)
    for verdict in over:
        section = explanation(verdict)
        if section is not None:
            report.sections.append(section)
