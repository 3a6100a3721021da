"""The line profiler and the decorators never in the user's way: under coverage.py, with
other tracers and profilers enabled and disabled in any order, with threads, on methods
and every kind of function, and at interpreter exit. Exact to the byte on CPU tensors.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import inspect
import itertools
import json
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torchmem.lines
from standins import KiB, MiB, TracerStandIn, environ_without_gpu
from torchmem import LineProfiler, mem_trace, meter, profile, profile_every, valid_columns
from torchmem.lines import check_columns
from torchmem.units import readable_size

PEAK, DELTA, ALLOCATED = (
    "active_bytes.all.peak",
    "active_bytes.all.delta",
    "active_bytes.all.allocated",
)


@pytest.fixture(autouse=True)
def _global_on_cpu(isolated_meters: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh global profiler on CPU tensors, whatever the machine has (and a fresh meter
    registry); no report of it at exit."""
    monkeypatch.setattr(torchmem.lines.memlab, "_global", LineProfiler(device="cpu"))
    yield
    atexit.unregister(torchmem.lines.memlab._print_at_exit)


@pytest.fixture(params=["settrace", "monitoring"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each event back end this Python has: ``sys.settrace`` everywhere (on 3.12+ by
    taking the tool ids the profiler would use), ``sys.monitoring`` from 3.12."""
    if request.param == "monitoring":
        if sys.version_info < (3, 12):
            pytest.skip("sys.monitoring is new in Python 3.12")
        yield request.param
        return
    taken = []
    if sys.version_info >= (3, 12):
        taken = [t for t in (3, 4) if sys.monitoring.get_tool(t) is None]
        for tool in taken:
            sys.monitoring.use_tool_id(tool, "someone else")
    try:
        yield request.param
    finally:
        for tool in taken:
            sys.monitoring.free_tool_id(tool)


def alive() -> int:
    """Bytes of CPU tensors alive in the process now, as the profiler's meter counts."""
    gc.collect()
    return meter("cpu").used()


def stats(prof: LineProfiler, func, code: str) -> tuple[int, dict[str, int]]:
    """(hits, stats) of the one line of `func` whose code starts with `code`."""
    (record,) = prof.records(func)
    (line,) = [line for line in record.lines if line.code.strip().startswith(code)]
    return line.hits, line.stats


def allocate():
    a = torch.zeros(1024, 1024)
    b = torch.zeros(2048, 1024).exp()
    del b
    return a


def call_allocate():
    allocate()


# coverage.py --------------------------------------------------------------------------

COVERED_SCRIPT = """\
import json
import sys
import threading

import torch

import helper  # coverage does not measure it
from torchmem import LineProfiler, meter


def allocate():
    a = torch.zeros(1024, 1024)
    b = torch.zeros(2048, 1024).exp()
    del b
    return a


def in_thread():
    c = torch.zeros(512, 1024)
    return c


def unwatched():
    return 1


def lines(prof, func):
    (record,) = prof.records(func)
    found = {}
    for line in record.lines[1:]:
        peak, delta = line.stats["active_bytes.all.peak"], line.stats["active_bytes.all.delta"]
        found[line.lineno - record.lines[0].lineno] = [line.hits, peak - base, delta]
    return found


base = meter("cpu").used()
with LineProfiler(allocate, in_thread, helper.work, device="cpu") as prof:
    allocate()
    unwatched()
    helper.work()
    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
found = {f.__name__: lines(prof, f) for f in (allocate, in_thread, helper.work)}
json.dump(found, sys.stdout)
"""

HELPER = """\
import torch


def work():
    t = torch.zeros(256, 1024)
    return t.shape
"""

MEASURED = {
    "allocate": {
        "1": [1, 4 * MiB, 4 * MiB],
        "2": [1, 20 * MiB, 8 * MiB],
        "3": [1, 12 * MiB, -8 * MiB],
        "4": [1, 4 * MiB, 0],
    },
    "in_thread": {"1": [1, 2 * MiB, 2 * MiB], "2": [1, 2 * MiB, 0]},
    "work": {"1": [1, MiB, MiB], "2": [1, MiB, 0]},
}


def coverage_cores() -> list[str]:
    cores = ["ctrace", "pytrace"]
    return [*cores, "sysmon"] if sys.version_info >= (3, 12) else cores


@pytest.mark.slow
@pytest.mark.parametrize("core", coverage_cores())
def test_under_coverage_run_both_record_every_line(tmp_path: Path, core: str):
    pytest.importorskip("coverage")
    script = tmp_path / "covered.py"
    script.write_text(COVERED_SCRIPT)
    (tmp_path / "helper.py").write_text(HELPER)
    env = {k: v for k, v in environ_without_gpu().items() if not k.startswith("COVERAGE_")}
    env["COVERAGE_CORE"] = core

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "coverage", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        return done.stdout

    assert json.loads(run("run", "--branch", f"--include={script}", str(script))) == MEASURED
    run("json", "-o", "coverage.json")
    (measured,) = json.loads((tmp_path / "coverage.json").read_text())["files"].values()
    assert measured["missing_lines"] == []  # every statement of the script, seen
    assert measured["missing_branches"] == []
    first = COVERED_SCRIPT.splitlines().index("def allocate():") + 1
    assert set(range(first, first + 5)) <= set(measured["executed_lines"])


# Other tracers, and several profilers -----------------------------------------------------


@contextlib.contextmanager
def tracing(tracer: object) -> Iterator[None]:
    """`tracer` as the trace function of this thread and of threads started in the block;
    the ones there before (coverage.py's, under ``coverage run``) back after it."""
    before = sys.gettrace(), threading.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(before[0])
        threading.settrace(before[1])


def test_profilers_disabled_in_any_order_put_back_the_tracer_there_before(backend):
    base = alive()
    for previous in (None, TracerStandIn(allocate)):
        for order in itertools.permutations(range(3)):
            profilers = [LineProfiler(allocate, device="cpu") for _ in range(3)]
            with tracing(previous):
                for prof in profilers:
                    prof.enable()
                call_allocate()
                for index in order:
                    profilers[index].disable()
                after = sys.gettrace(), threading.gettrace()
            assert after == (previous, previous), order
            for prof in profilers:
                hits, line = stats(prof, allocate, "b = ")
                assert (hits, line[PEAK], line[DELTA]) == (1, base + 20 * MiB, 8 * MiB)
        assert previous is None or len(previous.events) == 6 * 6  # call, 4 lines, return


def interleavings(n: int) -> Iterator[list[tuple[int, bool]]]:
    """Every order of enabling (True) and disabling (False) `n` profilers once each, each
    enabled before it is disabled."""
    steps = [(i, on) for i in range(n) for on in (True, False)]
    for order in itertools.permutations(steps):
        if all(order.index((i, True)) < order.index((i, False)) for i in range(n)):
            yield list(order)


def tick():
    return 1


def test_profilers_enabled_and_disabled_in_any_interleaving_leave_no_hook(backend):
    previous = TracerStandIn(tick)
    orders = list(interleavings(3))
    assert len(orders) == 90
    for order in orders:
        # "meta": no CPU meter to start per window, as this is about the hooks alone
        profilers = [LineProfiler(tick, device="meta") for _ in range(3)]
        with tracing(previous):
            for index, on in order:
                (profilers[index].enable if on else profilers[index].disable)()
                tick()
            after = sys.gettrace(), threading.gettrace()
        assert after == (previous, previous), order
        assert [p.records(tick)[0].lines[1].hits for p in profilers] == [
            order.index((i, False)) - order.index((i, True)) for i in range(3)
        ]
    assert len(previous.events) == 90 * 6 * 3  # call, line, return


def test_a_thread_started_while_profiling_gets_its_tracer_back_once_it_stops(backend):
    previous = TracerStandIn(allocate)
    started, go = threading.Event(), threading.Event()
    seen = []

    def worker():
        started.set()
        go.wait()
        call_allocate()  # a call: where a hook left behind would step aside
        seen.append(sys.gettrace())

    before = threading.gettrace()
    threading.settrace(previous)
    try:
        with LineProfiler(allocate, device="cpu"):
            thread = threading.Thread(target=worker)
            thread.start()
            started.wait()
    finally:
        threading.settrace(before)
        go.set()
        thread.join()
    assert seen == [previous]
    assert [e[1] for e in previous.events] == ["call", "line", "line", "line", "line", "return"]


def test_a_profiler_dropped_while_enabled_takes_its_hook_away(backend):
    previous = TracerStandIn(tick)
    with tracing(previous):
        kept = LineProfiler(tick, device="meta")
        kept.enable()
        dropped = LineProfiler(tick, device="meta")
        dropped.enable()
        tick()
        gone = weakref.ref(dropped)
        del dropped
        assert gone() is None  # at once: nothing holds it, no gc.collect() needed
        tick()
        kept.disable()
        after = sys.gettrace(), threading.gettrace()
        tick()
        solo = LineProfiler(tick, device="meta")
        solo.enable()
        del solo
        alone = sys.gettrace(), threading.gettrace()
    assert after == alone == (previous, previous)
    assert kept.records(tick)[0].lines[1].hits == 2
    if backend == "monitoring":
        assert "torchmem" not in {sys.monitoring.get_tool(t) for t in (3, 4)}
    assert len(previous.events) == 3 * 3  # call, line, return: the tracer saw every call


def test_an_enabled_profiler_sees_threads_started_by_another_one(backend):
    base = alive()
    outer, inner = LineProfiler(allocate, device="cpu"), LineProfiler(allocate, device="cpu")
    with outer:
        with inner:
            pass
        thread = threading.Thread(target=allocate)
        thread.start()
        thread.join()
    assert stats(outer, allocate, "b = ")[1][PEAK] == base + 20 * MiB
    assert not inner.records(allocate)[0].ran


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is new in Python 3.12")
def test_disabling_while_a_call_runs_in_another_thread_lets_the_call_go(backend, monkeypatch):
    # The dispatch meter keeps a mode per thread id: a window left open in a dead thread
    # blinds a later thread that gets the same id.
    monkeypatch.setenv("TORCHMEM_CPU_METER", "dispatch")
    started, finish = threading.Event(), threading.Event()
    made = []

    def slow():
        t = torch.zeros(1024, 1024)
        made.append(weakref.ref(t))
        started.set()
        finish.wait()
        return t.shape

    base = alive()
    prof = LineProfiler(slow, device="cpu")
    with prof:
        worker = threading.Thread(target=slow)
        worker.start()
        started.wait()
    finish.set()
    worker.join()
    assert alive() == base  # the call's frame, and its tensor, are gone
    assert made[0]() is None
    assert stats(prof, slow, "t = ")[0] == 1
    assert stats(prof, slow, "t = ")[1][DELTA] == 4 * MiB
    assert stats(prof, slow, "started.set()")[0] == 1  # measured until disable()

    # Python's threads are detached: a new one usually gets a dead one's id (pthread_t)
    # once its stack is free, though not always the first one after it.
    later = []

    def profile_in_a_new_thread(last: bool) -> None:
        if threading.get_ident() != worker.ident and not last:
            return
        with LineProfiler(allocate, device="cpu") as again:
            allocate()
        later.append((threading.get_ident(), stats(again, allocate, "b = ")[1]))

    for attempt in range(100):
        thread = threading.Thread(target=profile_in_a_new_thread, args=(attempt == 99,))
        thread.start()
        thread.join()
        if later:
            break
    ((_, line),) = later
    assert line[ALLOCATED] == 16 * MiB
    assert line[DELTA] == 8 * MiB
    assert line[PEAK] == base + 20 * MiB


# Decorators on methods, and on every kind of function ----------------------------------


def test_decorators_above_staticmethod_and_classmethod(capsys):
    class Model:
        @profile
        @staticmethod
        def static(n):
            t = torch.zeros(n, 1024)
            return t.shape

        @profile
        @classmethod
        def make(cls, n):
            t = torch.zeros(n, 1024)
            return cls, t.shape

        @profile_every(1)
        @staticmethod
        def every(n):
            return torch.zeros(n, 1024).shape

        @mem_trace(device="cpu")
        @classmethod
        def traced(cls, n):
            temp = torch.zeros(n * 256, 1024)
            del temp
            return cls

        @mem_trace(device="cpu")
        @staticmethod
        def traced_static(n):
            return torch.zeros(n * 256, 1024)

    assert isinstance(Model.__dict__["static"], staticmethod)
    assert isinstance(Model.__dict__["make"], classmethod)
    assert isinstance(Model.__dict__["every"], staticmethod)
    assert isinstance(Model.__dict__["traced"], classmethod)
    assert Model.static(256) == Model().static(256) == torch.Size([256, 1024])
    assert Model.make(512) == Model().make(512) == (Model, torch.Size([512, 1024]))
    before = meter("cpu").used()  # CPU tensors are absolute: earlier tests' may be alive
    assert Model.every(4) == torch.Size([4, 1024])
    assert Model().traced(2) is Model
    kept = Model.traced_static(3)
    prof = torchmem.lines.global_line_profiler()
    hits, line = stats(prof, Model.static, "t = ")
    assert (hits, line[ALLOCATED]) == (2, 2 * MiB)
    hits, line = stats(prof, Model.make, "t = ")
    assert (hits, line[ALLOCATED]) == (2, 4 * MiB)
    out = capsys.readouterr().out
    qualname = "test_decorators_above_staticmethod_and_classmethod.<locals>.Model"
    assert out.startswith(f"## {qualname}.every\n")
    line = inspect.unwrap(Model.every).__code__.co_firstlineno + 3  # 16 KiB, by profile_every
    peak = readable_size(before + 16 * KiB)
    assert f"{peak:>12} {'0.00B':>12}    1 {line:>4}" in out
    assert out.endswith(
        f"△Used Peaked MB:      0      2 ({qualname}.traced: exit)\n"
        f"△Used Peaked MB:      3      0 ({qualname}.traced_static: exit)\n"
    )
    assert kept.shape == (768, 1024)


def test_profile_records_an_async_generator_step_by_step():
    seen = []

    @profile
    async def numbers(n):
        try:
            while True:
                got = yield torch.zeros(n, 1024)
                seen.append((got, prof.enabled))
                n *= 2
        finally:
            torch.zeros(64, 1024)

    prof = torchmem.lines.global_line_profiler()
    assert inspect.isasyncgenfunction(numbers)

    async def consume():
        gen = numbers(256)
        first = await gen.__anext__()
        between = prof.enabled
        second = await gen.asend("sent")
        with pytest.raises(KeyError):
            await gen.athrow(KeyError("thrown"))
        return first, between, second

    first, between, second = asyncio.run(consume())
    assert (first.shape, between, second.shape) == ((256, 1024), False, (512, 1024))
    assert seen == [("sent", True)]
    assert stats(prof, numbers, "got = yield")[1][ALLOCATED] == 3 * MiB
    assert stats(prof, numbers, "seen.append")[0] == 1
    # the finally block, run by athrow()
    assert stats(prof, numbers, "torch.zeros(64")[1][ALLOCATED] == 256 * 1024


def test_profile_closes_an_async_generator_inside_the_profiler():
    @profile
    async def forever():
        try:
            while True:
                yield 1
        finally:
            torch.zeros(64, 1024)

    async def take_one():
        gen = forever()
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(take_one())
    prof = torchmem.lines.global_line_profiler()
    assert stats(prof, forever, "torch.zeros(64")[1][ALLOCATED] == 256 * 1024
    assert not prof.enabled


def test_profile_keeps_coroutines_and_generators_what_they_are():
    @profile
    async def compute(n):
        a = torch.zeros(n, 1024)
        await asyncio.sleep(0)
        return a.shape

    @profile
    def produce(n):
        got = yield torch.zeros(n, 1024)
        try:
            yield got
        except ValueError as exc:
            return exc.args

    prof = torchmem.lines.global_line_profiler()
    assert inspect.iscoroutinefunction(compute)
    assert inspect.isgeneratorfunction(produce)
    assert asyncio.run(compute(256)) == (256, 1024)
    gen = produce(512)
    assert next(gen).shape == (512, 1024)
    assert gen.send("back") == "back"
    with pytest.raises(StopIteration) as stop:
        gen.throw(ValueError("done"))
    assert stop.value.value == ("done",)
    assert stats(prof, compute, "a = ")[1][ALLOCATED] == MiB
    assert stats(prof, produce, "got = yield")[1][ALLOCATED] == 2 * MiB
    assert stats(prof, produce, "return exc.args")[0] == 1  # reached by throw()
    assert not prof.enabled


def test_profile_every_reports_after_a_generator_is_exhausted(capsys):
    @profile_every(1)
    def produce():
        yield torch.zeros(256, 1024)

    gen = produce()
    assert capsys.readouterr().out == ""
    assert next(gen).shape == (256, 1024)
    assert capsys.readouterr().out == ""
    assert list(gen) == []
    out = capsys.readouterr().out
    assert out.startswith("## test_profile_every_reports_after_a_generator_is_exhausted.")
    prof = torchmem.lines.global_line_profiler()
    assert stats(prof, produce, "yield")[1][ALLOCATED] == MiB


def test_mem_trace_spans_a_coroutine_and_a_generator(capsys):
    @mem_trace(device="cpu")
    async def compute():
        temp = torch.zeros(1024, 1024)
        await asyncio.sleep(0)
        del temp
        return 1

    @mem_trace(device="cpu")
    def produce():
        kept = torch.zeros(512, 1024)
        yield 1
        yield kept

    assert inspect.iscoroutinefunction(compute)
    gc.collect()  # earlier tests' tensors, which a collection inside the trace would free
    assert asyncio.run(compute()) == 1
    assert list(produce())[1].shape == (512, 1024)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("△Used Peaked MB:      0      4 (")
    assert out[1].startswith("△Used Peaked MB:      2      0 (")


# At exit ------------------------------------------------------------------------------

AT_EXIT = """\
import sys
import torch
import torchmem.lines.memlab
from torchmem import LineProfiler, profile
torchmem.lines.memlab._global = LineProfiler(device="cpu")

@profile
def step():
    x = torch.zeros(1024, 1024)
    return x.sum()

step()
{stdout}
"""

REPORT = """\
## step

active_bytes active_bytes hits line code
         all          all
        peak        delta
                                  7 @profile
                                  8 def step():
       4.00M        4.00M    1    9     x = torch.zeros(1024, 1024)
       4.00M        4.00B    1   10     return x.sum()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stdout", "stderr"),
    [
        ("sys.stdout.close()", REPORT),
        ("sys.stdout = None", REPORT),
        ("sys.stdout = sys.stderr = None", ""),
        ("sys.stdout.close(); sys.stderr.close()", ""),
    ],
    ids=["stdout-closed", "stdout-none", "both-none", "both-closed"],
)
def test_profile_at_exit_without_stdout_raises_nothing(tmp_path: Path, stdout: str, stderr: str):
    script = tmp_path / "closes.py"
    script.write_text(AT_EXIT.format(stdout=stdout))
    run = subprocess.run(
        [sys.executable, str(script)],
        env=environ_without_gpu(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, "", stderr)


# Columns -------------------------------------------------------------------------------


def test_a_bad_device_for_columns_is_a_value_error_naming_it():
    for call in (valid_columns, lambda d: check_columns(None, d)):
        with pytest.raises(ValueError, match=r"invalid device 'gpu'"):
            call("gpu")
    with pytest.raises(ValueError, match=r"invalid device 'gpu'"):
        check_columns(["active_bytes.all.peak"], "gpu")
