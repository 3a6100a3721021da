"""The seeds' device queries and allocation helpers (``torchmem.devices``), the ``devices``
report and ``torchmem devices``.

Without a GPU they answer zeros; with :class:`CudaStandIn` and :class:`NvmlStandIn` they
read the right NVML device for each torch index, in whole MB.
"""

from __future__ import annotations

import json
import re
import time
import types
from collections.abc import Callable

import numpy as np
import psutil
import pytest
import torch

import torchmem
import torchmem.devices
from standins import (
    CudaStandIn,
    GiB,
    MiB,
    NvmlStandIn,
    StandInGpu,
    StandInNvmlHandle,
    StandIns,
    gpu_uuid,
    install_gpus,
)
from torchmem import (
    GPUMemory,
    TorchmemError,
    b2mb,
    gpu_mem_allocate_mbs,
    gpu_mem_get,
    gpu_mem_get_all,
    gpu_mem_get_free,
    gpu_mem_get_free_no_cache,
    gpu_mem_get_total_mbs,
    gpu_mem_get_used,
    gpu_mem_get_used_fast,
    gpu_mem_get_used_no_cache,
    gpu_mem_leave_free_mbs,
    gpu_with_max_free_mem,
    nvml_handle,
    preload_pytorch,
)
from torchmem.cli import main
from torchmem.devices import GPUInfo, RAMInfo
from torchmem.records.devices import CPUInfo
from torchmem.render.devices import text as devices_text

# Every whole-MB query of one GPU, fastai's names and ipyexperiments' `_mbs` names.
MB_QUERIES = {
    "gpu_mem_get_total_mbs": "total",
    "gpu_mem_get_free": "free",
    "gpu_mem_get_free_mbs": "free",
    "gpu_mem_get_free_no_cache": "free",
    "gpu_mem_get_free_no_cache_mbs": "free",
    "gpu_mem_get_used": "used",
    "gpu_mem_get_used_mbs": "used",
    "gpu_mem_get_used_no_cache": "used",
    "gpu_mem_get_used_no_cache_mbs": "used",
}
BAD_SIZES = [-1, 1.5, True, "10", None]
ODD = 123_456
"""Bytes that make a figure fall between two whole MB, so truncation shows."""


pytestmark = pytest.mark.usefixtures("isolated_meters")


