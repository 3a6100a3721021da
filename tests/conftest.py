"""Fixtures shared by every test module. Sizes (``KiB``, ``MiB``, ``GiB``) and the
stand-ins for ``torch.cuda`` and NVML live in :mod:`standins`."""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

import torchmem.meters
from standins import CudaStandIn, hide_gpus

pytest_plugins = ("pytester", "lanes")  # the plugin's tests run pytest; the lanes (lanes.py)

# torch.compile's first use in an inductor cache folder compiles a probe for each vector
# instruction set the CPU lists (11 s here); the tests trust the list instead. Set before
# any test starts a process, so that those inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def pytest_configure(config: pytest.Config) -> None:
    """Python's Ctrl-C handler, where this process started with SIGINT ignored (a shell
    without job control starts background commands so), which its children would inherit:
    the tests that press Ctrl-C in a child need it to be heard there."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under ``coverage run``, a pytest-xdist worker (a subprocess coverage.py measures) saves
    what it measured here: at its exit would be too late, since a worker that is not gone 10 s
    after it was told to stop is killed, and its data with it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    try:
        from coverage import Coverage
    except ImportError:
        return
    measuring = Coverage.current()
    if measuring is not None:
        measuring.save()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a real GPU: skip them, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `counting` need the counting CPU allocator: skip them where it cannot be
    built. Asked here, when the first such test runs, never while collecting: making the CPU
    meter installs the allocator into this process."""
    if item.get_closest_marker("counting") is not None and not _counting():
        pytest.skip("needs the counting CPU allocator (a C++ compiler)")


@functools.cache
def _counting() -> bool:
    from torchmem.meters import meter

    return getattr(meter("cpu"), "backend", "") == "allocator"


@pytest.fixture(autouse=True)
def no_dispatch_mode_left_on() -> Iterator[None]:
    """Every test must leave PyTorch's dispatch-mode stack as it found it: empty."""
    from torchmem._compat import dispatch_mode_stack

    yield
    assert dispatch_mode_stack() == [], "a dispatch mode was left on"


@pytest.fixture(autouse=True)
def trace_functions_left_as_found() -> Iterator[None]:
    """Every test must leave the trace functions (coverage.py's, under ``coverage run``) as
    it found them: a test that clears them blinds coverage for every later test."""
    before = sys.gettrace(), threading.gettrace()
    yield
    assert (sys.gettrace(), threading.gettrace()) == before, "the trace functions changed"


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile's caches emptied before and after the test: a compiled graph keeps the
    fake tensors it was traced with alive, and a later test's tool that reads every live
    tensor's data (pytorch_memlab's reporter, in the benchmarks) fails on those."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    """This process sees no GPU for the test, whatever the machine has."""
    return hide_gpus(monkeypatch)


@pytest.fixture
def isolated_meters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh meter registry and NVML cache for the test (so the CPU tensor meter starts at
    0 bytes, and no stand-in leaks into the next test); `monkeypatch` is undone after it."""
    with torchmem.meters.isolated():
        yield


@pytest.fixture
def ipython() -> Iterator[InteractiveShell]:
    """A real IPython shell, cleared afterwards with its namespace, its output history and
    the last error it kept: what a test's cells made must not outlive the test (the shell
    stays reachable from IPython's hooks after ``clear_instance``)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    yield shell
    shell.reset(new_session=False)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    InteractiveShell.clear_instance()
    gc.collect()
