"""DataLoader workers under a recording: their batches counted at the loop's line, exact
to the byte and the same as without workers, and the workers' own RAM read from /proc."""

from __future__ import annotations

import gc
import os
import resource
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchmem
from torchmem.meters.cpu import live_storages
from torchmem.records.run import DeviceRun

pytestmark = [
    pytest.mark.counting,
    pytest.mark.skipif(sys.platform != "linux", reason="reads the workers in /proc"),
]
BATCH = 64 * 256 * 4
"""One batch of inputs, 64 x 256 float32: 65,536 bytes."""


def in_use() -> int:
    """Bytes of every CPU storage Python reaches now (shared memory too), by a walk."""
    gc.collect()
    return sum(storage.nbytes() for storage in live_storages())


def keep_every_batch(workers: int) -> tuple[DeviceRun, int, int]:
    """Train on 8 batches, keeping each batch's inputs: the recording's CPU run, the bytes
    a walk found in use at its start and at its end."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 256), torch.randn(512, 256))
    # in_order=False: each step takes the batch that came first, one per step.
    context = "fork" if workers else None
    loader = DataLoader(
        data, batch_size=64, num_workers=workers, in_order=False, multiprocessing_context=context
    )
    model = nn.Linear(256, 256, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    gc.collect()
    with torchmem.record("cpu") as rec:
        before = in_use()
        for x, y in loader:
            loss = (model(x) - y).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            kept.append(x)
        del loss
        after = in_use()
    assert len(kept) == 8
    return rec.report().devices["cpu"], before, after


def test_a_loop_keeping_workers_batches_grows_by_a_batch_each_step_at_its_line() -> None:
    cpu, before, after = keep_every_batch(workers=2)
    growth = cpu.growth
    assert growth is not None
    assert (growth.bytes_per_step, growth.first_step, growth.exact) == (BATCH, 1, True)
    ((site),) = growth.sites
    assert (Path(site.file).name, site.source, site.bytes_per_step) == (
        "test_workers.py",
        "for x, y in loader:",
        BATCH,
    )
    assert site.reason == "held by list `kept`"
    assert cpu.end_bytes - cpu.start_bytes == after - before  # what is really in use


def test_with_workers_every_figure_is_as_without() -> None:
    figures = []
    for workers in (0, 2):
        cpu, _, _ = keep_every_batch(workers)
        figures.append(
            (
                cpu.peak_bytes - cpu.start_bytes,
                cpu.end_bytes - cpu.start_bytes,
                [
                    (s.peak_bytes - cpu.start_bytes, s.end_bytes - cpu.start_bytes)
                    for s in cpu.steps
                ],
                # the process's RSS is not the same with workers (nor exact): left out
                None if cpu.growth is None else replace(cpu.growth, ram_bytes_per_step=0),
                cpu.categories_at_end,
            )
        )
    assert figures[0] == figures[1]


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_recording_of_ram_reads_each_workers_peak_rss() -> None:
    data = TensorDataset(torch.randn(256, 64))
    loader = DataLoader(
        data, batch_size=32, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    with torchmem.record() as rec:
        iterator = iter(loader)
        total = sum(float(x.sum()) for (x,) in iterator)
        pids = [worker.pid for worker in iterator._workers]
        before = [vm_hwm(pid) for pid in pids]
    after = [vm_hwm(pid) for pid in pids]  # alive still (persistent): the last reading's
    assert total == pytest.approx(float(data.tensors[0].sum()), rel=1e-5)
    workers = rec.report().workers
    assert workers is not None and workers.interval == 0.05
    # In the order they were first seen: a worker is found once it has named itself, and
    # worker 1 can do that before worker 0.
    order = [(w.first_seen, w.pid) for w in workers.processes]
    assert order == sorted(order) and sorted(pid for _, pid in order) == sorted(pids)
    peaks = {w.pid: w.peak_rss_bytes for w in workers.processes}
    read = [peaks[pid] for pid in pids]
    # VmHWM is max(high-water mark, RSS now), and Linux counts RSS in per-CPU counters that it
    # reads without summing them: a reading can be a few pages above a later one (8,192 B seen)
    slack = 32 * (os.cpu_count() or 1) * resource.getpagesize()
    assert all(a - slack <= b <= c + slack for a, b, c in zip(before, read, after, strict=True))
    assert all(0 <= w.first_seen <= w.last_seen <= rec.report().duration for w in workers.processes)
    assert not any("was not recorded" in note for note in rec.report().notes)
    del iterator


def test_a_recording_of_cpu_tensors_alone_says_the_workers_were_not_recorded() -> None:
    data = TensorDataset(torch.randn(256, 64))
    loader = DataLoader(data, batch_size=32, num_workers=2, multiprocessing_context="fork")
    with torchmem.record("cpu") as rec:
        batches = [x for (x,) in loader]
    report = rec.report()
    assert report.workers is None
    assert len(batches) == 8
    assert [n for n in report.notes if "DataLoader" in n] == [
        "8 tensor storages came from other processes through shared memory (a DataLoader's"
        " workers, torch.multiprocessing): counted here from their arrival; the RAM of the"
        " processes that made them was not recorded (it is read where the recording"
        " measures process RAM, on Linux)."
    ]
