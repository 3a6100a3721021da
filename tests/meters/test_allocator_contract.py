"""The counting CPU allocator keeps the contract of a c10 allocator: it never throws out of
its bookkeeping or its deleters, its peak loses no concurrent growth, it adopts storages
with the GIL held, and it places data where PyTorch's own allocator would."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from standins import MiB
from torchmem import meter
from torchmem.events.tally import ALLOC, FREE, KIND, PTR, REF, SIZE
from torchmem.meters import CpuAllocatorMeter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's limits")


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch, isolated_meters) -> Iterator[CpuAllocatorMeter]:
    """The CPU meter on the counting allocator, with no garbage collection meanwhile: a
    storage that a collection frees would move the numbers."""
    monkeypatch.setenv("TORCHMEM_CPU_METER", "allocator")
    m = meter("cpu")
    assert isinstance(m, CpuAllocatorMeter)
    gc.collect()
    gc.disable()
    try:
        yield m
    finally:
        gc.enable()


def run_python(code: str, **env: str) -> list[str]:
    """Run `code` in a fresh interpreter; the words it printed."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    return done.stdout.split()


# Bookkeeping that cannot get memory ---------------------------------------------------

# The log grows by doubling: under an address-space limit 48 MiB above what the process
# maps, it cannot grow past 2**18 rows of 48 bytes (24 MiB, while the old 12 MiB are held)
# long before the small tensors themselves run out. The first row that finds no room is an
# allocation's (2**18 is even); a row noted first makes it a free's, inside a deleter.
OUT_OF_ROOM = """
import gc, resource, sys, torch
from torchmem.meters import native

torch.set_num_threads(1)
library = native.load()
gc.collect()
used, dropped = library.counters[0], library.dropped_rows()
library.record_start(False)
if sys.argv[1] == "free":
    library.note(5, 0, 0, -1, -1)
with open("/proc/self/statm") as statm:
    mapped = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 48 * 2**20, resource.RLIM_INFINITY))
try:
    for _ in range(2_000_000):
        x = torch.empty(16)
        del x
        if library.dropped_rows() - dropped >= 2:
            break
finally:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
library.record_stop()
library.record_clear()
print(library.dropped_rows() - dropped >= 2, library.counters[0] - used)
"""


@linux_only
@pytest.mark.parametrize("first", ["allocation", "free"])
def test_a_row_the_log_has_no_memory_for_is_dropped_and_counted(first):
    # Before: std::bad_alloc out of torch.empty (its bytes counted, its block leaked), or
    # std::terminate out of the deleter.
    code = OUT_OF_ROOM.replace("sys.argv[1]", repr(first))
    assert run_python(code) == ["True", "0"]


def test_the_dropped_rows_start_at_zero_in_a_fresh_process():
    code = (
        "import torch\n"
        "from torchmem.meters import native\n"
        "library = native.load()\n"
        "library.record_start(True)\n"
        "x = torch.ones(1000); del x\n"
        "library.record_stop()\n"
        "print(library.dropped_rows())\n"
    )
    assert run_python(code) == ["0"]


# The peak -----------------------------------------------------------------------------


def test_a_window_over_threads_allocating_at_once_peaks_between_exact_bounds(counting):
    # Each thread builds and frees its own live set over and over; every window opens (and
    # so resets the peak) while they run, and waits for each thread to build its set whole
    # inside it. The peak then reaches at least the largest set and never more than all.
    sets = [[(k + 1) * 12_288] * 4 for k in range(4)]  # bytes of each thread's tensors
    base = counting.used()
    builds = [0] * len(sets)
    stop = threading.Event()

    def work(k: int) -> None:
        while not stop.is_set():
            held = [torch.empty(n, dtype=torch.uint8) for n in sets[k]]
            del held
            builds[k] += 1

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(sets))]
    for thread in threads:
        thread.start()
    try:
        for _ in range(300):
            with counting.window() as window:
                marks = list(builds)
                while any(b < m + 2 for b, m in zip(builds, marks, strict=True)):
                    time.sleep(0)
                now = counting.used()
                peak = window.peak()
            assert now <= peak
            assert base + max(map(sum, sets)) <= peak <= base + sum(map(sum, sets))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert counting.used() == base


# The log's table of live storages ----------------------------------------------------


