"""Peak windows and meter selection, on the deterministic CPU tensor meter.

The tests about a machine without a GPU hide the GPUs themselves (:func:`standins.hide_gpus`),
so they test the same thing on every machine.
"""

import pytest
import torch

import torchmem
from standins import MiB
from torchmem import TensorMeter, TorchmemError, meter
from torchmem.meters import CpuAllocatorMeter, CpuDispatchMeter, RamMeter


def test_default_meter_without_a_gpu_is_the_cpu_allocator_meter(no_gpu):
    assert isinstance(meter(), CpuAllocatorMeter)
    assert meter().backend == "allocator"
    assert meter() is meter("cpu") is meter(torch.device("cpu"))
    assert meter().device == "cpu"
    assert meter().exact


def test_the_environment_chooses_the_dispatch_backend(isolated_meters, monkeypatch):
    monkeypatch.setenv("TORCHMEM_CPU_METER", "dispatch")
    assert isinstance(meter("cpu"), CpuDispatchMeter)
    assert isinstance(meter("cpu"), TensorMeter)
    assert meter("cpu").backend == "dispatch"
    monkeypatch.setenv("TORCHMEM_CPU_METER", "bogus")
    with torchmem.meters.isolated(), pytest.raises(ValueError, match="TORCHMEM_CPU_METER='bogus'"):
        meter("cpu")


def test_meter_by_device_string():
    assert meter("meta").device == "meta"
    assert isinstance(meter("ram"), RamMeter)
    assert meter("ram").device == "ram"


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        ("cuda", "'cuda'"),
        ("cuda:1", "'cuda:1'"),
        (1, "1"),
        ("gpu", "'gpu'"),
        ("", "''"),
        (-1, "-1"),
        (1.0, "1.0"),
        ([0], "[0]"),
        ("mps", "'mps'"),
        ("hpu", "'hpu'"),
    ],
)
def test_bad_or_missing_devices_raise_naming_the_value(no_gpu, bad, shown):
    with pytest.raises(ValueError) as info:
        meter(bad)
    assert shown in str(info.value)


def test_a_window_is_a_context_manager_and_closes_once():
    m = TensorMeter()
    window = m.window()
    assert not window.closed
    with window as same:
        assert same is window
    assert window.closed
    window.close()  # harmless twice
    assert "closed" in repr(window)


def test_a_closed_window_keeps_its_peak_and_cannot_restart():
    m = TensorMeter()
    with m.window() as w:
        a = torch.empty(MiB, dtype=torch.uint8)
    b = torch.empty(MiB, dtype=torch.uint8)
    assert w.peak() == MiB
    with pytest.raises(TorchmemError, match="closed"):
        w.restart()
    del a, b


def test_unknown_stat_is_named():
    with TensorMeter().window() as w, pytest.raises(ValueError, match="'nope'"):
        w.peak("nope")
    assert w.peak("allocated_bytes.all") == w.peak() == 0


def test_many_windows_open_at_once_are_each_exact():
    m = TensorMeter()
    windows, kept = [], []
    for i in range(5):
        windows.append(m.window())
        kept.append(torch.empty(MiB, dtype=torch.uint8))
        temp = torch.empty((i + 1) * MiB, dtype=torch.uint8)
        del temp
    # Window i opened with i MiB kept; the highest use after that was the last step's
    # 5 MiB kept plus its 5 MiB temporary.
    assert [w.start for w in windows] == [i * MiB for i in range(5)]
    assert [w.peak() for w in windows] == [10 * MiB] * 5
    for w in reversed(windows):
        w.close()
    assert torchmem._compat.dispatch_mode_stack() == []


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(None, "None"), (0, "0"), (-1, "-1"), ("x", "'x'"), ("cpu", "'cpu'"), (1.5, "1.5")],
)
def test_device_meter_without_a_gpu_or_with_a_bad_index_names_it(no_gpu, bad, shown):
    with pytest.raises(ValueError) as info:
        torchmem.device_meter(bad)
    assert shown in str(info.value)
