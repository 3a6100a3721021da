r"""Does the tool catch the real peak? Three spikes, each run several times, watched by
torchmem's tracer and cell logger, by ipyexperiments' ``CellLogger`` (in a real IPython
shell) and by a 1 ms polling thread (the method of fastai's ``GPUMemTrace``, applied to
the process's RSS).

The spikes, each 256 MiB by default and gone again when the call returns:

- ``GIL held``: ``len(b"\x01" * size)``, a bytes buffer allocated, filled and freed
  without the GIL being released in between, so no Python thread can run while it exists;
- ``F.cross_entropy``: the temporary ``log_softmax`` inside one ``torch.nn.functional``
  call on 256 MiB of logits (which exist before the call, so they are not the spike);
- ``numpy``: ``np.ones`` summed.

The truth is the bytes the spike adds at its height: the buffer, plus for
``cross_entropy`` the two 4-byte scalars ``nll_loss`` allocates while the temporary is
alive. Each contender reports "peaked" (how far memory rose above both the start and
the end); a contender *caught* the spike when it saw at least half of it. The error is
the reported peak minus the truth, and the table shows the worst of the runs.

Tools that read RSS (every contender but the CPU meter) cannot be exact to the byte:
RSS counts whole pages, the allocator adds a header page to a large buffer, and Linux
keeps RSS in per-CPU counters that the high-water mark reads without summing.
"""

from __future__ import annotations

import contextlib
import gc
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import torch

import torchmem

SIZE = 2**28
"""Bytes of each spike: 256 MiB."""


@dataclass(frozen=True)
class Spike:
    name: str
    run: Callable[[], object]
    """The spike: allocates and frees it, returns something small."""
    truth: int
    """Bytes the spike adds at its height."""
    tensors: bool
    """Made of PyTorch tensors, so the CPU meter sees it."""


