"""MemTrace / GPUMemTrace and the mem_trace decorator, exact on CPU tensors.

Tests of the default device hide the GPUs (:func:`standins.hide_gpus`) so that it is CPU
tensors on every machine; the trace of process RAM runs in a fresh process.
"""

import gc

import pytest
import torch

import torchmem
from standins import CudaStandIn, MiB, StandInGpu, call_in_fresh_process_without_gpu, gpu_uuid
from torchmem import GPUMemTrace, MemTrace, gpu_mem_trace, mem_trace

pytestmark = pytest.mark.integration


def mib(n: int) -> torch.Tensor:
    return torch.empty(n * MiB, dtype=torch.uint8)


def test_aliases_are_the_same_code():
    assert GPUMemTrace is MemTrace
    assert gpu_mem_trace is mem_trace


def test_default_device_without_a_gpu_is_cpu_tensors(no_gpu):
    trace = MemTrace()
    assert trace.meter is torchmem.meter("cpu")
    trace.stop()


def test_used_and_peaked_in_bytes_and_mb():
    trace = MemTrace(device="cpu")
    kept = mib(10)
    temp = mib(15)
    del temp
    assert (trace.used_bytes, trace.peak_bytes, trace.peaked_bytes) == (
        10 * MiB,
        25 * MiB,
        15 * MiB,
    )
    assert trace.data() == (10, 15)
    del kept  # seed: +10 +15 -15 gives (10, 15); then -10 gives (0, 25)
    assert trace.data() == (0, 25)
    trace.reset()
    assert trace.data() == (0, 0)
    trace.stop()


def test_freeing_gives_negative_used_and_no_negative_peaked():
    trace = MemTrace(device="cpu")
    kept = [mib(10)]
    trace.reset()
    kept.clear()  # seed: reset() then -10 gives (-10, 0)
    assert trace.data() == (-10, 0)
    assert trace.peaked_bytes == 0
    trace.stop()


def test_stop_freezes_and_start_restarts():
    trace = MemTrace(device="cpu")
    kept = mib(3)
    trace.stop()
    later = mib(5)
    assert not trace.running
    assert trace.data() == (3, 0)
    trace.stop()  # harmless twice
    trace.start()
    assert trace.running
    assert trace.data() == (0, 0)
    trace.stop()
    del kept, later


def test_report_lines_exactly(capsys):
    trace = MemTrace(device="cpu")
    trace.report()
    trace.report("2nd run of some_code()")
    trace.ctx = "foobar"
    trace.report()
    trace.report("1st try")
    trace.stop()
    assert capsys.readouterr().out == (
        "△Used Peaked MB:      0      0\n"
        "△Used Peaked MB:      0      0 (2nd run of some_code())\n"
        "△Used Peaked MB:      0      0 (foobar)\n"
        "△Used Peaked MB:      0      0 (foobar: 1st try)\n"
    )


def test_report_numbers_are_comma_grouped_and_grow(capsys):
    trace = MemTrace(device="cpu")
    kept = mib(1234)
    trace.report()
    trace.stop()
    assert repr(trace) == str(trace) == "△Used Peaked MB:  1,234      0"
    assert capsys.readouterr().out == "△Used Peaked MB:  1,234      0\n"
    del kept


def test_report_n_reset(capsys):
    trace = MemTrace(device="cpu")
    kept = [mib(2)]
    for i in range(2):
        temp = mib(4)
        del temp
        trace.report_n_reset(f"i={i}")
    trace.stop()
    assert capsys.readouterr().out == (
        "△Used Peaked MB:      2      4 (i=0)\n△Used Peaked MB:      0      4 (i=1)\n"
    )
    del kept


def test_silent_both_ways(capsys):
    trace = MemTrace(silent=True, device="cpu")
    assert trace.silent
    trace.report()
    trace.silent(False)
    assert not trace.silent
    trace.report("a")
    trace.silent()
    trace.report("b")
    trace.silent = False
    trace.report("c")
    trace.silent(silent=True)
    trace.report("d")
    trace.stop()
    assert capsys.readouterr().out == (
        "△Used Peaked MB:      0      0 (a)\n△Used Peaked MB:      0      0 (c)\n"
    )


def test_context_manager_reports_exit_and_measures_once(capsys):
    with MemTrace(ctx="some context", device="cpu") as trace:
        kept = mib(20)
        temp = mib(7)
        del temp
    with MemTrace(device="cpu"):
        pass
    with MemTrace(ctx="quiet", on_exit_report=False, device="cpu") as quiet:
        other = mib(1)
    quiet.report("measured in ctx")
    assert capsys.readouterr().out == (
        "△Used Peaked MB:     20      7 (some context: exit)\n"
        "△Used Peaked MB:      0      0 (exit)\n"
        "△Used Peaked MB:      1      0 (quiet: measured in ctx)\n"
    )
    assert trace.data() == (20, 7)
    assert not trace.running
    del kept, other