def test_every_free_names_its_allocation_through_growth_and_deletions(counting):
    """5,000 storages alive at once (the table of live storages grows four times), freed in
    a shuffled order, then made and freed again: each free row names the sequence number
    of its own allocation's row."""
    library = counting.library
    order = list(range(5000))
    random.Random(0).shuffle(order)
    library.record_start(False)
    try:
        for _ in range(2):
            kept = [torch.empty(i + 1, dtype=torch.uint8) for i in range(5000)]
            for i in order:
                kept[i] = None  # type: ignore[call-overload]
        rows = library.take(10**6)
    finally:
        library.record_stop()
        library.record_clear()
    allocs = {
        int(seq): (int(r[PTR]), int(r[SIZE])) for seq, r in enumerate(rows) if r[KIND] == ALLOC
    }
    frees = [(int(r[REF]), int(r[PTR]), -int(r[SIZE])) for r in rows if r[KIND] == FREE]
    mine = [f for f in frees if f[2] <= 5000]
    assert sorted(size for _, _, size in mine) == sorted([*range(1, 5001)] * 2)
    assert all(allocs.get(ref) == (ptr, size) for ref, ptr, size in mine)


# Sites without the GIL ---------------------------------------------------------------

# Thread B runs backward passes of a long chain over and over: autograd's engine runs them
# in C++ with the GIL released, allocating a gradient at each node, each with its site.
# The main thread then holds the GIL for 0.3 s in a C call. An allocator that took the GIL
# to read the site would stop B's allocations until the call ends; ours must not wait.
WHILE_ANOTHER_HOLDS_THE_GIL = """
import ctypes, threading, time, torch
from torchmem.meters import native
from torchmem.events.tally import ALLOC, KIND, SITE

torch.set_num_threads(1)
library = native.load()
assert library.records_sites
hold_the_gil = ctypes.PyDLL(None).usleep  # a PyDLL call keeps the GIL
hold_the_gil.argtypes = [ctypes.c_uint]
x = torch.randn(64, requires_grad=True)
y = x
for _ in range(3000):
    y = y * 1.0001
loss = y.sum()
done = threading.Event()

def passes():
    while not done.is_set():
        loss.backward(retain_graph=True)

library.record_start(True)
worker = threading.Thread(target=passes)
worker.start()
made = sited = allocations = 0
for _ in range(10):  # B may be between two passes, needing the GIL itself, or not running
    time.sleep(0.1)
    start = time.monotonic_ns()
    hold_the_gil(300_000)
    rows = library.take(10**8)
    allocs = rows[rows[:, KIND] == ALLOC]
    within = (allocs[:, 0] > start + 10**7) & (allocs[:, 0] < start + 29 * 10**7)  # surely
    made = int(within.sum())
    sited += int((allocs[:, SITE] >= 0).sum())
    allocations += len(allocs)
    if made:
        break
done.set()
worker.join()
library.record_stop()
library.record_clear()
print(made, sited, allocations)
"""


@linux_only
def test_an_allocation_never_waits_for_the_gil_to_name_its_site():
    made, sited, allocations = map(int, run_python(WHILE_ANOTHER_HOLDS_THE_GIL))
    assert made > 0  # allocations, with their sites, while the main thread held the GIL
    assert sited == allocations  # every one named by B's Python stack


# Adoption -----------------------------------------------------------------------------


def test_adoption_is_called_with_the_gil_held(counting):
    # ctypes.PyDLL's functions keep the GIL; ctypes.CDLL's release it.
    assert counting.library._adopt._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def test_a_storage_made_before_the_meter_is_adopted_once():
    code = (
        "import torch, torchmem\n"
        "t = torch.zeros(1000)\n"
        "from torchmem.meters import native\n"
        "library = native.load()\n"
        "key = t.untyped_storage()._cdata\n"
        "print(library.adopt(key), library.adopt(key))\n"
    )
    assert run_python(code) == ["4000", "0"]


# Where the data lies ------------------------------------------------------------------

PLACED = """
import torch
if {metered}:
    import torchmem
    m = torchmem.meter("cpu")
    assert m.backend == "allocator", m.backend
    start = m.used()
t = torch.empty(4 * 2**20, dtype=torch.uint8)
small = torch.empty(2**20, dtype=torch.uint8)
print(t.data_ptr() % 4096, small.data_ptr() % 64)
if {metered}:
    print(m.used() - start)
    del t, small
    print(m.used() - start)
"""


@linux_only
def test_huge_page_allocations_lie_where_pytorch_puts_them_and_count_exactly():
    # With THP_MEM_ALLOC_ENABLE=1, c10 aligns allocations of 2 MiB and more to the page,
    # so that the kernel can back them with huge pages: a header before the data moved it
    # off the page (data_ptr() % 4096 was 64).
    env = {"THP_MEM_ALLOC_ENABLE": "1", "TORCHMEM_CPU_METER": "allocator"}
    plain = run_python(PLACED.format(metered=False), **env)
    assert plain == ["0", "0"]
    metered = run_python(PLACED.format(metered=True), **env)
    assert metered == [*plain, str(5 * MiB), "0"]
