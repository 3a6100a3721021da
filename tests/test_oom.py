"""The out-of-memory explainer, on real CPU allocator errors and stood-in GPUs."""

from __future__ import annotations

import io
from typing import NamedTuple

import psutil
import pytest
import torch

from standins import CudaStandIn, GiB, MiB, StandInGpu, gpu_uuid
from torchmem import explain_oom, gpu_mem_restore_ctx, is_oom, meter, oom_guard

pytestmark = pytest.mark.usefixtures("isolated_meters")


class StandInRam(NamedTuple):
    """Stand-in for ``psutil.virtual_memory()``: the two fields torchmem reads."""

    total: int
    available: int


@pytest.fixture
def ram(monkeypatch: pytest.MonkeyPatch) -> StandInRam:
    machine = StandInRam(total=16 * GiB, available=12 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: machine)
    return machine


def cpu_oom() -> RuntimeError:
    """A real error from PyTorch's CPU allocator: 2**45 float32 elements, 128 TiB."""
    try:
        torch.empty(2**45)
    except RuntimeError as exc:
        return exc
    raise AssertionError("this machine allocated 128 TiB")


HINTS = """\
- Use a smaller batch size.
- 4.00M is in tensors with autograd history. Evaluating? Run it under torch.no_grad() (or \
torch.inference_mode()). Training? Activation checkpointing (torch.utils.checkpoint) or \
mixed precision (torch.autocast) keeps less for backward."""


def live() -> list[torch.Tensor]:
    """What the explainer finds alive: a 4 MiB activation with autograd history, a 1 MiB
    tensor without, and a view of it (its storage counts once)."""
    weight = torch.ones(1024, 1024, requires_grad=True)
    plain = torch.zeros(256, 1024)
    return [weight * 2, plain, plain[:10]]


def test_a_real_cpu_allocator_error_is_explained_exactly(ram):
    assert meter("cpu").backend == "allocator"  # torchmem's counting allocator is PyTorch's
    tensors = live()
    report = explain_oom(cpu_oom(), objects=tensors.copy)
    assert report.device == "cpu"
    # the size asked for, not what the counting allocator asks c10 for (a 64-byte header
    # before each block): the allocator rewrites c10's message
    assert report.requested == 2**47
    assert (report.total, report.free) == (16 * GiB, 12 * GiB)
    assert report.allocated is None and report.reserved is None
    assert str(report) == (
        "Out of memory on cpu: tried to allocate 128.00T.\n"
        "Device: 16.00G total, 12.00G free (all processes).\n"
        "Largest live tensors on cpu:\n"
        "  Tensor0                                       (1024, 1024)     4.00M\n"
        "  Tensor1                                        (256, 1024)     1.00M\n"
        "What to try:\n"
        "- The request alone (128.00T) is larger than the whole device (16.00G): a shape is"
        " probably wrong, or this work must be split (smaller batch, chunks).\n" + HINTS
    )


def test_a_cuda_error_names_its_gpu_and_the_allocators_fragmentation(monkeypatch):
    gpus = [StandInGpu(gpu_uuid(0), total=16 * GiB), StandInGpu(gpu_uuid(1), total=16 * GiB)]
    cuda = CudaStandIn(gpus).install(monkeypatch)
    cuda.alloc(1, 1 * GiB)
    cuda.spike(1, 3 * GiB)  # freed, but stays reserved in the cache
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of"
        " 16.00 GiB of which 12.00 GiB is free."
    )
    tensors = live()
    report = explain_oom(error, objects=tensors.copy)
    assert report.device == "cuda:1"
    assert report.requested == 2 * GiB
    assert (report.allocated, report.reserved) == (1 * GiB, 4 * GiB)
    assert str(report) == (
        "Out of memory on cuda:1: tried to allocate 2.00G.\n"
        "Device: 16.00G total, 12.00G free (all processes).\n"
        "PyTorch: 1.00G in tensors, 4.00G reserved (3.00G reserved but unallocated).\n"
        "What to try:\n"
        "- 3.00G is reserved but unallocated (fragmentation): set"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python.\n"
        "- Use a smaller batch size."
    )
    assert cuda.devices("mem_get_info") == [1]


def test_a_message_without_a_size_or_device():
    report = explain_oom(RuntimeError("MPS backend out of memory"), device="mps", objects=list)
    assert (report.device, report.requested, report.total) == ("mps", None, None)
    assert str(report).startswith("Out of memory on mps.\nWhat to try:\n")


def test_which_errors_are_out_of_memory():
    assert is_oom(cpu_oom())
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # not an error PyTorch raises for it


def test_oom_guard_prints_the_report_and_reraises_the_same_error(ram):
    stream = io.StringIO()
    error = cpu_oom()
    with pytest.raises(RuntimeError) as info, oom_guard(stream):
        raise error
    assert info.value is error
    assert stream.getvalue().startswith(str(explain_oom(error, objects=list)).split("\n")[0])

    @oom_guard(stream)
    def fails():
        torch.empty(2**45)

    with pytest.raises(RuntimeError, match="can't allocate memory"):
        fails()
    assert stream.getvalue().count("Out of memory on cpu") == 2


def test_oom_guard_leaves_other_errors_and_success_alone():
    stream = io.StringIO()
    with pytest.raises(KeyError), oom_guard(stream):
        raise KeyError("x")
    with oom_guard(stream):
        torch.zeros(MiB)
    assert stream.getvalue() == ""


def test_gpu_mem_restore_explains_an_oom_it_catches(ram, capsys):
    with pytest.raises(RuntimeError), gpu_mem_restore_ctx():
        torch.empty(2**45)
    assert capsys.readouterr().err.startswith("Out of memory on cpu: tried to allocate 128.00T.\n")


def test_a_gpu_this_process_cannot_see_leaves_the_error_unchanged(monkeypatch):
    """An error naming a GPU that is not visible here (a message from another process, or
    one read back from a log) is still explained, without the allocator's numbers, and
    oom_guard re-raises the user's error, not one of ours."""
    CudaStandIn([StandInGpu(gpu_uuid(0), total=16 * GiB)]).install(monkeypatch)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 7 ...")
    report = explain_oom(error, objects=list)
    assert (report.device, report.requested) == ("cuda:7", 2 * GiB)
    assert (report.total, report.free, report.allocated, report.reserved) == (None,) * 4
    stream = io.StringIO()
    with pytest.raises(torch.OutOfMemoryError) as info, oom_guard(stream):
        raise error
    assert info.value is error and info.value.__context__ is None
    assert stream.getvalue().startswith("Out of memory on cuda:7: tried to allocate 2.00G.\n")
