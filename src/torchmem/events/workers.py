"""The DataLoader workers of a recorded process, and each one's peak RSS, read from /proc.

PyTorch's DataLoader workers name themselves ``pt_data_worker``. A thread finds them among
the process's children and grandchildren (a forkserver's children are its workers), from
``/proc/self/task/*/children``, and reads each one's ``VmHWM`` from ``/proc/<pid>/status``
every :data:`INTERVAL` seconds: the highest resident set size the kernel saw in that
process since it started. A worker's peak is its mark at the last reading before it
ended, so a rise after that reading is missed: the peaks are sampled. The kernel reads the
RSS it reports from per-CPU counters without folding them in, so a reading can be a few pages
off (a later one lower by 8 KiB has been seen). Linux only; where there is no ``/proc``, no
worker is found.
"""

from __future__ import annotations

import os
import threading
import time

from torchmem.meters.base import background_thread
from torchmem.records.workers import Worker, Workers

INTERVAL = 0.05
"""Seconds between two readings."""
NAME = "pt_data_worker"
"""What a DataLoader worker calls itself (``/proc/<pid>/comm``), once it has started."""


class WorkerSampler:
    """Reads the DataLoader workers' peaks from a thread, from :meth:`begin` to :meth:`end`."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], list[int]] = {}
        """(pid, start time in clock ticks) -> [peak RSS, first seen, last seen] (bytes,
        ``time.monotonic_ns()``): a pid the kernel gives again is another worker."""
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._origin = 0

    def begin(self, origin: int) -> None:
        """Start reading; times are counted from `origin` (``time.monotonic_ns()``)."""
        self._origin = origin
        self._read()
        self._thread = background_thread(self._run, "torchmem-workers")
        self._thread.start()

    def end(self, stop: int) -> Workers:
        """Stop reading, after one last reading, which counts as made at `stop` (the
        recording's end, ``time.monotonic_ns()``); the workers seen."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        self._read()
        found = [
            Worker(
                pid,
                peak,
                (min(first, stop) - self._origin) / 1e9,
                (min(last, stop) - self._origin) / 1e9,
            )
            for (pid, _), (peak, first, last) in self._seen.items()
        ]
        return Workers(tuple(sorted(found, key=lambda w: (w.first_seen, w.pid))), INTERVAL)

    def _run(self) -> None:
        while not self._halt.wait(INTERVAL):
            self._read()

    def _read(self) -> None:
        now = time.monotonic_ns()
        for pid in _descendants():
            found = _worker(pid)
            if found is None:
                continue
            key, peak = found
            entry = self._seen.setdefault(key, [peak, now, now])
            entry[0], entry[2] = max(entry[0], peak), now


def _children(pid: int | str) -> list[int]:
    """The children of process `pid` (of each of its threads); none where it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as file:
                found += [int(child) for child in file.read().split()]
        except OSError:  # a thread gone meanwhile
            continue
    return found


def _descendants() -> list[int]:
    """This process's children and their children."""
    children = _children("self")
    return children + [grandchild for child in children for grandchild in _children(child)]


def _worker(pid: int) -> tuple[tuple[int, int], int] | None:
    """``((pid, start time), VmHWM in bytes)`` of process `pid` where it is a DataLoader
    worker, alive; else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
        if stat[stat.index(b"(") + 1 : stat.rindex(b")")] != NAME.encode():
            return None
        started = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: starttime
        with open(f"/proc/{pid}/status", "rb") as file:
            status = file.read()
    except (OSError, ValueError):  # gone meanwhile
        return None
    for line in status.splitlines():
        if line.startswith(b"VmHWM:"):
            return (pid, started), int(line.split()[1]) * 1024
    return None  # a zombie: its memory is gone already


def unrecorded(received: int, seen: Workers | None) -> list[str]:
    """The note that the RAM of the processes that made `received` storages (which came
    through shared memory) was not recorded, where no worker was `seen` (None: no worker
    was looked for)."""
    if not received or (seen is not None and seen.processes):
        return []
    why = (
        "no DataLoader worker was found among this process's children in /proc"
        if seen is not None
        else "it is read where the recording measures process RAM, on Linux"
    )
    return [
        f"{received:,} tensor storages came from other processes through shared memory (a"
        " DataLoader's workers, torch.multiprocessing): counted here from their arrival; the"
        f" RAM of the processes that made them was not recorded ({why})."
    ]
