"""The CUDA allocator meter, wired to ``torch.cuda`` through :class:`CudaStandIn`.

The stand-in keeps exact current and peak counters per device, like PyTorch's caching
allocator, so every number here is known to the byte.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch

from standins import CudaStandIn, GiB, MiB, StandInGpu, gpu_uuid
from torchmem import TorchmemError, TorchmemWarning, meter
from torchmem.meters import AllocatorMeter, allocator

pytestmark = pytest.mark.usefixtures("isolated_meters")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    """Two 16 GiB GPUs; torch's current device is 0."""
    gpus = [StandInGpu(gpu_uuid(0), total=16 * GiB), StandInGpu(gpu_uuid(1), total=16 * GiB)]
    return CudaStandIn(gpus).install(monkeypatch)


# The stand-in counts like PyTorch's allocator ---------------------------------------------


def test_standin_reset_sets_every_peak_to_its_current_value(cuda: CudaStandIn) -> None:
    cuda.alloc(0, 4 * MiB)
    cuda.spike(0, 8 * MiB)
    assert torch.cuda.max_memory_allocated(0) == 12 * MiB
    torch.cuda.reset_peak_memory_stats(0)
    stats = torch.cuda.memory_stats(0)
    assert stats["allocated_bytes.all.peak"] == 4 * MiB
    assert stats["reserved_bytes.all.peak"] == 12 * MiB  # the freed 8 MiB stays cached
    for key, value in stats.items():
        if key.endswith(".peak"):
            assert value == stats[key.removesuffix(".peak") + ".current"], key


def test_standin_reserved_grows_with_allocations_and_shrinks_on_empty_cache(
    cuda: CudaStandIn,
) -> None:
    cuda.alloc(0, 4 * MiB)
    cuda.free(0, 4 * MiB)
    assert (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)) == (0, 4 * MiB)
    cuda.alloc(0, 3 * MiB)  # served from the cache
    assert (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)) == (3 * MiB, 4 * MiB)
    torch.cuda.empty_cache()
    assert (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)) == (3 * MiB, 3 * MiB)
    assert cuda.count("empty_cache") == 1


def test_standin_rounds_blocks_to_512_bytes_and_splits_pools(cuda: CudaStandIn) -> None:
    assert cuda.alloc(0, 100) == 512
    cuda.alloc(0, 2 * MiB)
    stats = torch.cuda.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == 2 * MiB + 512
    assert stats["requested_bytes.all.current"] == 2 * MiB + 100
    assert stats["allocated_bytes.small_pool.current"] == 512
    assert stats["allocated_bytes.large_pool.current"] == 2 * MiB
    assert stats["allocation.all.current"] == 2


# Which device ----------------------------------------------------------------------------


def test_meter_cuda_is_the_current_device(cuda: CudaStandIn) -> None:
    torch.cuda.set_device(1)
    m = meter("cuda")
    assert isinstance(m, AllocatorMeter)
    assert m.device == "cuda:1"
    assert m is meter("cuda:1")
    assert m is meter(1)
    assert m is meter(torch.device("cuda"))
    assert m is meter()  # None: the current CUDA device where CUDA is available
    assert m is not meter("cuda:0")
    assert cuda.count("init") == 2  # one per meter created, none for the cached ones


def test_cuda_1_and_cuda_0_are_separate(cuda: CudaStandIn) -> None:
    m0, m1 = meter("cuda:0"), meter("cuda:1")
    w0 = m0.window()
    cuda.spike(0, 3 * MiB)
    w1 = m1.window()  # resets device 1's peak only
    cuda.alloc(0, 2 * MiB)  # taken from device 0's cache
    cuda.spike(1, 7 * MiB)
    assert (m0.used(), m1.used()) == (2 * MiB, 0)
    assert (m0.reserved(), m1.reserved()) == (3 * MiB, 7 * MiB)
    assert (w0.peak(), w1.peak()) == (3 * MiB, 7 * MiB)
    w0.close()
    w1.close()


