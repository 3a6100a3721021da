"""The MPS and XPU meters' wiring, through stand-ins for the few backend calls they make."""

import pytest
import torch

from standins import MiB
from torchmem import meter
from torchmem.meters import AllocatorMeter, MpsMeter

pytestmark = pytest.mark.usefixtures("isolated_meters")


class XpuStandIn:
    """Stand-in for the ``torch.xpu`` calls the allocator meter makes: one device whose
    allocated bytes and peak move as `alloc` and `free` say."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.resets = []

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes):
        self.allocated -= nbytes

    def install(self, monkeypatch):
        """Install the calls on ``torch.xpu``."""
        calls = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "init": lambda: None,
            "memory_allocated": lambda device: self.allocated,
            "memory_reserved": lambda device: self.peak,
            "memory_stats_as_nested_dict": lambda device: {
                "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
            },
            "memory_stats": lambda device: {
                "allocated_bytes.all.current": self.allocated,
                "allocated_bytes.all.peak": self.peak,
            },
            "reset_peak_memory_stats": self.reset,
        }
        for name, call in calls.items():
            monkeypatch.setattr(torch.xpu, name, call, raising=False)

    def reset(self, device):
        self.resets.append(device)
        self.peak = self.allocated


def test_xpu_uses_the_allocator_meter_with_folded_peaks(monkeypatch):
    xpu = XpuStandIn()
    xpu.install(monkeypatch)
    m = meter("xpu")
    assert isinstance(m, AllocatorMeter)
    assert m.device == "xpu:0"
    assert m is meter("xpu:0")
    with m.window() as outer:
        xpu.alloc(8 * MiB)
        xpu.free(8 * MiB)
        with m.window() as inner:
            xpu.alloc(MiB)
            assert inner.peak() == MiB
        assert outer.peak() == 8 * MiB
    assert m.used() == MiB
    assert xpu.resets == [0, 0]


def test_mps_meter_reads_the_allocator_and_is_labelled_sampled(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 3 * MiB)
    m = meter("mps")
    assert isinstance(m, MpsMeter)
    assert m.used() == 3 * MiB
    assert not m.exact
    with m.window() as w:
        assert w.peak() == 3 * MiB
