"""The out-of-memory explainer, on real CPU allocator errors and stood-in GPUs."""

from __future__ import annotations

import io
import traceback
import warnings
from typing import NamedTuple

import psutil
import pytest
import torch

import torchmem.oom
from standins import CudaStandIn, GiB, MiB, StandInGpu, gpu_uuid, hide_gpus
from torchmem import MemReporter, explain_oom, gpu_mem_restore_ctx, is_oom, meter, oom_guard
from torchmem.errors import TorchmemWarning

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


@pytest.mark.integration
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
    report = explain_oom(RuntimeError("MPS backend out of memory"), objects=list)
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


# Bad arguments, and reports that fail ------------------------------------------------


def test_explain_oom_names_what_it_cannot_explain(monkeypatch):
    hide_gpus(monkeypatch)
    with pytest.raises(ValueError, match=r"ValueError\('bad shape'\).*not an out-of-memory"):
        explain_oom(ValueError("bad shape"), objects=list)
    with pytest.raises(ValueError, match="not an out-of-memory error"):
        explain_oom(RuntimeError("shape mismatch"), objects=list)
    with pytest.raises(TypeError, match=r"'CUDA out of memory' \(str\)"):
        explain_oom("CUDA out of memory", objects=list)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device 3 is not available"):
        explain_oom(cpu_oom(), device=3, objects=list)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="'mps' is not available"):
            explain_oom(RuntimeError("MPS backend out of memory"), device="mps", objects=list)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, not 3 \(int\)"):
        explain_oom(cpu_oom(), model=3, objects=list)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"objects must be a function.*\[1\] \(list\)"):
        explain_oom(cpu_oom(), objects=[1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        cpu_oom(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
    ],
    ids=["cpu allocator", "torch.OutOfMemoryError", "mps"],
)
def test_oom_guard_still_reports_every_kind_of_oom(no_gpu, error):
    stream = io.StringIO()
    with pytest.raises(type(error)) as info, oom_guard(stream):
        raise error
    assert info.value is error
    assert stream.getvalue().startswith("Out of memory on ")


@pytest.mark.parametrize(
    ("arguments", "kind", "named"),
    [
        ({"stream": 3}, TypeError, "not 3 (int)"),
        ({"stream": "out.txt"}, TypeError, "not 'out.txt' (str)"),
        ({"model": 3}, TypeError, "not 3 (int)"),
        ({"model": "model"}, TypeError, "not 'model' (str)"),
    ],
)
def test_oom_guard_refuses_bad_arguments_at_once(arguments, kind, named):
    with pytest.raises(kind) as info:
        oom_guard(**arguments)
    assert named in str(info.value)


def test_oom_guard_refuses_a_closed_stream_at_once():
    stream = io.StringIO()
    stream.close()
    with pytest.raises(ValueError, match="is closed"):
        oom_guard(stream)


def unraised_oom() -> RuntimeError:
    """The CPU allocator's error, not raised yet: its traceback will be where it is."""
    return RuntimeError(str(cpu_oom()))


def raise_it(error: BaseException) -> None:
    raise error


def assert_passed_through(caught: BaseException, error: BaseException) -> None:
    """`caught` is the user's `error` as it was raised: the same object, nothing chained
    to it or noted on it, and its traceback still ends where it was raised."""
    assert caught is error
    assert caught.__context__ is None and caught.__cause__ is None
    assert not hasattr(caught, "__notes__")
    last = traceback.extract_tb(caught.__traceback__)[-1]
    assert (last.name, last.line) == ("raise_it", "raise error")


def test_a_stream_closed_before_the_oom_does_not_replace_it(ram):
    stream = io.StringIO()
    guard = oom_guard(stream)
    stream.close()
    error = unraised_oom()
    with (
        pytest.warns(TorchmemWarning, match="could not report.*closed file"),
        pytest.raises(RuntimeError) as info,
        guard,
    ):
        raise_it(error)
    assert_passed_through(info.value, error)


def test_a_report_that_fails_does_not_replace_the_oom(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the report itself failed")

    monkeypatch.setattr(torchmem.oom, "explain_oom", broken)
    stream = io.StringIO()
    error = unraised_oom()
    with (
        pytest.warns(TorchmemWarning, match="the report itself failed"),
        pytest.raises(RuntimeError) as info,
        oom_guard(stream),
    ):
        raise_it(error)
    assert_passed_through(info.value, error)
    assert stream.getvalue() == ""
    # Warnings turned into errors: the warning is dropped, the error still passes.
    error = unraised_oom()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError) as info, oom_guard(stream):
            raise_it(error)
    assert_passed_through(info.value, error)


def test_gpu_mem_restore_ctx_lets_the_oom_through_when_its_report_fails(monkeypatch, capsys):
    monkeypatch.setattr(torchmem.oom, "explain_oom", lambda *a, **k: 1 / 0)
    error = unraised_oom()
    with (
        pytest.warns(TorchmemWarning, match="ZeroDivisionError"),
        pytest.raises(RuntimeError) as info,
        gpu_mem_restore_ctx(),
    ):
        raise_it(error)
    assert_passed_through(info.value, error)
    assert capsys.readouterr().err == ""


class FailsOnSparse(MemReporter):
    """A walk that fails as the tensor walk did inside ``torch.func.grad`` while a sparse
    CSR tensor was alive: any tensor not strided among its objects makes it raise."""

    def snapshot(self, device=None):
        if any(isinstance(o, torch.Tensor) and o.layout != torch.strided for o in self.objects()):
            raise RuntimeError("Sparse CSR tensors do not have strides\nmore detail")
        return super().snapshot(device)


def sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Sparse CSR tensor support is in beta"
        return torch.eye(4).to_sparse_csr()


def test_tensors_that_cannot_be_read_are_left_out_and_said(monkeypatch, ram):
    monkeypatch.setattr(torchmem.oom, "MemReporter", FailsOnSparse)
    dense = torch.zeros(256, 1024)
    csr = sparse_csr()
    report = explain_oom(cpu_oom(), objects=[dense, csr].copy)
    assert [(r.name, r.nbytes) for r in report.largest] == [("Tensor0", 256 * 1024 * 4)]
    note = (
        "Tensors that could not be read are not listed"
        " (RuntimeError: Sparse CSR tensors do not have strides)."
    )
    assert report.notes == (note,)
    assert f"{' ' * 40}(256, 1024)     1.00M\n{note}\nWhat to try:\n" in str(report)


def test_a_walk_that_always_fails_leaves_the_tensors_out(monkeypatch, ram):
    class Fails(MemReporter):
        def snapshot(self, device=None):
            raise KeyError("walk")

    monkeypatch.setattr(torchmem.oom, "MemReporter", Fails)
    report = explain_oom(cpu_oom(), objects=[torch.zeros(256, 1024)].copy)
    assert report.largest == () and report.history == 0
    assert report.notes == ("The live tensors could not be listed (KeyError: 'walk').",)
    assert str(report).startswith(
        "Out of memory on cpu: tried to allocate 128.00T.\n"
        "Device: 16.00G total, 12.00G free (all processes).\n"
        "The live tensors could not be listed (KeyError: 'walk').\n"
        "What to try:\n"
    )


def test_an_oom_inside_torch_func_grad_with_a_sparse_csr_tensor_alive(ram):
    csr = sparse_csr()
    stream = io.StringIO()
    error = unraised_oom()
    caught = []

    def loss(x):
        try:
            with oom_guard(stream):
                raise_it(error)
        except RuntimeError as exc:
            caught.append(exc)
        return (x * 2).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchmemWarning)
        torch.func.grad(loss)(torch.ones(3))
    assert_passed_through(caught[0], error)
    assert stream.getvalue().startswith("Out of memory on cpu: tried to allocate 128.00T.\n")
    del csr
