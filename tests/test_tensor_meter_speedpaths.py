"""The tensor meter's quick paths: in-place writes, long runs between readings, frees
from other threads and from the garbage collector."""

import gc
import threading

import pytest
import torch

from torchmem import TensorMeter

MiB = 2**20


@pytest.fixture
def m():
    return TensorMeter("cpu")


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
