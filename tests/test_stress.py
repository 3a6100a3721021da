"""The counting CPU allocator under a hostile concurrent workload, many times over, each
run in a fresh process: threads allocating and freeing in tight loops, autograd's backward
from threads, a DataLoader forking its workers meanwhile, PyTorch's intra-op and inter-op
threads (which Python does not know) allocating, and a thread that holds the GIL for tens
of milliseconds at a time, all inside a recording that walks the Python stack of every
allocation (it takes the GIL inside the allocator).

Two things must hold every time: nothing hangs (each process arms faulthandler, so that a
hang prints where every thread is and exits), and the bytes come back exactly: the meter
reads, once the threads have joined and their tensors are freed, what it read before,
and a recording ends exactly the kept tensors' bytes above its start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.counting,
]

HANG_SECONDS = 60
"""An iteration that takes longer has hung: faulthandler dumps every thread and exits."""
RUNS = 2
"""Fresh processes that run the workload ITERATIONS times, each inside a recording."""
ITERATIONS = 30
CLI_RUNS = 2
"""``torchmem run`` of the workload, CLI_ITERATIONS times inside, each inside a recording
of its own (nested in the run's)."""
CLI_ITERATIONS = 10
AT_END = (5, 77_777)
"""float32 elements of the tensors the script keeps alive at its end."""

WORKLOAD = textwrap.dedent(
    '''\
    """Threads allocate at once while the counting CPU allocator records, looped; the bytes
    it counts must come back exactly, and nothing may hang.
    Usage: workload.py ITERATIONS [--no-record] [--numbers PATH]"""

    import faulthandler
    import gc
    import json
    import os
    import random
    import sys
    import threading
    import time
    from typing import List

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import torchmem

    TIMEOUT = float(os.environ["STRESS_HANG_SECONDS"])
    CHURNERS = 3
    BACKWARDS = 2
    SIZES = (1, 7, 64, 1000, 4096, 65_537, 1 << 20)  # float32 elements
    KEEP = (3, 1000, 12_345)  # float32 elements each churner keeps alive at its end
    KEPT_BYTES = CHURNERS * 4 * sum(KEEP)
    AT_END = AT_END_ELEMENTS  # float32 elements the script keeps alive at its end

    torch.set_num_threads(2)  # matmuls run in the intra-op pool too


    class Numbers(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.full((1024,), float(i)) + torch.randn(1024)


    @torch.jit.script
    def chain(x: torch.Tensor, n: int) -> float:
        # A number, not a tensor: the inter-op thread that ran a fork drops its future
        # (and a tensor it held) after the waiter has gone on, so such a tensor's bytes
        # come back at a moment no check can wait for.
        y = x * 2
        for _ in range(n):
            y = torch.cat([y, x]).sum(0, keepdim=True) + x
        return float(y.sum())


    @torch.jit.script
    def fan_out(n: int) -> List[float]:
        # torch.jit.fork inside TorchScript runs on the inter-op pool: threads that Python
        # does not know allocate, some 20,000 times (the log's drain thread takes rows
        # meanwhile). The input is made here, not in Python, and the caller is not the
        # recording's thread: an inter-op thread that drops the last reference to a tensor
        # Python has seen, or copies the caller's saved-tensor hooks (Python objects: the
        # recording's), takes the GIL with a thread state it makes (PyThreadState_New,
        # under CPython's lock of thread states, without the GIL), and a DataLoader worker
        # forked meanwhile hangs in PyOS_AfterFork_Child on that lock (CPython 3.11: a
        # hazard of PyTorch and CPython, not of the allocator).
        x = torch.ones(n, n)
        futures = [torch.jit.fork(chain, x, 800) for _ in range(4)]
        return [torch.jit.wait(f) for f in futures]


    # Once the threads start, they draw random numbers from generators of their own: a
    # DataLoader worker forked while another thread holds the default generator's lock
    # hangs in torch.manual_seed (PyTorch's own hazard of fork, not the allocator's).


    def churn(barrier, seed, kept, lock):
        pick = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        barrier.wait()
        for _ in range(8):
            held = [torch.empty(pick.choice(SIZES)) for _ in range(pick.randrange(1, 6))]
            t = torch.randn(pick.randrange(1, 50_000), generator=gen) * 2
            held.append(t.clone())
            chain(held[-1][:16], 50)  # 150 allocations in C++, the GIL released
            if pick.random() < 0.5:
                held.pop(pick.randrange(len(held)))
            del held, t
        keep = [torch.zeros(n) for n in KEEP]
        with lock:
            kept.extend(keep)


    def backward(barrier, seed):
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
        gen = torch.Generator().manual_seed(seed)
        barrier.wait()
        for _ in range(3):
            x = torch.randn(32, 64, generator=gen)
            model(x).square().mean().backward()
            q = torch.randn(2, 2, 64, 32, generator=gen, requires_grad=True)
            F.scaled_dot_product_attention(q, q, q).sum().backward()
            model.zero_grad(set_to_none=True)


    def intra_op(barrier):
        a = torch.randn(384, 384)
        barrier.wait()
        for _ in range(2):
            (a @ a).sum()
            fan_out(16)


    def hog(barrier, stop):
        # Holds the GIL for long stretches, allocating no tensor: sum(range()) and
        # bytes.count run in C and let no other thread take the GIL until they return.
        big = b"x" * (8 << 20)
        barrier.wait()
        while not stop.is_set():
            sum(range(1_000_000))  # tens of milliseconds
            big.count(b"xy")
            time.sleep(0.01)


    def workload(seed, fork_meanwhile=True):
        """Every kind of thread at once; returns the tensors the churners kept. The
        DataLoader forks its workers while the threads run, or after they end."""
        loader = DataLoader(
            Numbers(),
            batch_size=2,
            num_workers=2,
            multiprocessing_context="fork",
        )
        kept = []
        lock = threading.Lock()
        stop = threading.Event()
        jobs = [(churn, (seed * 10 + k, kept, lock)) for k in range(CHURNERS)]
        jobs += [(backward, (seed * 10 + k,)) for k in range(BACKWARDS)]
        jobs += [(intra_op, ()), (hog, (stop,))]
        barrier = threading.Barrier(len(jobs) + 1)
        threads = [
            threading.Thread(target=f, args=(barrier, *a), name=f.__name__) for f, a in jobs
        ]
        for t in threads:
            t.start()
        barrier.wait()
        if fork_meanwhile:
            batches = [float(batch.sum()) for batch in loader]
        for t in threads:
            if t.name != "hog":
                t.join()
        if not fork_meanwhile:
            batches = [float(batch.sum()) for batch in loader]
        assert len(batches) == 3
        stop.set()
        for t in threads:
            t.join()
        assert sum(t.untyped_storage().nbytes() for t in kept) == KEPT_BYTES
        return kept


    def recorded(i, cpu, before):
        """One iteration inside a recording: its report ends exactly what the threads kept
        above its start. (A function of its own: the recording's exit reads the frame's
        locals, which Python up to 3.12 then keeps alive until the frame returns.)"""
        with torchmem.record("cpu") as rec:
            kept = workload(i)
        run = rec.report().devices["cpu"]
        assert run.start_bytes == before, (i, "start", run.start_bytes, before)
        assert run.end_bytes - run.start_bytes == KEPT_BYTES, (i, "end", run, KEPT_BYTES)
        assert run.peak_bytes >= run.end_bytes, (i, "peak", run)
        held = cpu.used() - before
        assert held == KEPT_BYTES, (i, "held", held, KEPT_BYTES)
        del kept


    def main():
        faulthandler.enable()  # a crash prints every thread's stack too
        iterations = int(sys.argv[1])
        record = "--no-record" not in sys.argv
        cpu = torchmem.meter("cpu")
        assert getattr(cpu, "backend", "") == "allocator", cpu
        first = cpu.used()
        faulthandler.dump_traceback_later(TIMEOUT, exit=True)
        # Warm up (thread pools, TorchScript's first runs), forking after the threads end:
        # a thread's first call of a PyTorch function with a static C++ object registers
        # its destructor under glibc's lock of exit functions, and a DataLoader worker
        # forked meanwhile hangs on that lock at its own first such call (seen once in
        # some 30 runs: torch.full's argument parser). Traced, no thread here takes that
        # lock after the warm-up. PyTorch's and glibc's hazard, not the allocator's.
        workload(-1, fork_meanwhile=False)
        gc.collect()
        start = time.perf_counter()
        for i in range(iterations):
            faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # a hang shows every thread
            before = cpu.used()
            if record:
                recorded(i, cpu, before)
            else:
                kept = workload(i)
                assert cpu.used() - before == KEPT_BYTES, (i, cpu.used() - before)
                del kept
            gc.collect()
            after = cpu.used()
            assert after == before, (i, "after", before, after)
        faulthandler.cancel_dump_traceback_later()
        seconds = time.perf_counter() - start
        print(f"stress: {iterations} iterations in {seconds:.1f}s", flush=True)
        return first


    if __name__ == "__main__":
        first = main()
        at_end = [torch.zeros(n) for n in AT_END]
        if "--numbers" in sys.argv:
            with open(sys.argv[sys.argv.index("--numbers") + 1], "w") as f:
                last = torchmem.meter("cpu").used()
                json.dump({"first": first, "last": last}, f)
    '''
).replace("AT_END_ELEMENTS", repr(AT_END))


def run_child(command: list[str], cwd: Path, name: str, limit: float) -> tuple[int | None, str]:
    """Run `command` in a session of its own, its output to a file (a DataLoader worker
    that outlives a killed parent would hold a pipe open); return its exit code (None where
    it outlived `limit` seconds) and output. Whatever is left of its session is killed."""
    log = cwd / f"{name}.log"
    env = {**os.environ, "STRESS_HANG_SECONDS": str(HANG_SECONDS)}
    with open(log, "wb") as output:
        child = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            left = _stacks_of_session(child.pid) if code != 0 else ""
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return code, log.read_text(errors="replace") + left


def _stacks_of_session(session: int) -> str:
    """The native stacks of every process left in `session` (a DataLoader worker that
    outlived its parent's dump: where it waits), where gdb is installed; else the kernel
    call each of their threads waits in."""
    found = subprocess.run(["ps", "-o", "pid=", "-s", str(session)], capture_output=True, text=True)
    said = []
    for pid in found.stdout.split():
        said.append(f"\n--- process {pid} left in the session ---")
        if shutil.which("gdb"):
            command = ["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt 40"]
            with contextlib.suppress(subprocess.TimeoutExpired):
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
                said.append(done.stdout[-12_000:])
            continue
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            with contextlib.suppress(OSError):
                said.append(f"thread {task.name}: waits in {(task / 'wchan').read_text()}")
    return "\n".join(said)


def verdict(code: int | None, output: str) -> str:
    """Why a run failed, with its output (faulthandler's dump of every thread, for a hang)."""
    if code is None:
        why = "hung past faulthandler's own timeout: killed"
    elif "Timeout (" in output:
        why = f"hung: no iteration may take {HANG_SECONDS}s; faulthandler's dump follows"
    else:
        why = f"exited with {code}"
    return f"{why}\n{output[-20_000:]}"


@pytest.mark.parametrize("run", range(RUNS))
def test_concurrent_threads_forks_and_foreign_threads_neither_hang_nor_miscount(
    run: int, tmp_path: Path
) -> None:
    (tmp_path / "workload.py").write_text(WORKLOAD)
    command = [sys.executable, "workload.py", str(ITERATIONS)]
    code, output = run_child(command, tmp_path, "workload", HANG_SECONDS * (ITERATIONS + 2))
    assert code == 0, verdict(code, output)
    assert f"stress: {ITERATIONS} iterations in" in output, output


@pytest.mark.parametrize("run", range(CLI_RUNS))
def test_torchmem_run_of_the_concurrent_workload_exits_and_reports_exactly(
    run: int, tmp_path: Path
) -> None:
    (tmp_path / "workload.py").write_text(WORKLOAD)
    words = ["--json", "report.json", "workload.py", str(CLI_ITERATIONS), "--numbers", "n.json"]
    command = [sys.executable, "-m", "torchmem", "run", *words]
    code, output = run_child(command, tmp_path, "run", HANG_SECONDS * (CLI_ITERATIONS + 4))
    assert code == 0, verdict(code, output)
    assert f"stress: {CLI_ITERATIONS} iterations in" in output, output
    assert "torchmem: where the memory went" in output  # the report, on stderr
    assert any(line.startswith("cpu ") for line in output.splitlines()), output
    cpu = json.loads((tmp_path / "report.json").read_text())["devices"]["cpu"]
    numbers = json.loads((tmp_path / "n.json").read_text())
    assert cpu["start_bytes"] == numbers["first"]
    assert cpu["end_bytes"] == numbers["last"]
    assert cpu["end_bytes"] - cpu["start_bytes"] == 4 * sum(AT_END)
    assert cpu["peak_bytes"] > cpu["end_bytes"]


LOCALS = textwrap.dedent(
    """\
    import gc

    import torch

    import torchmem

    cpu = torchmem.meter("cpu")


    def block():
        before = cpu.used()
        with torchmem.record("cpu"):
            x = torch.zeros(1 << 20)
        del x
        gc.collect()
        return cpu.used() - before


    print("alive after del:", block())
    """
)


def test_a_recording_in_a_function_keeps_none_of_its_locals_alive(tmp_path: Path) -> None:
    (tmp_path / "locals.py").write_text(LOCALS)
    code, output = run_child([sys.executable, "locals.py"], tmp_path, "locals", 300)
    assert code == 0, verdict(code, output)
    assert "alive after del: 0\n" in output, output
