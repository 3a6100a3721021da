"""Meters under the things that happen to real programs: ``os.fork`` while another thread
uses a meter, Ctrl-C landing anywhere, windows dropped without closing or closed from
another thread, and the CPU spelled ``cpu:0``.

The CPU meter runs on both of its backends (the counting allocator and the dispatch-mode
fallback), as in ``test_cpu_meter.py``; ``"tensor"`` is a plain :class:`TensorMeter`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import coverage
import pytest
import torch

from standins import MiB
from torchmem import TensorMeter, meter
from torchmem._compat import dispatch_mode_stack
from torchmem.meters import Meter, SampledMeter
from torchmem.resolve import resolve_device

KINDS = ["tensor", "allocator", "dispatch"]


@pytest.fixture(params=KINDS)
def any_meter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, isolated_meters):
    if request.param == "tensor":
        return TensorMeter("cpu")
    monkeypatch.setenv("TORCHMEM_CPU_METER", request.param)
    m = meter("cpu")
    assert m.backend == request.param
    return m


@pytest.fixture(params=["tensor", "dispatch"])
def mode_meter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, isolated_meters):
    """A meter that watches through a dispatch mode on each thread with an open window."""
    if request.param == "tensor":
        return TensorMeter("cpu")
    monkeypatch.setenv("TORCHMEM_CPU_METER", "dispatch")
    return meter("cpu")


# os.fork while another thread uses the meter ------------------------------------------

FORKS = 20
CHILD_LIMIT_S = 60.0
"""How long a child may take before it counts as hung (it needs well under a second)."""
JOIN_LIMIT_S = 30.0
"""How long a thread that should end may take before the test fails instead of hanging."""


def measure_in_child(m: Meter) -> int:
    """In a forked child: the exit code, 0 if a window measured a 4 MiB tensor exactly.

    The tensor is left unfilled: a child forked after the parent ran an OpenMP parallel
    region (filling a large tensor) hangs in its next one, whatever the meter does."""
    with m.window() as w:
        kept = torch.empty(1024, 1024)
    exact = (w.peak() - w.start, m.used() - w.start) == (4 * MiB, 4 * MiB)
    del kept
    return 0 if exact else 2


def fork_and_wait(m: Meter) -> int | None:
    """Fork a child that measures; its exit code, or None if it hung (it is killed)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = measure_in_child(m)
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_children_forked_while_another_thread_opens_windows_measure_exactly(any_meter):
    m = any_meter
    stop, running = threading.Event(), threading.Event()

    def churn() -> None:
        # Untraced: coverage.py's tracer takes a lock of its own, which a fork can catch
        # held; a child would hang on it (coverage's, not the meter's).
        sys.settrace(None)
        while not stop.is_set():
            with m.window():
                torch.ones(10)
            running.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the lock is often held at a fork
    thread = threading.Thread(target=churn)
    thread.start()
    codes: list[int | None] = []
    try:
        running.wait()
        for _ in range(FORKS):
            codes.append(fork_and_wait(m))
            if codes[-1] != 0:
                break
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert codes == [0] * FORKS  # None: a child hung; 2: it measured wrong
    assert measure_in_child(m) == 0  # and the parent's meter still works


# Ctrl-C landing in the meter's code --------------------------------------------------

STORM_INTERRUPTS = 500
STORM_INTERVAL_S = 0.0002
STORM_LIMIT_S = 60.0


def step(m: Meter, live: list[torch.Tensor], i: int) -> None:
    """Make a tensor (and a temporary), keep up to 16, read the meter now and then."""
    t = torch.ones(256 + i % 64) + 1
    live.append(t)
    if len(live) > 16:
        del live[i % 16]
    if i % 8 == 0:
        m.used()


def storm(m: Meter, live: list[torch.Tensor]) -> int:
    """Run :func:`step` while SIGALRM raises KeyboardInterrupt every STORM_INTERVAL_S,
    as a Ctrl-C does, wherever it lands (meter callbacks, the dispatch mode, the fold),
    until STORM_INTERRUPTS reached this loop; return how many did.

    The handler lets this loop's own frame alone (and its own), so that every interrupt
    that is raised lands inside a step, where the loop catches it. It spares coverage.py's
    code too (its tracer runs Python under ``coverage run``): coverage.py is not ours to
    make safe, and deadlocks on a lock that an interrupt left held."""
    armed = True
    spared = {storm.__code__}
    coverage_code = os.path.dirname(coverage.__file__) + os.sep

    def handler(signum: int, frame: FrameType | None) -> None:
        if (
            armed
            and frame is not None
            and frame.f_code not in spared
            and not frame.f_code.co_filename.startswith(coverage_code)
        ):
            raise KeyboardInterrupt

    spared.add(handler.__code__)
    previous = signal.signal(signal.SIGALRM, handler)
    hits, i = 0, 0
    deadline = time.monotonic() + STORM_LIMIT_S
    signal.setitimer(signal.ITIMER_REAL, STORM_INTERVAL_S, STORM_INTERVAL_S)
    try:
        while hits < STORM_INTERRUPTS and time.monotonic() < deadline:
            i += 1
            try:
                step(m, live, i)
            except KeyboardInterrupt:
                hits += 1
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return hits


