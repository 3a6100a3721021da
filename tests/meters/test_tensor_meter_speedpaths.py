"""The tensor meter's quick paths: torch.compile compiling under it (operators it sees,
buffers inductor allocates below the dispatcher it does not), in-place writes, long runs
between readings, and frees from other threads."""

import gc
import shutil
import threading

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from standins import MiB
from torchmem import TensorMeter, meter

# torch.compile's own import of TorchScript warns that it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
needs_dynamo = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile does not run on this Python"
)


@pytest.fixture
def m():
    return TensorMeter("cpu")


def double_sin_plus_one(x):
    return (x * 2).sin() + 1  # two 4 KiB temporaries, one 4 KiB result


def check_compiled_under_a_window(m, compiled):
    x = torch.randn(1024)
    expected = double_sin_plus_one(x)
    with m.window() as w:
        result = compiled(x)
        assert m.used() == 4096
        assert w.peak() == 8192  # x * 2 and its sine; the product dies before the + 1
    assert torch.equal(result, expected)
    del result
    assert m.used() == 0


@needs_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_function_counts_exactly_in_a_window_and_is_untouched_outside(m):
    backend = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(double_sin_plus_one, backend=backend)
    x = torch.randn(1024)
    assert torch.equal(compiled(x), double_sin_plus_one(x))
    assert (backend.frame_count, backend.op_count) == (1, 3)

    check_compiled_under_a_window(m, compiled)

    # Nothing of the meter was compiled, and the compiled function still runs its graph.
    assert torch.equal(compiled(x), double_sin_plus_one(x))
    assert (backend.frame_count, backend.op_count) == (1, 3)


@needs_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_function_first_compiled_inside_a_window_counts_exactly(m):
    check_compiled_under_a_window(m, torch.compile(double_sin_plus_one, backend="eager"))


@needs_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="inductor needs a C++ compiler for CPU code",
)
def test_inductor_compiled_function_counts_exactly_in_a_window(m):
    compiled = torch.compile(double_sin_plus_one)
    x = torch.randn(1024)
    torch.testing.assert_close(compiled(x), double_sin_plus_one(x))  # inductor's own sine
    # Under a window the compiled code runs (the mode does not make dynamo skip the
    # frame). Inductor fuses the three operators into one kernel, with no temporaries,
    # and allocates its 4 KiB result itself, below the dispatcher: the dispatch mode sees
    # no operator, so the tensor meter counts nothing; PyTorch's CPU allocator, which
    # meter("cpu") counts, sees the result exactly.
    cpu = meter("cpu")
    assert cpu.backend == "allocator"
    with m.window() as w, cpu.window() as c:
        result = compiled(x)
        assert (m.used(), w.peak()) == (0, 0)
        assert (cpu.used() - c.start, c.peak() - c.start) == (4096, 4096)
    torch.testing.assert_close(result, double_sin_plus_one(x))
    del result
    assert (m.used(), cpu.used()) == (0, c.start)


@needs_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_counted_storage_freed_inside_compiled_code_is_taken_off(m):
    kept = []
    with m.window():
        kept.append(torch.ones(MiB, dtype=torch.uint8))
    assert m.used() == MiB
    backend = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=backend)
    def pop_and_add(tensors, y):
        tensors.pop()
        return y + 1

    y = torch.ones(4)
    assert torch.equal(pop_and_add(kept, y), y + 1)
    assert kept == []
    assert m.used() == 0
    assert backend.frame_count == 1


def test_in_place_writes_to_parameters_and_views_cost_nothing(m):
    layer = torch.nn.Linear(256, 256)
    with m.window() as w:
        with torch.no_grad():
            layer.weight.uniform_(-1, 1)
            layer.weight[:, 0].zero_()
            layer.bias.add_(1)
        assert m.used() == w.peak() == 0
        layer = torch.nn.Linear(256, 128)
        assert m.used() == w.peak() == (256 * 128 + 128) * 4


def test_resize_in_place_counts_the_growth_of_a_tensor_made_before_the_window(m):
    a = torch.ones(256)
    b = a.view(16, 16)
    with m.window() as w:
        a.resize_(1024)  # grows a's storage, which b shares, from 1 KiB to 4 KiB
        assert m.used() == w.peak() == 3072
        a.resize_(16)  # shrinking frees nothing
        assert m.used() == 3072
    del a
    assert m.used() == 3072  # the view keeps the storage
    del b
    assert m.used() == 0


def test_many_operators_between_two_readings_keep_the_exact_peak_and_totals(m):
    with m.window() as w:
        kept = [torch.empty(i + 1, dtype=torch.uint8) for i in range(10_000)]
        total = 10_000 * 10_001 // 2
        del kept[::2]  # the 5,000 odd sizes
        freed = 5_000 * 5_000
        assert w.peak() == total
        assert m.used() == total - freed
        counters = m.counters()
    assert counters == {
        "allocated_bytes.all.current": total - freed,
        "allocated_bytes.all.allocated": total,
        "allocated_bytes.all.freed": freed,
    }
    del kept
    assert m.counters()["allocated_bytes.all.freed"] == total


def test_frees_from_other_threads_while_counting_add_up(m):
    with m.window() as w:
        batches = [[torch.empty(1000 + i, dtype=torch.uint8) for i in range(200)] for _ in range(4)]
        made = sum(t.nbytes for batch in batches for t in batch)
        start = threading.Barrier(len(batches) + 1)

        def drop(batch):
            start.wait()
            while batch:
                batch.pop()

        threads = [threading.Thread(target=drop, args=(batch,)) for batch in batches]
        for thread in threads:
            thread.start()
        start.wait()
        more = [torch.empty(MiB, dtype=torch.uint8) for _ in range(8)]
        for thread in threads:
            thread.join()
        assert m.used() == 8 * MiB
        assert made + 8 * MiB >= w.peak() >= 8 * MiB
        assert m.counters()["allocated_bytes.all.allocated"] == made + 8 * MiB
    del more
    assert m.used() == 0


def test_storages_the_garbage_collector_frees_at_any_moment_add_up(m):
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation, the meter's own included
    try:
        with m.window():
            for _ in range(3_000):
                cycle = [torch.empty(100, dtype=torch.uint8)]
                cycle.append(cycle)
            del cycle
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert m.counters() == {
        "allocated_bytes.all.current": 0,
        "allocated_bytes.all.allocated": 300_000,
        "allocated_bytes.all.freed": 300_000,
    }


def test_a_spike_in_another_thread_during_a_restart_shows_in_the_new_period(m):
    """Another thread's operators do not wait for a window's restart: what they do while
    it runs belongs to the period after it, never to neither."""
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def spike():
        with m.window():
            go.wait()
            temp = torch.empty(MiB, dtype=torch.uint8)
            del temp
            done.set()
            leave.wait()

    other = threading.Thread(target=spike)
    with m.window() as w:
        other.start()
        fold = w._fold

        def fold_then_spike(peaks):
            fold(peaks)
            go.set()
            done.wait(timeout=1)  # a thread that has to wait for the restart times out

        w._fold = fold_then_spike
        w.restart()
        w._fold = fold
        done.wait()
        assert w.peak() - w.start == MiB
    leave.set()
    other.join()