def test_meter_reads_and_resets_its_own_device_index(cuda: CudaStandIn) -> None:
    m1 = meter("cuda:1")  # the current device stays 0
    cuda.calls.clear()
    with m1.window() as window:
        cuda.spike(1, 2 * MiB)
        assert window.peak() == 2 * MiB
        m1.used()
        m1.reserved()
    assert cuda.devices("reset_peak_memory_stats") == [1]
    assert {device for _, device in cuda.calls} == {1}


@pytest.mark.parametrize(
    "device", ["cuda:5", "cuda:2", 5, torch.device("cuda", 2), -1, "cuda:-1", "gpu:0"]
)
def test_bad_devices_raise_value_error_naming_them(cuda: CudaStandIn, device: object) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(device))):
        meter(device)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["this machine", "every GPU hidden"])
def test_no_cuda_device_raises_value_error(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    if where == "every GPU hidden":
        CudaStandIn([]).install(monkeypatch)
    elif torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises(ValueError, match=rf"{re.escape(repr(device))} is not available"):
            meter(device)
    assert meter() is meter("cpu")  # None means CPU tensors where CUDA is not available


# used(), reserved() -----------------------------------------------------------------------


def test_used_is_memory_allocated_and_reserved_is_memory_reserved(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 3 * MiB)
    cuda.alloc(0, 1000)  # a 1,024-byte block
    assert m.used() == 3 * MiB + 1024
    assert m.reserved() == 3 * MiB + 1024
    cuda.free(0, 3 * MiB)
    assert m.used() == 1024
    assert m.reserved() == 3 * MiB + 1024
    torch.cuda.empty_cache()
    assert m.reserved() == 1024


# Windows ---------------------------------------------------------------------------------


def test_window_peak_is_the_exact_allocated_peak(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 1 * MiB)
    cuda.spike(0, 100 * MiB)  # before the window: not its peak
    with m.window() as window:
        assert window.start == 1 * MiB
        cuda.alloc(0, 4 * MiB)  # kept
        cuda.spike(0, 8 * MiB)  # a temporary
        assert m.used() - window.start == 4 * MiB
        assert window.peak() - window.start == 12 * MiB
        assert window.peak() == 13 * MiB
        assert window.peak("allocated_bytes.all") == 13 * MiB
    assert window.closed


def test_inner_window_sees_its_own_peak_and_outer_keeps_the_earlier_spike(
    cuda: CudaStandIn,
) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 2 * MiB)
    outer = m.window()
    cuda.spike(0, 12 * MiB)  # before the inner window opens
    inner = m.window()
    assert inner.start == 2 * MiB
    cuda.spike(0, 3 * MiB)
    assert inner.peak() == 5 * MiB
    assert outer.peak() == 14 * MiB
    inner.close()
    cuda.spike(0, 20 * MiB)  # after the inner window closed
    assert inner.peak() == 5 * MiB
    assert outer.peak() == 22 * MiB
    outer.close()
    assert outer.peak() == 22 * MiB


