"""The process RAM meter: exact peaks through the kernel's high-water mark."""

import sys
import threading

import pytest

from torchmem import meter
from torchmem.meters import ram
from torchmem.meters.ram import RamMeter

MiB = 2**20
SPIKE = 300 * MiB
# Linux counts RSS in per-CPU batches (percpu_counter), so RSS and VmHWM can lag the
# true page count by a few hundred KiB. A missed spike is off by all 300 MiB.
KERNEL_SLACK = MiB

linux_only = pytest.mark.skipif(
    sys.platform != "linux" or not ram._clear_refs(), reason="needs Linux's writable clear_refs"
)


def spike(nbytes: int) -> int:
    """Allocate, touch and free `nbytes` inside one call that holds the GIL throughout.

    The bytes object is filled by memset in C and freed as soon as len() returns,
    before the interpreter checks whether another thread wants the GIL: no Python
    thread can run while it exists.
    """
    return len(b"\x01" * nbytes)


def test_ram_is_one_shared_meter():
    assert meter("ram") is meter("ram")
    assert isinstance(meter("ram"), RamMeter)
    assert meter("ram").used() > 0


@linux_only
def test_gil_held_spike_is_caught_exactly():
    m = meter("ram")
    assert m.exact
    with m.window() as w:
        spike(SPIKE)
        assert SPIKE - KERNEL_SLACK <= w.peak() - w.start < SPIKE + 16 * MiB


@linux_only
def test_nested_windows_each_see_their_own_peak():
    m = meter("ram")
    with m.window() as outer:
        spike(SPIKE)
        with m.window() as inner:  # resets the kernel's counter: the outer one must keep its peak
            assert inner.peak() - inner.start < SPIKE
        assert outer.peak() - outer.start >= SPIKE - KERNEL_SLACK
        with m.window() as later:
            spike(SPIKE // 2)
            assert SPIKE // 2 - KERNEL_SLACK <= later.peak() - later.start < SPIKE
        assert outer.peak() - outer.start >= SPIKE - KERNEL_SLACK


@pytest.fixture
def sampled(monkeypatch, tmp_path):
    """A RAM meter whose clear_refs write is refused, as in some containers."""
    monkeypatch.setattr(ram, "CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    m = RamMeter()
    m.interval = 0.005
    return m


def _samplers():
    return [t for t in threading.enumerate() if t.name == "torchmem-ram"]


def test_refused_clear_refs_falls_back_to_a_labelled_sampler(sampled):
    assert not sampled.exact
    assert _samplers() == []
    with sampled.window():
        with sampled.window():
            assert len(_samplers()) == 1
        assert len(_samplers()) == 1
    assert _samplers() == []


def test_the_sampler_catches_a_slow_spike(sampled):
    with sampled.window() as w:
        buffer = b"\x01" * SPIKE
        seen = sampled.samples
        while sampled.samples < seen + 2:  # two samples while the buffer is alive
            threading.Event().wait(0.001)
        del buffer
        assert w.peak() - w.start >= SPIKE - KERNEL_SLACK


def test_the_sampler_misses_a_gil_held_spike(sampled):
    """Why sampled peaks are labelled approximate: no sampling thread can see this one."""
    with sampled.window() as w:
        spike(SPIKE)
        assert w.peak() - w.start < SPIKE // 2


def test_the_sampler_sleeps_between_samples(sampled):
    sampled.interval = 0.05
    with sampled.window():
        threading.Event().wait(0.25)
    # A busy loop would take tens of thousands of samples in that time.
    assert sampled.samples <= 50