# Under pytest-xdist, an interrupt of the storm that lands after the test, in the worker's
# own loop, ended the worker (1 run of 3): alone, in pytest's main loop, it never has.
@pytest.mark.alone
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_an_interrupt_storm_leaves_the_total_exact_and_reaches_the_caller(any_meter):
    m = any_meter
    swallowed: list[Any] = []
    hook = sys.unraisablehook
    live: list[torch.Tensor] = []
    gc.collect()
    with m.window():
        start = m.used()
        gc.disable()  # only the storm's own deaths, which reference counting makes
        sys.unraisablehook = swallowed.append
        try:
            hits = storm(m, live)
        finally:
            sys.unraisablehook = hook
            gc.enable()
        gc.collect()  # what the interrupts' tracebacks held
        assert hits == STORM_INTERRUPTS
        assert live
        assert m.used() - start == sum(t.untyped_storage().nbytes() for t in live)
        live.clear()
        assert m.used() == start
    # Every interrupt reached the loop; none was lost in a callback ("Exception ignored").
    assert [u.exc_type for u in swallowed] == []


# Windows dropped open, or closed from another thread ---------------------------------
#
# A dropped window is released by its finalizer, which a garbage collection can run inside
# PyTorch's dispatcher: its dispatch mode stops counting at once, and leaves the thread's
# stack when that thread next uses the meter.


def test_a_window_dropped_open_warns_and_takes_its_mode_off(mode_meter):
    m = mode_meter
    before = dispatch_mode_stack()
    w = m.window()
    assert len(dispatch_mode_stack()) == len(before) + 1
    with pytest.warns(ResourceWarning, match=r"Window on .* was never closed"):
        del w
        gc.collect()
    m.used()
    assert dispatch_mode_stack() == before


def test_a_tensor_meter_stops_counting_when_its_window_is_dropped():
    m = TensorMeter("cpu")
    w = m.window()
    kept = torch.empty(MiB, dtype=torch.uint8)
    assert m.used() == MiB
    with pytest.warns(ResourceWarning, match="was never closed"):
        del w
        gc.collect()
    more = torch.empty(2 * MiB, dtype=torch.uint8)  # not watched any more
    assert m.used() == MiB
    del kept
    assert m.used() == 0
    del more


def test_a_window_dropped_in_a_reference_cycle_is_released_by_the_collector(mode_meter):
    m = mode_meter
    w = m.window()
    w.itself = w  # type: ignore[attr-defined]
    with pytest.warns(ResourceWarning, match="was never closed"):
        del w
        gc.collect()
    m.used()
    assert dispatch_mode_stack() == []


@pytest.mark.slow
def test_windows_collected_inside_operators_leave_pytorch_dispatching(mode_meter):
    m = mode_meter
    thresholds = gc.get_threshold()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(20):
            w = m.window()
            w.itself = w  # type: ignore[attr-defined]
            del w
            gc.set_threshold(1)  # a collection at almost every allocation, PyTorch's too
            try:
                for _ in range(20):
                    assert (torch.ones(8) + 1).sum().item() == 16
            finally:
                gc.set_threshold(*thresholds)
            gc.collect()
            m.used()
            assert dispatch_mode_stack() == []


def run_owner(m: Meter, release: Callable[[Any], None]) -> tuple[list[Any], list[int]]:
    """Open a window on a new thread, `release` it (close or drop) on this one, then let
    the owner use the meter: its dispatch-mode stack then, and what it counts after."""
    box: list[Any] = []
    opened, released = threading.Event(), threading.Event()
    stacks: list[Any] = []
    counted: list[int] = []

    def owner() -> None:
        box.append(m.window())
        opened.set()
        released.wait()
        start = m.used()  # meter code on the opening thread
        stacks.append(dispatch_mode_stack())
        kept = torch.empty(MiB, dtype=torch.uint8)
        counted.append(m.used() - start)
        del kept

    thread = threading.Thread(target=owner)
    thread.start()
    opened.wait()
    try:
        release(box)
    finally:
        released.set()
        thread.join()
    return stacks, counted