def mb(gpu: StandInGpu) -> GPUMemory:
    """What the seeds report for `gpu`: NVML's bytes in whole MB, truncated."""
    return GPUMemory(gpu.total // MiB, gpu.free // MiB, gpu.used // MiB)


def rig() -> list[StandInGpu]:
    """Four different GPUs in PCI order, each with its own UUID and memory figures."""
    return [
        StandInGpu(gpu_uuid(0), "Tesla T4", 15 * GiB, 1_000 * MiB + ODD, speed=1),
        StandInGpu(gpu_uuid(1), "NVIDIA A100-SXM4-80GB", 80 * GiB, 2_000 * MiB + ODD, speed=3),
        StandInGpu(gpu_uuid(2), "Tesla V100-SXM2-32GB", 32 * GiB, 3_000 * MiB + ODD, speed=2),
        StandInGpu(gpu_uuid(3), "Tesla T4", 15 * GiB, 4_000 * MiB + ODD, speed=1),
    ]


def wait_for_samples(meter: torchmem.meters.SampledMeter, count: int) -> None:
    """Wait, at most ten seconds, until `meter`'s thread has taken `count` more samples."""
    target = meter.samples + count
    deadline = time.monotonic() + 10
    while meter.samples < target:
        if time.monotonic() > deadline:
            pytest.fail(f"{meter!r} took no sample in 10 s")
        time.sleep(meter.interval)


# No GPU ----------------------------------------------------------------------------------


@pytest.fixture(params=["this machine", "CUDA_VISIBLE_DEVICES=''"])
def no_visible_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU visible to torch: this machine where it has none, and a CUDA machine whose
    GPUs are all hidden (NVML still lists them)."""
    if request.param == "this machine":
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    else:
        install_gpus(monkeypatch, rig(), visible_devices="")


def test_gpu_mem_get_is_zeros(no_visible_gpu: None) -> None:
    assert GPUMemory._fields == ("total", "free", "used")
    assert gpu_mem_get() == GPUMemory(0, 0, 0)
    assert gpu_mem_get(0) == GPUMemory(0, 0, 0)
    assert gpu_mem_get(99) == GPUMemory(0, 0, 0)
    assert gpu_mem_get_all() == []


@pytest.mark.parametrize("name", MB_QUERIES)
def test_mb_queries_are_zero(no_visible_gpu: None, name: str) -> None:
    query = getattr(torchmem, name)
    assert query() == 0
    assert query(0) == 0


def test_the_mbs_names_are_the_fastai_functions() -> None:
    assert torchmem.gpu_mem_get_free_mbs is gpu_mem_get_free
    assert torchmem.gpu_mem_get_free_no_cache_mbs is gpu_mem_get_free_no_cache
    assert torchmem.gpu_mem_get_used_mbs is gpu_mem_get_used
    assert torchmem.gpu_mem_get_used_no_cache_mbs is gpu_mem_get_used_no_cache


def test_other_queries_without_a_gpu(no_visible_gpu: None) -> None:
    assert gpu_mem_get_used_fast(None) == 0
    assert gpu_with_max_free_mem() == (None, 0)
    assert nvml_handle() is None
    assert nvml_handle(0) is None
    assert preload_pytorch() is None
    assert preload_pytorch(0) is None


def test_allocation_helpers_without_a_gpu(no_visible_gpu: None) -> None:
    assert gpu_mem_allocate_mbs(10) is None
    with pytest.raises(TorchmemError, match="cannot allocate 10 MB: no CUDA GPU"):
        gpu_mem_allocate_mbs(10, fatal=True)
    assert gpu_mem_leave_free_mbs(10) is None


@pytest.mark.parametrize("size", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("helper", [gpu_mem_allocate_mbs, gpu_mem_leave_free_mbs])
def test_bad_sizes_raise_value_error_naming_them(
    no_visible_gpu: None, helper: Callable[[int], object], size: object
) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(size))):
        helper(size)  # type: ignore[arg-type]


def test_b2mb_truncates_toward_zero() -> None:
    assert b2mb(0) == 0
    assert b2mb(2**20 - 1) == 0
    assert b2mb(2**20) == 1
    assert b2mb(1.5 * 2**20) == 1
    assert b2mb(-1.5 * 2**20) == -1


# Reading the right GPU -------------------------------------------------------------------

# visible_devices, device_order, the PCI index of each device torch sees, in torch's order.
SCENARIOS = {
    "all, PCI order": (None, "PCI_BUS_ID", [0, 1, 2, 3]),
    "devices 0 and 2 hidden": ("1,3", "PCI_BUS_ID", [1, 3]),
    "reordered 2,0": ("2,0", "PCI_BUS_ID", [2, 0]),
    "one GPU by UUID": (gpu_uuid(3), "PCI_BUS_ID", [3]),
    "UUIDs, reordered": (f"{gpu_uuid(2)},{gpu_uuid(1)}", "PCI_BUS_ID", [2, 1]),
    "FASTEST_FIRST": (None, "FASTEST_FIRST", [1, 2, 0, 3]),
    "FASTEST_FIRST, then 3,0": ("3,0", "FASTEST_FIRST", [3, 1]),
}


@pytest.fixture(params=list(SCENARIOS))
def scenario(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[StandIns, list[StandInGpu]]:
    """Stand-ins for one scenario, and the physical device behind each torch index."""
    visible_devices, device_order, physical = SCENARIOS[request.param]
    gpus = rig()
    standins = install_gpus(monkeypatch, gpus, visible_devices, device_order)
    return standins, [gpus[i] for i in physical]


def test_the_rig_tells_devices_apart() -> None:
    # Otherwise reading the wrong device could give the right answer.
    figures = [mb(gpu) for gpu in rig()]
    assert len({memory.free for memory in figures}) == 4
    assert len({memory.used for memory in figures}) == 4


def test_whole_mb_of_nvml_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = StandInGpu(gpu_uuid(0), total=16 * GiB, used_elsewhere=1_000 * MiB + ODD)
    install_gpus(monkeypatch, [gpu])
    # free is 15,384 MiB less 123,456 bytes: 15,383 whole MB.
    assert gpu_mem_get() == GPUMemory(16_384, 15_383, 1_000)
    assert gpu_mem_get_total_mbs() == 16_384
    assert gpu_mem_get_free() == 15_383
    assert gpu_mem_get_used() == 1_000
    assert all(type(value) is int for value in gpu_mem_get())


def test_gpu_mem_get_reads_the_device_torch_sees(
    scenario: tuple[StandIns, list[StandInGpu]],
) -> None:
    _, seen = scenario
    for index, gpu in enumerate(seen):
        assert gpu_mem_get(index) == mb(gpu), index
        for name, field in MB_QUERIES.items():
            assert getattr(torchmem, name)(index) == getattr(mb(gpu), field), (index, name)


def test_numpy_ids_work_like_ints(scenario: tuple[StandIns, list[StandInGpu]]) -> None:
    _, seen = scenario
    assert gpu_mem_get(np.int64(len(seen) - 1)) == mb(seen[-1])


def test_gpu_mem_get_all_lists_visible_devices_in_torch_order(
    scenario: tuple[StandIns, list[StandInGpu]],
) -> None:
    _, seen = scenario
    assert gpu_mem_get_all() == [mb(gpu) for gpu in seen]


def test_default_is_the_current_device(scenario: tuple[StandIns, list[StandInGpu]]) -> None:
    _, seen = scenario
    torch.cuda.set_device(len(seen) - 1)
    assert gpu_mem_get() == mb(seen[-1])
    assert gpu_mem_get_free() == mb(seen[-1]).free


def test_nvml_handle_is_the_device_torch_sees(
    scenario: tuple[StandIns, list[StandInGpu]],
) -> None:
    standins, seen = scenario
    for index, gpu in enumerate(seen):
        handle = nvml_handle(index)
        assert handle is standins.nvml.handle_of(gpu)
        assert gpu_mem_get_used_fast(handle) == gpu.used // MiB


def test_device_meter_reads_bytes_of_the_device_torch_sees(
    scenario: tuple[StandIns, list[StandInGpu]],
) -> None:
    standins, seen = scenario
    standins.cuda.alloc(0, 5 * MiB)  # shows in NVML's used of the device behind index 0
    for index, gpu in enumerate(seen):
        meter = torchmem.device_meter(index)
        assert meter.device == f"cuda:{index}"
        assert meter.info() == (gpu.total, gpu.free, gpu.used)
        assert meter.used() == gpu.used
    assert seen[0].used == seen[0].used_elsewhere + 5 * MiB


def test_uuids_as_bytes_from_old_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = rig()
    install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID", uuid_bytes=True)
    assert gpu_mem_get_all() == [mb(gpus[2]), mb(gpus[0])]


def test_mig_instance_reads_the_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    first = StandInGpu(gpu_uuid(100, "MIG"), "NVIDIA A100 MIG 1g.10gb", 9_856 * MiB, 11 * MiB)
    second = StandInGpu(gpu_uuid(101, "MIG"), "NVIDIA A100 MIG 3g.40gb", 39_936 * MiB, ODD)
    gpus = [
        StandInGpu(gpu_uuid(0), "Tesla T4", 15 * GiB, 1_000 * MiB),  # no MIG support
        StandInGpu(gpu_uuid(1), total=80 * GiB, used_elsewhere=13 * MiB, mig_mode=0),
        StandInGpu(
            gpu_uuid(2),
            total=80 * GiB,
            used_elsewhere=7 * GiB,
            mig_mode=1,
            mig_slots=[first, None, second, None, None, None, None],
        ),
    ]
    install_gpus(monkeypatch, gpus, gpu_uuid(101, "MIG"), "PCI_BUS_ID")
    assert gpu_mem_get(0) == GPUMemory(39_936, 39_935, 0)
    assert gpu_mem_get_all() == [GPUMemory(39_936, 39_935, 0)]


def test_a_device_nvml_does_not_list_falls_back_to_mem_get_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = rig()
    cuda = CudaStandIn(gpus, "3,1", "PCI_BUS_ID").install(monkeypatch)
    nvml = NvmlStandIn(gpus[:3], calls=cuda.calls).install(monkeypatch)  # no device 3
    assert nvml_handle(0) is None
    assert nvml_handle(1) is nvml.handle_of(gpus[1])
    cuda.calls.clear()
    assert gpu_mem_get_all() == [mb(gpus[3]), mb(gpus[1])]
    assert cuda.devices("mem_get_info") == [0]


@pytest.mark.parametrize("nvml", ["missing", "broken"])
def test_without_nvml_memory_comes_from_mem_get_info(
    monkeypatch: pytest.MonkeyPatch, nvml: str
) -> None:
    gpus = rig()
    standins = install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID", nvml=nvml)
    standins.cuda.alloc(1, 3 * MiB)
    assert gpu_mem_get_all() == [mb(gpus[2]), mb(gpus[0])]
    assert gpu_mem_get(1).used == 1_003  # 1,000 MB elsewhere, 3 MiB here, 123,456 bytes
    assert torchmem.device_meter(1).info() == (gpus[0].total, gpus[0].free, gpus[0].used)
    assert set(standins.cuda.devices("mem_get_info")) == {0, 1}
    assert nvml_handle(0) is None
    assert torchmem.device_meter(0).nvml_handle is None
    assert gpu_mem_get_used_fast(nvml_handle(0)) == 0
    # NVML is tried once, not on every query.
    assert standins.cuda.count("nvml.nvmlInit") == (1 if nvml == "broken" else 0)


@pytest.mark.parametrize("bad", ["x", 0, 1.0, True, np.int64(0), b"GPU-0"])
@pytest.mark.parametrize("nvml", ["present", "missing"])
def test_used_fast_names_a_value_that_is_not_a_handle(
    monkeypatch: pytest.MonkeyPatch, nvml: str, bad: object
) -> None:
    install_gpus(monkeypatch, rig(), nvml=nvml)
    with pytest.raises(TypeError) as info:
        gpu_mem_get_used_fast(bad)
    assert f"not {bad!r} ({type(bad).__name__})" in str(info.value)
    assert ("NVML is not available here" in str(info.value)) is (nvml == "missing")


def test_used_fast_takes_only_pynvmls_handle_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """pynvml's handles are ctypes pointers (``c_nvmlDevice_t``); NVML would read any
    other object as one."""
    monkeypatch.setattr(NvmlStandIn, "c_nvmlDevice_t", StandInNvmlHandle, raising=False)
    install_gpus(monkeypatch, rig())
    handle = nvml_handle(0)
    assert isinstance(handle, StandInNvmlHandle)
    assert gpu_mem_get_used_fast(handle) == handle.gpu.used // MiB
    with pytest.raises(TypeError, match="gpu_handle must be an NVML device handle"):
        gpu_mem_get_used_fast(object())


@pytest.mark.parametrize("bad", [2, 4, 5, -1, "0", True, 1.0])
def test_an_invalid_id_gives_zeros(monkeypatch: pytest.MonkeyPatch, bad: object) -> None:
    # NVML has devices 2 and 3, but torch sees only two devices: 0 and 1.
    install_gpus(monkeypatch, rig(), "2,0", "PCI_BUS_ID")
    assert gpu_mem_get(bad) == GPUMemory(0, 0, 0)  # type: ignore[arg-type]
    for name in MB_QUERIES:
        assert getattr(torchmem, name)(bad) == 0, name
    assert nvml_handle(bad) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2, 5, -1, "0", True])
def test_device_meter_rejects_an_invalid_index_naming_it(
    monkeypatch: pytest.MonkeyPatch, bad: object
) -> None:
    install_gpus(monkeypatch, rig(), "2,0", "PCI_BUS_ID")
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        torchmem.device_meter(bad)  # type: ignore[arg-type]


def test_gpu_with_max_free_mem_picks_the_first_with_most_free_mb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = [
        StandInGpu(gpu_uuid(0), total=40 * GiB, used_elsewhere=30 * GiB),
        StandInGpu(gpu_uuid(1), total=40 * GiB, used_elsewhere=20 * GiB),
        StandInGpu(gpu_uuid(2), total=40 * GiB, used_elsewhere=10 * GiB + 5_000),
        StandInGpu(gpu_uuid(3), total=40 * GiB, used_elsewhere=10 * GiB + 100),
    ]
    # torch 0 is PCI 3 and torch 2 is PCI 2: the same free MB, a few bytes apart.
    install_gpus(monkeypatch, gpus, "3,0,2", "PCI_BUS_ID")
    best = gpu_with_max_free_mem()
    assert best == (0, 30 * 1024 - 1)
    assert [type(value) for value in best] == [int, int]


def test_the_no_cache_queries_collect_and_empty_the_cache_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = rig()
    standins = install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID")
    cuda = standins.cuda
    collect = types.SimpleNamespace(collect=lambda: cuda.calls.append(("gc.collect", None)))
    monkeypatch.setattr(torchmem.devices, "gc", collect)
    cuda.alloc(0, 64 * MiB)
    cuda.free(0, 64 * MiB)  # cached: still used, as NVML sees it

    assert gpu_mem_get_used(0) == 3_064
    assert gpu_mem_get_free(0) == 29_703
    assert cuda.count("empty_cache") == cuda.count("gc.collect") == 0

    for query, expected in [
        (gpu_mem_get_used_no_cache, 3_000),
        (gpu_mem_get_free_no_cache, 29_767),
    ]:
        cuda.alloc(0, 64 * MiB)
        cuda.free(0, 64 * MiB)
        cuda.calls.clear()
        assert query(0) == expected
        names = [name for name, _ in cuda.calls]
        assert names.count("gc.collect") == names.count("empty_cache") == 1
        assert (
            names.index("gc.collect")
            < names.index("empty_cache")
            < names.index("nvml.nvmlDeviceGetMemoryInfo")
        )


# Allocation helpers ----------------------------------------------------------------------


@pytest.fixture
def t4(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    """Torch sees a T4 with 15,383 MB free (PCI 2) and an A100 (PCI 0); ``torch.empty`` and
    ``torch.ones`` allocate through the stand-in."""
    gpus = [
        StandInGpu(gpu_uuid(0), total=80 * GiB),
        StandInGpu(gpu_uuid(1), total=40 * GiB),
        StandInGpu(gpu_uuid(2), "Tesla T4", 16 * GiB, 1_000 * MiB + ODD),
    ]
    cuda = install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID").cuda
    monkeypatch.setattr(torch, "empty", cuda.tensor_factory(torch.empty))
    monkeypatch.setattr(torch, "ones", cuda.tensor_factory(torch.ones))
    return cuda


def test_gpu_mem_allocate_mbs_allocates_directly_on_the_device(t4: CudaStandIn) -> None:
    tensor = gpu_mem_allocate_mbs(64)
    assert t4.factory_calls == [{"size": (64 * MiB,), "dtype": torch.uint8, "device": "cuda"}]
    assert t4.devices("torch.empty") == [0]
    assert tensor is not None
    assert (tensor.shape, tensor.dtype) == ((64 * MiB,), torch.uint8)
    assert torch.cuda.memory_allocated(0) == 64 * MiB
    assert gpu_mem_get_free(0) == 15_383 - 64


def test_gpu_mem_allocate_mbs_out_of_memory(t4: CudaStandIn) -> None:
    assert gpu_mem_allocate_mbs(20_000) is None
    torch.cuda.set_device(1)
    assert gpu_mem_allocate_mbs(90_000) is None
    assert t4.devices("torch.empty") == [0, 1]
    assert torch.cuda.memory_allocated(0) == torch.cuda.memory_allocated(1) == 0


def test_gpu_mem_allocate_mbs_fatal_names_the_mb_asked_and_free(t4: CudaStandIn) -> None:
    with pytest.raises(torch.OutOfMemoryError) as caught:
        gpu_mem_allocate_mbs(20_000, fatal=True)
    assert str(caught.value) == "could not allocate 20000 MB on cuda:0: 15383 MB free"
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


@pytest.mark.parametrize("size", BAD_SIZES, ids=repr)
def test_bad_sizes_are_refused_before_allocating(t4: CudaStandIn, size: object) -> None:
    for helper in (gpu_mem_allocate_mbs, gpu_mem_leave_free_mbs):
        with pytest.raises(ValueError, match=re.escape(repr(size))):
            helper(size)  # type: ignore[arg-type]
    assert t4.factory_calls == []


def test_gpu_mem_leave_free_mbs_leaves_n_mb_free(t4: CudaStandIn) -> None:
    buffer = gpu_mem_leave_free_mbs(1_000)
    assert buffer is not None
    assert t4.factory_calls == [
        {"size": ((15_383 - 1_000) * MiB,), "dtype": torch.uint8, "device": "cuda"}
    ]
    assert gpu_mem_get_free() == 1_000
    assert t4.count("empty_cache") == 0  # reads free memory as it is, cache included


def test_gpu_mem_leave_free_mbs_with_too_little_free(t4: CudaStandIn) -> None:
    with pytest.raises(
        TorchmemError, match="already have less available mem than desired 20000MBs: 15383 MB free"
    ):
        gpu_mem_leave_free_mbs(20_000)
    assert t4.factory_calls == []
    assert gpu_mem_leave_free_mbs(15_383) is not None  # exactly enough: an empty buffer
    assert t4.factory_calls[-1]["size"] == (0,)


def test_gpu_mem_leave_free_mbs_when_the_driver_cannot_hand_it_out(t4: CudaStandIn) -> None:
    t4.visible[0].unallocatable = 2 * GiB
    with pytest.raises(TorchmemError, match="failed to allocate 15283MB to leave 100 MB free"):
        gpu_mem_leave_free_mbs(100)


def test_preload_pytorch_creates_a_tensor_on_the_device(t4: CudaStandIn) -> None:
    assert preload_pytorch(1) is None
    assert preload_pytorch() is None
    assert [call["device"] for call in t4.factory_calls] == [
        torch.device("cuda", 1),
        torch.device("cuda", 0),  # the current device
    ]
    assert t4.devices("torch.ones") == [1, 0]
    assert torch.cuda.memory_allocated(1) == torch.cuda.memory_allocated(0) == 512


# The device meter -------------------------------------------------------------------------


def test_device_meter_peak_is_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = rig()
    cuda = install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID").cuda
    meter = torchmem.device_meter(0)
    assert meter is torchmem.device_meter(0)
    assert meter.exact is False
    start = gpus[2].used
    with meter.window() as window:
        assert window.start == start
        cuda.alloc(0, 64 * MiB)
        # A sample counted after this point may have read before the allocation; the
        # one after it cannot have.
        wait_for_samples(meter, 2)
        cuda.free(0, 64 * MiB)
        torch.cuda.empty_cache()
        assert meter.used() == start
    assert window.peak() == start + 64 * MiB
    assert window.peak("used") == start + 64 * MiB


# The devices report -----------------------------------------------------------------------

A100 = GPUInfo(
    index=0,
    name="NVIDIA A100-SXM4-80GB",
    total=80 * GiB,
    used=3 * GiB // 2,
    free=157 * GiB // 2,
    allocated=4 * MiB,
    reserved=20 * MiB,
    source="nvml",
)
T4 = GPUInfo(
    index=1,
    name="Tesla T4",
    total=15 * GiB,
    used=512 * MiB,
    free=29 * GiB // 2,
    allocated=0,
    reserved=0,
    source="nvml",
)
RAM = RAMInfo(process=256 * MiB, total=64 * GiB, available=193 * GiB // 4)
RAM_LINE = "RAM: this process 256.00M resident; machine 64.00G total, 48.25G available."
CPU = CPUInfo(backend="allocator", used=4 * MiB, detail="/cache/cpu_allocator.so")
CPU_LINE = (
    "CPU tensors: 4.00M, counted by the counting CPU allocator"
    " (backend 'allocator': /cache/cpu_allocator.so)."
)
TABLE = """\
GPU  Name                    Total     Used    Free  Allocated  Reserved
  0  NVIDIA A100-SXM4-80GB  80.00G    1.50G  78.50G      4.00M    20.00M
  1  Tesla T4               15.00G  512.00M  14.50G      0.00B     0.00B"""


def test_devices_text_with_nvml() -> None:
    assert devices_text([A100, T4], RAM, CPU) == (
        f"{TABLE}\n"
        "Total, Used and Free: the whole device, all processes (NVML). "
        "Allocated and Reserved: this process's PyTorch allocator.\n"
        f"{RAM_LINE}\n{CPU_LINE}"
    )


def test_devices_text_names_mem_get_info_unless_every_gpu_is_read_by_nvml() -> None:
    t4 = GPUInfo(**{**T4.__dict__, "source": "cuda"})
    assert devices_text([A100, t4], RAM, CPU) == (
        f"{TABLE}\n"
        "Total, Used and Free: the whole device, all processes (torch.cuda.mem_get_info). "
        "Allocated and Reserved: this process's PyTorch allocator.\n"
        f"{RAM_LINE}\n{CPU_LINE}"
    )


def test_devices_text_without_gpus() -> None:
    assert devices_text([], RAM, CPU) == (
        f"No CUDA GPU is visible (torch.cuda.is_available() is False).\n{RAM_LINE}\n{CPU_LINE}"
    )


def test_devices_text_names_the_dispatch_fallback_and_why() -> None:
    cpu = CPUInfo(backend="dispatch", used=0, detail="no C++ compiler found")
    assert devices_text([], RAM, cpu).splitlines()[-1] == (
        "CPU tensors: 0.00B, counted by the dispatch-mode meter"
        " (backend 'dispatch': no C++ compiler found)."
    )


@pytest.mark.integration  # the CLI measures the CPU for real
@pytest.mark.parametrize("nvml", ["present", "missing"])
def test_cli_devices_json_has_each_visible_gpus_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], nvml: str
) -> None:
    gpus = rig()
    cuda = install_gpus(monkeypatch, gpus, "2,0", "PCI_BUS_ID", nvml=nvml).cuda
    cuda.alloc(0, 3 * MiB)
    cuda.spike(1, 5 * MiB)
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    source = "nvml" if nvml == "present" else "cuda"
    assert data["gpus"] == [
        {
            "index": 0,
            "name": "Tesla V100-SXM2-32GB",
            "total": 32 * GiB,
            "used": 3_003 * MiB + ODD,
            "free": 32 * GiB - 3_003 * MiB - ODD,
            "allocated": 3 * MiB,
            "reserved": 3 * MiB,
            "source": source,
        },
        {
            "index": 1,
            "name": "Tesla T4",
            "total": 15 * GiB,
            "used": 1_005 * MiB + ODD,
            "free": 15 * GiB - 1_005 * MiB - ODD,
            "allocated": 0,
            "reserved": 5 * MiB,
            "source": source,
        },
    ]
    assert set(data["ram"]) == {"process", "total", "available"}
    assert data["ram"]["total"] == psutil.virtual_memory().total
    assert data["ram"]["process"] > 0


@pytest.mark.integration  # the CLI measures the CPU for real
def test_cli_devices_text_has_a_row_per_visible_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    install_gpus(monkeypatch, rig(), "2,0", "PCI_BUS_ID")
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "GPU  Name                   Total      Used    Free  Allocated  Reserved",
        "  0  Tesla V100-SXM2-32GB  32.00G     2.93G  29.07G      0.00B     0.00B",
        "  1  Tesla T4              15.00G  1000.12M  14.02G      0.00B     0.00B",
    ]
