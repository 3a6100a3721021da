"""On a real CUDA GPU: exact bytes from a clean state (PyTorch's ``test_memory_stats`` way).

Every test here is marked ``cuda``; ``conftest.py`` skips them where
``torch.cuda.is_available()`` is false.

Sizes are chosen so that the caching allocator's rounding does not show: blocks are
multiples of 512 bytes, and from an empty cache a 1-10 MiB request gets a 20 MiB segment
that later requests are split from, so ``memory_allocated`` moves by exactly the bytes
asked for.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from collections.abc import Iterator

import pytest
import torch

import torchmem
from standins import MiB
from torchmem import (
    TensorMeter,
    b2mb,
    gpu_mem_allocate_mbs,
    gpu_mem_get,
    gpu_mem_get_free,
    gpu_mem_leave_free_mbs,
    meter,
    nvml_handle,
    preload_pytorch,
)
from torchmem.cli import main

pytestmark = pytest.mark.cuda

MOVING = 64 * MiB
"""How far free/used memory of the whole device may move between two readings taken a
moment apart: other processes and the driver allocate whenever they like."""


def clean() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    preload_pytorch()  # the CUDA context exists before anything is measured
    clean()
    yield
    clean()


@pytest.fixture
def without_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Read the device through ``torch.cuda.mem_get_info`` even where NVML is installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with torchmem.meters.isolated():
        yield


def empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


# The allocator meter -----------------------------------------------------------------------


def test_randn_256_is_1024_bytes() -> None:
    m = meter("cuda")
    assert m.device == f"cuda:{torch.cuda.current_device()}"
    with m.window() as window:
        x = torch.randn(256, device="cuda")
        assert m.used() - window.start == 1024
    assert window.peak() - window.start == 1024
    del x
    assert m.used() == window.start


def test_kept_4_mib_and_temporary_8_mib() -> None:
    m = meter("cuda")
    with m.window() as window:
        kept = empty(4 * MiB)
        temporary = empty(8 * MiB)
        del temporary
        torch.cuda.synchronize()
        assert m.used() - window.start == 4 * MiB
    assert window.peak() - window.start == 12 * MiB
    assert torch.cuda.max_memory_allocated() - window.start == 12 * MiB
    del kept


def test_nested_windows_are_each_exact() -> None:
    m = meter("cuda")
    with m.window() as outer:
        kept = empty(2 * MiB)
        temporary = empty(6 * MiB)
        del temporary
        with m.window() as inner:
            assert inner.start - outer.start == 2 * MiB
            temporary = empty(3 * MiB)
            del temporary
        assert inner.peak() - inner.start == 3 * MiB
        assert outer.peak() - outer.start == 8 * MiB
        temporary = empty(7 * MiB)
        del temporary
    assert inner.peak() - inner.start == 3 * MiB
    assert outer.peak() - outer.start == 9 * MiB
    del kept


def test_a_window_keeps_its_peak_across_a_reset_of_the_peak_stats() -> None:
    m = meter("cuda")
    pytorch_s = torch._C._cuda_resetPeakMemoryStats
    with m.window() as window:
        assert torch._C._cuda_resetPeakMemoryStats is not pytorch_s  # intercepted
        temporary = empty(64 * MiB)
        del temporary
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # as DeepSpeed's see_memory_usage does
        assert torch.cuda.max_memory_allocated() == m.used()  # the caller's view: reset
        assert window.peak() - window.start >= 64 * MiB
    assert window.peak() - window.start >= 64 * MiB
    assert not window.missed_reset
    assert torch._C._cuda_resetPeakMemoryStats is pytorch_s


def test_tensor_meter_on_cuda_counts_the_same_storage_bytes() -> None:
    allocator = meter("cuda")
    tensors = TensorMeter("cuda")
    with allocator.window() as by_allocator, tensors.window() as by_tensors:
        x = torch.randn(256, device="cuda")
        kept = empty(4 * MiB)
        temporary = empty(8 * MiB)
        del temporary
        assert tensors.used() - by_tensors.start == 4 * MiB + 1024
        assert allocator.used() - by_allocator.start == 4 * MiB + 1024
    assert by_tensors.peak() - by_tensors.start == 12 * MiB + 1024
    assert by_allocator.peak() - by_allocator.start == 12 * MiB + 1024
    del x, kept


# The seeds' device queries ---------------------------------------------------------------


def test_gpu_mem_get_from_mem_get_info_matches_the_device_properties(without_nvml: None) -> None:
    assert nvml_handle(0) is None
    total, free, used = gpu_mem_get(0)
    assert abs(total - b2mb(torch.cuda.get_device_properties(0).total_memory)) <= 1
    assert free > 0
    assert used > 0  # at least this process's CUDA context
    assert used + free <= total + 1


def test_gpu_mem_get_through_nvml_reads_the_device_torch_sees() -> None:
    pynvml = pytest.importorskip("pynvml")
    handle = nvml_handle(0)
    if handle is None:
        pytest.skip("pynvml is installed but NVML cannot be used here")
    # The handle is the device torch calls 0: same UUID, whatever CUDA_VISIBLE_DEVICES is.
    nvml_uuid = pynvml.nvmlDeviceGetUUID(handle)
    nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
    torch_uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert re.sub("^(GPU|MIG)-", "", nvml_uuid).lower() == torch_uuid.lower()
    total, free, used = gpu_mem_get(0)
    # NVML counts memory the driver keeps for itself in its total; CUDA does not.
    assert total >= b2mb(torch.cuda.get_device_properties(0).total_memory) - 1
    assert used + free <= total + 1
    assert total == b2mb(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


def test_device_meter_agrees_with_mem_get_info(without_nvml: None) -> None:
    device = torchmem.device_meter(0)
    assert device.exact is False
    total, free, used = device.info()
    cuda_free, cuda_total = torch.cuda.mem_get_info(0)
    assert total == cuda_total  # fixed
    assert used == total - free  # one reading
    # Free memory moves between the two readings only if another process allocates.
    assert abs(free - cuda_free) <= MOVING

    # 256 MiB more in this process: a fresh 256 MiB segment from an empty cache.
    before = device.used()
    block = empty(256 * MiB)
    grown = device.used() - before
    assert 256 * MiB <= grown <= 256 * MiB + MOVING
    del block


def test_device_meter_window_samples_the_rise(without_nvml: None) -> None:
    # Assumes no other process frees GPU memory during the test.
    device = torchmem.device_meter(0)
    with device.window() as window:
        block = empty(256 * MiB)
        target = device.samples + 2
        deadline = time.monotonic() + 10
        while device.samples < target:
            assert time.monotonic() < deadline, "the device meter took no sample in 10 s"
            time.sleep(device.interval)
        del block
        torch.cuda.empty_cache()
    assert window.peak() - window.start >= 256 * MiB


def test_gpu_mem_allocate_mbs_allocates_exactly() -> None:
    before = torch.cuda.memory_allocated()
    tensor = gpu_mem_allocate_mbs(64)
    assert tensor is not None
    assert tensor.is_cuda
    assert tensor.device.index == torch.cuda.current_device()
    assert (tensor.dtype, tensor.numel()) == (torch.uint8, 64 * MiB)
    assert torch.cuda.memory_allocated() - before == 64 * MiB
    del tensor
    assert torch.cuda.memory_allocated() == before


def test_gpu_mem_allocate_mbs_too_much() -> None:
    too_much = 10_000_000  # about 9.5 TiB
    assert gpu_mem_allocate_mbs(too_much) is None
    with pytest.raises(torch.OutOfMemoryError) as caught:
        gpu_mem_allocate_mbs(too_much, fatal=True)
    device = torch.cuda.current_device()
    assert re.fullmatch(
        rf"could not allocate {too_much} MB on cuda:{device}: \d+ MB free", str(caught.value)
    )


def test_gpu_mem_leave_free_mbs_consumes_the_rest() -> None:
    before = torch.cuda.memory_allocated()
    keep_free = gpu_mem_get_free() - 100  # so that about 100 MB get allocated
    buffer = gpu_mem_leave_free_mbs(keep_free)
    assert buffer is not None
    assert buffer.numel() % MiB == 0
    assert abs(buffer.numel() - 100 * MiB) <= MOVING  # free memory may move meanwhile
    assert torch.cuda.memory_allocated() - before == buffer.numel()
    del buffer


# The devices report -------------------------------------------------------------------------


def test_cli_devices_prints_a_row_for_gpu_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["GPU", "Name", "Total", "Used", "Free", "Allocated", "Reserved"]
    assert lines[1].startswith(f"  0  {torch.cuda.get_device_name(0)}  ")


def test_cli_devices_json_has_gpu_0(capsys: pytest.CaptureFixture[str]) -> None:
    kept = empty(4 * MiB)
    assert main(["devices", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpus"][0]
    assert gpu["index"] == 0
    assert gpu["name"] == torch.cuda.get_device_name(0)
    assert gpu["allocated"] == torch.cuda.memory_allocated(0)
    assert gpu["reserved"] == torch.cuda.memory_reserved(0)
    assert gpu["used"] + gpu["free"] <= gpu["total"]
    del kept


# The line profiler on the real allocator -----------------------------------------------


def gpu_lines():
    a = torch.zeros(1024, 1024, device="cuda")
    b = (torch.zeros(2048, 1024, device="cuda") + 1).sum()
    return a, b


def test_line_profiler_on_a_real_gpu_is_exact():
    clean()
    base = torch.cuda.memory_allocated()
    with torchmem.LineProfiler(gpu_lines) as prof:
        gpu_lines()
    assert prof.meter.device == f"cuda:{torch.cuda.current_device()}"
    (record,) = prof.records()
    first, second = (line.stats for line in record.lines[1:3])
    assert first["active_bytes.all.peak"] == base + 4 * MiB
    assert first["allocated_bytes.all.delta"] == 4 * MiB
    assert second["allocated_bytes.all.peak"] == base + 4 * MiB + 16 * MiB
    assert second["allocated_bytes.all.delta"] == 512  # the sum, in one 512-byte block
    assert second["allocation.all.allocated"] >= 3  # and the reduction's own workspace
    assert second["reserved_bytes.all.peak"] >= second["allocated_bytes.all.peak"]
    text = str(prof.display())
    assert "active_bytes reserved_bytes hits line code" in text
    assert 'b = (torch.zeros(2048, 1024, device="cuda") + 1).sum()' in text


# The memory reporter on the real allocator ---------------------------------------------


def test_reporter_on_a_real_gpu_rounds_to_blocks_and_compares_with_the_allocator():
    clean()
    linear = torch.nn.Linear(1024, 1024).cuda()
    scanned = [torch.randn(3, device="cuda")]  # 12 bytes: one 512-byte block
    device = f"cuda:{torch.cuda.current_device()}"
    report = torchmem.MemReporter(linear, objects=scanned.copy).display(device=device)
    assert [(r.name, r.nbytes) for r in report.records] == [
        ("weight", 4 * MiB),
        ("bias", 4096),
        ("Tensor0", 512),
    ]
    assert report.allocated == {device: torch.cuda.memory_allocated(device)}
    text = str(report)
    assert f"Storage on {device}\n" in text
    assert f"The allocated memory on {device}: " in text
    del linear, scanned, report


# Courtesy -----------------------------------------------------------------------------------


def test_courtesy_moves_a_model_off_the_gpu_and_back() -> None:
    allocated_before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    loaded = torch.cuda.memory_allocated()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if v.is_cuda]
    tensors = [*params, *(p.grad for p in params), *state]
    values = [t.detach().cpu() for t in tensors]
    weight = model[0].weight
    device = torch.device("cuda", torch.cuda.current_device())

    with torchmem.Courtesy(model, optimizer) as courtesy:
        assert torch.cuda.memory_allocated() == allocated_before
        assert torch.cuda.memory_reserved() == reserved_before, "the cache was emptied"
        assert all(t.device == torch.device("cpu") for t in tensors)
    assert torch.cuda.memory_allocated() == loaded
    assert all(t.device == device for t in tensors)
    assert all(torch.equal(t.cpu(), v) for t, v in zip(tensors, values, strict=True))
    assert model[0].weight is weight and optimizer.state[weight]["exp_avg"] is state[0]
    assert courtesy.restore() == 0
    optimizer.zero_grad()
    model(torch.randn(8, 256, device="cuda")).sum().backward()  # still trains on the GPU
    optimizer.step()


def test_courtesy_without_arguments_moves_every_cuda_tensor() -> None:
    kept = torch.randn(256, device="cuda")
    view = kept[128:]
    values = kept.cpu()
    loaded = torch.cuda.memory_allocated()
    with torchmem.Courtesy():
        assert kept.device == view.device == torch.device("cpu")
        assert torch.cuda.memory_allocated() <= loaded - 1024
    assert kept.is_cuda and view.data_ptr() == kept.data_ptr() + 512
    assert torch.equal(kept.cpu(), values)
    assert torch.cuda.memory_allocated() == loaded