def never_closed(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "was never closed" in str(w.message)]


def test_a_window_closed_from_another_thread_leaves_the_owners_stack_as_it_was():
    m = TensorMeter("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        stacks, counted = run_owner(m, lambda box: box.pop().close())
        gc.collect()
    assert stacks == [[]]
    assert counted == [0]  # no window open: the owner is not watched any more
    assert never_closed(caught) == []


def test_a_window_dropped_in_another_thread_leaves_the_owners_stack_as_it_was(mode_meter):
    def drop(box: list[Any]) -> None:
        with pytest.warns(ResourceWarning, match="was never closed"):
            box.clear()
            gc.collect()

    stacks, counted = run_owner(mode_meter, drop)
    assert stacks == [[]]
    # The tensor meter stops counting; the CPU meter counts every live storage outside
    # windows, by walking them.
    assert counted == [0 if type(mode_meter) is TensorMeter else MiB]


class Still(SampledMeter):
    device = "still"

    def used(self) -> int:
        return 1024


@pytest.mark.parametrize("while_sampling", [False, True])
def test_a_sampled_meter_stops_sampling_when_its_window_is_dropped(while_sampling):
    """Also where the window dies while the meter's lock is held, as the sampling thread
    holds it at each sample: its release waits for the meter's next step, which the
    sampling thread takes (it sampled on for good, once in a loaded run)."""
    m = Still()
    w = m.window()
    (sampler,) = [t for t in threading.enumerate() if t.name == "torchmem-still"]
    held = m._lock if while_sampling else contextlib.nullcontext()
    with pytest.warns(ResourceWarning, match="was never closed"), held:
        del w
        gc.collect()
    sampler.join(timeout=JOIN_LIMIT_S)
    assert not sampler.is_alive()
    with m.window() as again:  # and the next window samples again
        assert again.peak() == 1024


def test_the_allocator_meters_dropped_window_warns(monkeypatch, isolated_meters):
    monkeypatch.setenv("TORCHMEM_CPU_METER", "allocator")
    m = meter("cpu")
    w = m.window()
    with pytest.warns(ResourceWarning, match=r"Window on CpuAllocatorMeter\('cpu'\)"):
        del w
        gc.collect()
    with m.window() as w:
        kept = torch.zeros(1024, 1024)
    assert w.peak() - w.start == 4 * MiB
    del kept


def test_a_closed_window_dropped_says_nothing():
    m = TensorMeter("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with m.window():
            pass
        w = m.window()
        w.close()
        del w
        gc.collect()
    assert never_closed(caught) == []


# cpu:0 is the CPU ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["allocator", "dispatch"])
@pytest.mark.parametrize("spelling", ["cpu:0", torch.device("cpu", 0)], ids=["str", "device"])
def test_cpu_0_measures_the_cpu_exactly(spelling, backend, monkeypatch, isolated_meters):
    monkeypatch.setenv("TORCHMEM_CPU_METER", backend)
    assert resolve_device(spelling) == torch.device("cpu")
    assert str(resolve_device(spelling)) == "cpu"
    m = meter(spelling)
    assert m is meter("cpu")
    gc.collect()
    with m.window() as w:
        kept = torch.zeros(1024, 1024)
    assert (w.peak() - w.start, m.used() - w.start) == (4_194_304, 4_194_304)
    del kept


@pytest.mark.parametrize("spelling", ["cpu:0", torch.device("cpu", 0)], ids=["str", "device"])
def test_a_tensor_meter_on_cpu_0_counts_cpu_tensors(spelling):
    m = TensorMeter(spelling)
    assert m.device == "cpu"
    with m.window() as w:
        kept = torch.zeros(1024, 1024)
    assert (w.peak(), m.used()) == (4_194_304, 4_194_304)
    del kept


@pytest.mark.parametrize(
    ("bad", "shown"),
    [("cpu:1", "'cpu:1'"), ("cpu:7", "'cpu:7'"), (torch.device("cpu", 1), "index=1")],
)
def test_another_cpu_index_is_refused_naming_it(bad, shown, isolated_meters):
    for make in (resolve_device, meter, TensorMeter):
        with pytest.raises(ValueError, match="no device") as info:
            make(bad)
        assert shown in str(info.value)