def spikes(size: int = SIZE) -> list[Spike]:
    """The three spikes of `size` bytes each: a multiple of 4 KiB, and above glibc's
    largest mmap threshold (32 MiB), so that each run takes fresh pages and frees gives
    them back; the logits of the ``cross_entropy`` spike live as long as the spikes do."""
    logits = torch.ones(size // 4 // 1024, 1024)
    target = torch.zeros(len(logits), dtype=torch.long)

    def gil_held() -> int:
        return len(b"\x01" * size)

    def cross_entropy() -> float:
        return torch.nn.functional.cross_entropy(logits, target).item()

    def numpy_ones() -> int:
        return int(np.ones(size, dtype=np.uint8).sum())

    return [
        Spike("GIL held (bytes)", gil_held, size, tensors=False),
        Spike("F.cross_entropy", cross_entropy, logits.nbytes + 2 * 4, tensors=True),
        Spike("numpy", numpy_ones, size, tensors=False),
    ]


def cuda_spike(size: int = SIZE) -> Spike:
    """The ``cross_entropy`` spike on the current GPU: its two scalars take a 512-byte
    block each in CUDA's caching allocator."""
    logits = torch.ones(size // 4 // 1024, 1024, device="cuda")
    target = torch.zeros(len(logits), dtype=torch.long, device="cuda")

    def cross_entropy() -> float:
        return torch.nn.functional.cross_entropy(logits, target).item()

    return Spike("F.cross_entropy on CUDA", cross_entropy, logits.nbytes + 2 * 512, True)


# Contenders: each runs the spike once under its tool and returns the peak it reports,
# in bytes, or why it cannot measure this spike.

Contender = Callable[[Spike], "int | str"]


def trace(device: str) -> Contender:
    def measure(spike: Spike) -> int | str:
        if device == "cpu" and not spike.tensors:
            return "not a tensor"
        with torchmem.MemTrace(device=device, silent=True, on_exit_report=False) as t:
            spike.run()
        return t.peaked_bytes

    return measure


def poller(read: Callable[[], int], interval: float = 0.001) -> Contender:
    """A thread that calls `read` every `interval` seconds while the spike runs."""

    def measure(spike: Spike) -> int:
        gc.collect()
        start = read()
        peak = start
        running = threading.Event()
        done = threading.Event()

        def poll() -> None:
            nonlocal peak
            running.set()
            while not done.is_set():
                peak = max(peak, read())
                done.wait(interval)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        running.wait()
        spike.run()
        done.set()
        thread.join()
        end = read()
        return max(0, peak - max(start, end))

    return measure


class Shell:
    """A real IPython shell that runs each spike as a cell, with output discarded."""

    def __init__(self) -> None:
        from IPython.core.interactiveshell import InteractiveShell

        self.shell = InteractiveShell.instance()

    def run(self, cell: str, **names: object) -> None:
        self.shell.user_ns.update(names)
        with contextlib.redirect_stdout(io.StringIO()):
            result = self.shell.run_cell(cell)
        result.raise_error()

    def close(self) -> None:
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()


def torchmem_cells(shell: Shell, row: str) -> Contender:
    """torchmem's ``CellLogger``: its RAM row (``"gen"``) or its tensor row (``"gpu"``,
    CPU tensors on a machine without a GPU)."""

    def measure(spike: Spike) -> int | str:
        if row == "gpu" and not spike.tensors:
            return "not a tensor"
        if row == "gpu" and torch.cuda.is_available():
            return "the row is the GPU's on this machine"
        logger = torchmem.CellLogger(shell=shell.shell)
        shell.run("logger.start()", logger=logger)
        shell.run("spike();", spike=spike.run)
        shell.run("logger.stop()")
        record = logger.history[-1]
        return record.gen_peaked if row == "gen" else record.gpu_peaked

    return measure


def ipyexperiments_cells(shell: Shell) -> Contender:
    """ipyexperiments' ``CellLogger`` (CPU backend): a thread spins on RSS while a cell
    runs."""
    from ipyexperiments import IPyExperimentsCPU

    def measure(spike: Spike) -> int:
        shell.run("exp = IPyExperimentsCPU(exp_enable=False)", IPyExperimentsCPU=IPyExperimentsCPU)
        shell.run("spike();", spike=spike.run)
        exp = shell.shell.user_ns["exp"]
        peaked = exp.cl.data.cpu.peaked_delta
        shell.run("exp.finish()")
        return peaked

    return measure


@dataclass(frozen=True)
class Result:
    spike: str
    contender: str
    truth: int
    found: tuple[int, ...] | None
    """The peak reported in each run, bytes; None where the contender cannot measure this
    spike (`note` says why) or its package is not installed."""
    note: str = ""

    @property
    def caught(self) -> int:
        return sum(found >= self.truth / 2 for found in self.found or ())

    @property
    def worst_error(self) -> int:
        assert self.found is not None
        return max((found - self.truth for found in self.found), key=abs)


def contenders(shell: Shell) -> dict[str, Contender | None]:
    """Name -> contender; None for a contender whose package is not installed."""
    process = psutil.Process()
    found: dict[str, Contender | None] = {
        "torchmem MemTrace (RAM, VmHWM)": trace("ram"),
        "torchmem MemTrace (CPU tensors)": trace("cpu"),
        "torchmem CellLogger (RAM row)": torchmem_cells(shell, "gen"),
        "torchmem CellLogger (tensor row)": torchmem_cells(shell, "gpu"),
        "ipyexperiments CellLogger (RSS thread)": None,
        "1 ms RSS polling thread": poller(lambda: process.memory_info().rss),
    }
    with contextlib.suppress(ImportError):
        found["ipyexperiments CellLogger (RSS thread)"] = ipyexperiments_cells(shell)
    return found


def run(cases: list[Spike], named: dict[str, Contender | None], repeat: int) -> list[Result]:
    """Every contender on every spike, `repeat` times, contenders alternating."""
    results = []
    for spike in cases:
        runs: dict[str, list[int | str]] = {name: [] for name in named}
        for _ in range(repeat):
            for name, contender in named.items():
                if contender is not None:
                    runs[name].append(contender(spike))
        for name, contender in named.items():
            found = runs[name]
            if contender is None:
                results.append(Result(spike.name, name, spike.truth, None, "not installed"))
            elif any(isinstance(value, str) for value in found):
                why = next(value for value in found if isinstance(value, str))
                results.append(Result(spike.name, name, spike.truth, None, why))
            else:
                peaks = tuple(value for value in found if isinstance(value, int))
                results.append(Result(spike.name, name, spike.truth, peaks))
    return results


def measure(repeat: int = 5, size: int = SIZE) -> list[Result]:
    """The CPU spikes, in a real IPython shell for the cell loggers."""
    shell = Shell()
    try:
        return run(spikes(size), contenders(shell), repeat)
    finally:
        shell.close()


def measure_cuda(repeat: int = 5, size: int = SIZE) -> list[Result]:
    """The spike on the current GPU: torchmem's tracer on the caching allocator against
    a 1 ms thread polling ``torch.cuda.memory_allocated``."""
    named: dict[str, Contender | None] = {
        "torchmem MemTrace (CUDA allocator)": trace("cuda"),
        "1 ms torch.cuda.memory_allocated polling thread": poller(torch.cuda.memory_allocated),
    }
    return run([cuda_spike(size)], named, repeat)


def table(results: list[Result]) -> str:
    lines = [
        "| spike | contender | caught | worst error |",
        "| --- | --- | ---: | ---: |",
    ]
    for r in results:
        if r.found is None:
            lines.append(f"| {r.spike} | {r.contender} | {r.note} | - |")
        else:
            lines.append(
                f"| {r.spike} | {r.contender} | {r.caught}/{len(r.found)} | {r.worst_error:+,} B |"
            )
    return "\n".join(lines)