def test_with_block_measures_from_entry_not_construction():
    trace = MemTrace(on_exit_report=False, device="cpu")
    before = mib(8)
    with trace:
        pass
    assert trace.data() == (0, 0)
    del before


def test_nested_traces_each_exact(capsys):
    with MemTrace(ctx="outer", device="cpu") as outer:
        spike = mib(30)
        del spike
        with MemTrace(ctx="inner", device="cpu") as inner:
            kept = mib(5)
            temp = mib(2)
            del temp
        after = mib(1)
    assert inner.data() == (5, 2)
    assert outer.data() == (6, 24)
    assert capsys.readouterr().out == (
        "△Used Peaked MB:      5      2 (inner: exit)\n"
        "△Used Peaked MB:      6     24 (outer: exit)\n"
    )
    del kept, after


def test_exceptions_pass_through_and_the_trace_stops(capsys):
    error = ValueError("boom")
    with pytest.raises(ValueError) as info, MemTrace(device="cpu") as trace:
        raise error
    assert info.value is error
    assert not trace.running
    assert capsys.readouterr().out == "△Used Peaked MB:      0      0 (exit)\n"


def test_a_dropped_trace_stops_its_window():
    trace = MemTrace(device="cpu")
    window = trace._window
    del trace
    gc.collect()
    assert window.closed


@mem_trace
def make(n):
    """Make n MiB."""
    return mib(n)


class Model:
    @mem_trace(device="cpu")
    def forward(self, n):
        temp = mib(n)
        del temp
        return n


def test_decorator_forms_report_the_qualname(no_gpu, capsys):
    kept = make(3)
    assert kept.numel() == 3 * MiB
    assert Model().forward(4) == 4
    assert capsys.readouterr().out == (
        "△Used Peaked MB:      3      0 (make: exit)\n"
        "△Used Peaked MB:      0      4 (Model.forward: exit)\n"
    )
    assert make.__name__ == "make"
    assert make.__doc__ == "Make n MiB."
    assert make.__wrapped__(0).numel() == 0


def test_decorator_passes_exceptions_through(capsys):
    @mem_trace(device="cpu")
    def fails():
        raise KeyError("k")

    with pytest.raises(KeyError, match="'k'"):
        fails()
    qualname = "test_decorator_passes_exceptions_through.<locals>.fails"
    assert capsys.readouterr().out == f"△Used Peaked MB:      0      0 ({qualname}: exit)\n"


def trace_a_ram_spike() -> tuple[int, int]:
    """Trace 64 MiB of process RAM allocated and freed inside one call: ``trace.data()``."""
    with MemTrace(device="ram", on_exit_report=False) as trace:
        len(b"\x01" * (64 * MiB))  # freed inside one call
    return trace.data()


@pytest.mark.slow
def test_ram_device_traces_process_memory():
    # In a fresh process that never initialises CUDA: in this one, threads that earlier
    # tests started (CUDA's, PyTorch's CPU pool) move the resident size on their own.
    used, peaked = call_in_fresh_process_without_gpu(trace_a_ram_spike)
    assert peaked >= 63  # within the kernel's RSS batching
    assert abs(used) < 8


def test_bad_device_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        MemTrace(device="nope")


def see_memory_usage(message: str) -> None:
    """What DeepSpeed's ``see_memory_usage`` does: print the peak, then reset it."""
    print(f"{message}: max allocated {torch.cuda.max_memory_allocated() // MiB} MB")
    torch.cuda.reset_max_memory_allocated()


@pytest.mark.filterwarnings("ignore:torch.cuda.reset_max_memory")  # PyTorch's own warning
def test_a_trace_keeps_its_peak_when_other_code_resets_the_gpu_peak(monkeypatch, capsys):
    cuda = CudaStandIn([StandInGpu(gpu_uuid(0), total=2**34)]).install(monkeypatch)
    with MemTrace(ctx="step", device="cuda:0") as trace:
        cuda.spike(0, 96 * MiB)
        see_memory_usage("after forward")
        cuda.alloc(0, 8 * MiB)
        see_memory_usage("after backward")
    assert trace.data() == (8, 88)
    assert capsys.readouterr().out == (
        "after forward: max allocated 96 MB\n"
        "after backward: max allocated 8 MB\n"
        "△Used Peaked MB:      8     88 (step: exit)\n"
    )