def test_a_spike_inside_the_inner_window_counts_for_the_outer_one(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    with m.window() as outer:
        cuda.spike(0, 4 * MiB)
        with m.window() as inner:
            cuda.spike(0, 30 * MiB)
        assert (inner.peak(), outer.peak()) == (30 * MiB, 30 * MiB)


def test_overlapping_windows_closed_out_of_order(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    first = m.window()
    cuda.spike(0, 6 * MiB)
    second = m.window()
    cuda.spike(0, 4 * MiB)
    first.close()
    cuda.spike(0, 10 * MiB)
    third = m.window()  # resets the counter again: second keeps its 10 MiB
    cuda.spike(0, 1 * MiB)
    assert first.peak() == 6 * MiB
    assert second.peak() == 10 * MiB
    assert third.peak() == 1 * MiB
    second.close()
    third.close()


def test_reserved_peak_is_folded_across_windows(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    with m.window() as outer:
        cuda.spike(0, 16 * MiB)
        torch.cuda.empty_cache()  # reserved back to 0
        with m.window() as inner:
            cuda.spike(0, 2 * MiB)
            assert inner.peak("reserved_bytes.all") == 2 * MiB
            assert outer.peak("reserved_bytes.all") == 16 * MiB
        assert m.reserved() == 2 * MiB  # the 2 MiB stay cached
    assert outer.peak("reserved_bytes.all") == 16 * MiB
    assert inner.peak("reserved_bytes.all") == 2 * MiB


def test_any_memory_stats_peak_is_a_stat(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    with m.window() as window:
        cuda.alloc(0, 1000)  # small pool, 1,024 bytes
        cuda.spike(0, 5 * MiB)  # large pool
    assert window.peak("active_bytes.large_pool") == 5 * MiB
    assert window.peak("allocated_bytes.small_pool") == 1024
    assert window.peak("requested_bytes.all") == 5 * MiB + 1000
    assert window.peak("allocation.all") == 2  # two blocks alive at once


@pytest.mark.parametrize("stat", ["bogus", "reserved_bytes.all.peak", "used"])
def test_unknown_stat_raises_value_error_naming_it(cuda: CudaStandIn, stat: str) -> None:
    window = meter("cuda:0").window()
    with pytest.raises(ValueError, match=rf"unknown stat {re.escape(repr(stat))}"):
        window.peak(stat)
    window.close()
    with pytest.raises(ValueError, match=rf"unknown stat {re.escape(repr(stat))}"):
        window.peak(stat)


def test_restart_starts_over_at_current_use_without_touching_other_windows(
    cuda: CudaStandIn,
) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 1 * MiB)
    outer = m.window()
    window = m.window()
    cuda.spike(0, 10 * MiB)
    cuda.alloc(0, 2 * MiB)
    window.restart()
    assert window.start == 3 * MiB
    assert window.peak() == 3 * MiB
    cuda.spike(0, 1 * MiB)
    assert window.peak() == 4 * MiB
    assert outer.peak() == 11 * MiB
    window.close()
    outer.close()


def test_close_freezes_the_peak(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    window = m.window()
    cuda.spike(0, 5 * MiB)
    window.close()
    cuda.spike(0, 50 * MiB)
    assert window.closed
    assert window.peak() == 5 * MiB
    assert window.peak("reserved_bytes.all") == 5 * MiB
    window.close()  # harmless
    assert window.peak() == 5 * MiB
    with pytest.raises(TorchmemError, match="closed"):
        window.restart()
    with m.window() as later:  # a new window does not inherit the closed one's peak
        assert later.peak() == 0


# Resets by other code ----------------------------------------------------------------------


def allocator_reset(cuda: CudaStandIn) -> object:
    """What ``torch._C._cuda_resetPeakMemoryStats`` is when torchmem intercepts nothing."""
    return cuda.allocator_reset_peaks


def intercepting() -> bool:
    """Whether torchmem's interceptor is ``torch._C._cuda_resetPeakMemoryStats`` now."""
    return getattr(torch._C._cuda_resetPeakMemoryStats, "__qualname__", "").startswith(
        "intercept_peak_resets"
    )


OTHER_RESETS = {
    "torch.cuda.reset_peak_memory_stats()": lambda: torch.cuda.reset_peak_memory_stats(),
    "torch.cuda.memory.reset_peak_memory_stats(0)": lambda: (
        torch.cuda.memory.reset_peak_memory_stats(0)
    ),
    "torch.cuda.reset_max_memory_allocated()": lambda: torch.cuda.reset_max_memory_allocated(),
    "torch.cuda.reset_max_memory_cached('cuda:0')": lambda: torch.cuda.reset_max_memory_cached(
        "cuda:0"
    ),
    "torch.cuda.memory.reset_peak_memory_stats(torch.device('cuda'))": lambda: (
        torch.cuda.memory.reset_peak_memory_stats(torch.device("cuda"))
    ),
}
"""Every public way to reset the peaks (PyTorch's own functions but the first, which is the
stand-in's), on device 0, the current one."""


@pytest.mark.parametrize("reset", OTHER_RESETS.values(), ids=OTHER_RESETS.keys())
@pytest.mark.filterwarnings("ignore:torch.cuda.reset_max_memory")  # PyTorch's own warning
@pytest.mark.filterwarnings("error::torchmem.TorchmemWarning")
def test_a_window_keeps_its_peak_across_a_reset_by_other_code(
    cuda: CudaStandIn, reset: Callable[[], None]
) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 1 * MiB)
    with m.window() as window:
        cuda.alloc(0, 4 * MiB)
        cuda.spike(0, 8 * MiB)
        assert window.peak() == 13 * MiB
        reset()  # as DeepSpeed's see_memory_usage does after each print
        assert torch.cuda.max_memory_allocated(0) == 5 * MiB  # the caller's view: reset
        assert window.peak() == 13 * MiB
        cuda.spike(0, 2 * MiB)
        assert torch.cuda.max_memory_allocated(0) == 7 * MiB
        assert window.peak() == 13 * MiB
    assert window.peak() == 13 * MiB
    assert not window.missed_reset  # seen, so nothing was missed


def test_nested_windows_both_stay_exact_across_resets_by_other_code(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 2 * MiB)
    with m.window() as outer:
        cuda.spike(0, 12 * MiB)
        torch.cuda.reset_peak_memory_stats()
        with m.window() as inner:
            cuda.spike(0, 3 * MiB)
            torch.cuda.reset_peak_memory_stats(0)
            cuda.spike(0, 1 * MiB)
            assert inner.peak() == 5 * MiB
            assert outer.peak() == 14 * MiB
            torch.cuda.reset_peak_memory_stats()
        cuda.spike(0, 4 * MiB)
        torch.cuda.reset_peak_memory_stats()
    assert (inner.peak(), outer.peak()) == (5 * MiB, 14 * MiB)
    assert torch.cuda.max_memory_allocated(0) == 2 * MiB


def test_a_reset_of_another_device_folds_only_that_device(cuda: CudaStandIn) -> None:
    m0, m1 = meter("cuda:0"), meter("cuda:1")
    with m0.window() as w0, m1.window() as w1:
        cuda.spike(0, 3 * MiB)
        cuda.spike(1, 5 * MiB)
        cuda.calls.clear()
        torch.cuda.reset_peak_memory_stats("cuda:1")
        assert cuda.devices("memory_stats_as_nested_dict") == [1]
        torch.cuda.set_device(1)
        torch.cuda.reset_peak_memory_stats()  # the current device: 1
        assert cuda.devices("memory_stats_as_nested_dict") == [1, 1]
        assert cuda.devices("reset_peak_memory_stats") == [1, 1]
        assert (w0.peak(), w1.peak()) == (3 * MiB, 5 * MiB)
        assert torch.cuda.max_memory_allocated(0) == 3 * MiB  # device 0 was not reset


def test_a_failure_of_ours_never_replaces_the_callers_reset(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")

    def broken() -> None:
        raise RuntimeError("the stats are gone")

    with m.window():
        cuda.spike(0, 6 * MiB)
        m._fold = broken  # type: ignore[method-assign]
        try:
            with pytest.warns(TorchmemWarning, match="the stats are gone"):
                torch.cuda.reset_peak_memory_stats(0)  # returns, as PyTorch's does
        finally:
            del m._fold
        assert torch.cuda.max_memory_allocated(0) == 0  # the caller's reset happened


def test_the_interceptor_is_there_only_while_a_window_is_open(cuda: CudaStandIn) -> None:
    m0, m1 = meter("cuda:0"), meter("cuda:1")
    assert torch._C._cuda_resetPeakMemoryStats == allocator_reset(cuda)
    first = m0.window()
    assert intercepting()
    second = m1.window()
    first.close()
    assert intercepting()  # a window is still open on another meter
    second.close()
    assert torch._C._cuda_resetPeakMemoryStats == allocator_reset(cuda)
    with pytest.raises(ZeroDivisionError), m0.window():
        assert intercepting()
        1 / 0  # noqa: B018
    assert torch._C._cuda_resetPeakMemoryStats == allocator_reset(cuda)
    with pytest.warns(ResourceWarning, match="never closed"):
        m1.window()  # dropped open at once
    assert torch._C._cuda_resetPeakMemoryStats == allocator_reset(cuda)


def test_a_function_put_there_after_the_interceptor_is_left_alone(
    cuda: CudaStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = meter("cuda:0")
    theirs_calls: list[object] = []
    with m.window() as window:
        ours = torch._C._cuda_resetPeakMemoryStats

        def theirs(device: object) -> None:
            theirs_calls.append(device)
            ours(device)

        monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", theirs)
    assert torch._C._cuda_resetPeakMemoryStats is theirs
    with m.window() as window:  # intercepts theirs, which still calls the first one
        assert theirs_calls == [0]  # the meter's own reset goes through theirs too
        cuda.spike(0, 6 * MiB)
        torch.cuda.reset_peak_memory_stats()
        assert window.peak() == 6 * MiB
        assert theirs_calls == [0, 0]
    assert torch._C._cuda_resetPeakMemoryStats is theirs
    torch.cuda.reset_peak_memory_stats()
    assert theirs_calls == [0, 0, 0]


def test_the_meter_s_own_resets_do_not_go_through_the_interceptor(
    cuda: CudaStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    folds: list[object] = []
    fold = allocator._fold_before_reset

    def counting(kind: str, device: object, reset: Callable[[object], object]) -> object:
        folds.append(device)
        return fold(kind, device, reset)

    monkeypatch.setattr(allocator, "_fold_before_reset", counting)
    m = meter("cuda:0")
    with m.window() as outer, m.window() as window:
        cuda.calls.clear()
        window.restart()
        assert cuda.count("reset_peak_memory_stats") == 1
        assert cuda.count("memory_stats_as_nested_dict") == 1  # one fold, not two
        window.lap()
        assert outer.peak() == 0
        assert folds == []
        torch.cuda.reset_peak_memory_stats()
        assert folds == [0]


def test_a_reset_that_cannot_be_intercepted_marks_the_open_windows(cuda: CudaStandIn) -> None:
    m = meter("cuda:0")
    with m.window() as outer:
        cuda.alloc(0, 4 * MiB)
        with m.window() as inner:
            cuda.spike(0, 8 * MiB)
            assert inner.peak() == 12 * MiB
            cuda.free(0, 4 * MiB)
            assert not inner.missed_reset
            cuda.allocator_reset_peaks(0)  # from C++: nothing in Python sees it
            with pytest.warns(TorchmemWarning, match=r"cuda:0 .* 2 open window"):
                assert inner.peak() == 12 * MiB  # what it read before, no more
            assert inner.missed_reset and outer.missed_reset
            cuda.spike(0, 2 * MiB)
            assert inner.peak() == 12 * MiB
            cuda.allocator_reset_peaks(0)  # seen at the next read, as 2 MiB fell to 0
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a warning once per window only
                inner.close()
        assert inner.peak() == 12 * MiB
        with m.window() as later:
            assert not later.missed_reset
    assert outer.missed_reset and outer.peak() == 12 * MiB
    assert torch.cuda.max_memory_allocated(0) == 0


def test_a_missed_reset_shows_at_the_next_lap_when_use_fell_below_its_start(
    cuda: CudaStandIn,
) -> None:
    m = meter("cuda:0")
    cuda.alloc(0, 4 * MiB)
    with m.window() as window:
        window.lap()  # the line profiler, at each line
        cuda.spike(0, 8 * MiB)  # never read
        cuda.free(0, 4 * MiB)
        cuda.allocator_reset_peaks(0)
        with pytest.warns(TorchmemWarning):
            assert window.lap()["allocated_bytes.all"] == 4 * MiB
        assert window.missed_reset
