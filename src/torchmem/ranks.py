"""Per-rank reports of a multi-process job, gathered with ``torch.distributed``.

Two ways in, one record out (:class:`RanksReport`):

* :func:`gather_reports`, called by every rank of a running job, sends each rank's
  :class:`~torchmem.records.run.RunRecord` through the job's own process group;
* :class:`Launch` serves ``torchmem run`` under ``torchrun`` (or any launcher that sets
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``): the reports travel
  through the launcher's key-value store (``torch.distributed.TCPStore``), which does not
  depend on the script's process group: that group may be gone, or stuck in a collective
  that a failed rank never joined, and an NCCL group would carry the reports through the
  GPU memory being measured.

Reports travel as JSON (:meth:`RunRecord.to_json`), never as pickles.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from torchmem.errors import UsageError
from torchmem.records import TOP
from torchmem.records.ranks import Elsewhere, Imbalance, RankRun, RanksRecord
from torchmem.records.run import CATEGORIES, RunRecord
from torchmem.report import Report

POLL = 0.05
"""Seconds between two looks at the store while waiting for other ranks."""
GRACE = 10.0
"""Seconds the ranks wait for each other once a rank's script has failed: a rank still
running is likely stuck in a collective the failed one never joined, until its backend's
timeout (10 to 30 minutes), and the launcher stops every rank once the failed one exits."""
CONNECT_TIMEOUT = timedelta(minutes=5)
"""How long a rank tries to reach the launcher's store."""


@dataclass(frozen=True)
class RanksReport(RanksRecord, Report):
    """What :func:`gather_reports` returns (the fields are :class:`RanksRecord`'s): prints
    as the per-rank table, shows as HTML in Jupyter, saves JSON and an HTML page."""

    renderer = "ranks"
    top: int = TOP
    """How many sites, allocations and modules the highest rank's detail lists."""


def gather_reports(
    report: RunRecord, *, group: Any = None, dst: int | None = 0, top: int = TOP
) -> RanksReport | None:
    """Gather every rank's report; every rank of `group` must call it.

    ``with torchmem.record() as rec: train()`` then
    ``ranks = torchmem.gather_reports(rec.report())`` and, on rank 0, ``print(ranks)``.

    Args:
        report: this rank's report (:meth:`torchmem.Recording.report`).
        group: the process group (default: the job's default group). With NCCL the
            reports (a few KiB of JSON each) pass through the current GPU: call
            ``torch.cuda.set_device`` first, as for any NCCL collective.
        dst: the global rank that gets the result; None gives it to every rank.
        top: how many sites, allocations and modules the printed detail lists.

    Returns:
        The reports of every rank of `group`, in rank order, on `dst` (every rank where
        `dst` is None); None on the other ranks.

    Raises:
        UsageError: ``torch.distributed`` has no process group yet (a RuntimeError).
        ValueError: `dst` is not a rank of `group`, or `top` is below 1.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "torch.distributed has no process group: call init_process_group first,"
            " or run the script with `torchrun ... -m torchmem run script.py`"
        )
    if top < 1:
        raise ValueError(f"top must be at least 1, not {top!r}")
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    if dst is not None and dst not in ranks:
        raise ValueError(f"dst={dst!r} is not a rank of the group (its ranks: {ranks})")
    payloads: list[Any] = [None] * world
    dist.all_gather_object(payloads, _payload(dist.get_rank(), report), group=group)
    if dst is not None and dist.get_rank() != dst:
        return None
    return assemble([json.loads(p) for p in payloads], ranks, top=top)


def _payload(rank: int, report: RunRecord, error: str | None = None) -> str:
    gpus = {}
    if torch.cuda.is_available():
        from torchmem.meters import nvml

        gpus = {f"cuda:{i}": size for i, size in nvml.process_memory(os.getpid()).items()}
    return json.dumps(
        {
            "rank": rank,
            "host": socket.gethostname(),
            "error": error,
            "gpu_process_bytes": gpus,
            "report": report.to_json(),
        }
    )


def assemble(
    payloads: Sequence[Mapping[str, Any]], ranks: Sequence[int], *, top: int = TOP
) -> RanksReport:
    """The report of `ranks` (global ranks) from the payloads that arrived; the ranks
    whose payload did not are missing."""
    runs = sorted(
        (
            RankRun(
                p["rank"],
                p["host"],
                RunRecord.from_json(p["report"]),
                p["error"],
                p["gpu_process_bytes"],
            )
            for p in payloads
        ),
        key=lambda run: run.rank,
    )
    arrived = {run.rank for run in runs}
    missing = tuple(rank for rank in ranks if rank not in arrived)
    return RanksReport(tuple(runs), len(ranks), missing, imbalance(runs), elsewhere(runs), top=top)


def elsewhere(runs: Sequence[RankRun]) -> tuple[Elsewhere, ...]:
    """Memory each rank whose main device is a GPU held on other GPUs (NVML's numbers)."""
    found = []
    for run in runs:
        main = run.report.main_device
        if main.startswith("cuda"):
            found += [
                Elsewhere(run.rank, device, size)
                for device, size in run.gpu_process_bytes.items()
                if device != main and size > 0
            ]
    return tuple(found)


def imbalance(runs: Sequence[RankRun]) -> Imbalance | None:
    """How unevenly `runs` peaked on their main devices, of the kind most of them have;
    None with fewer than two such ranks."""
    mains = [(run, run.report.devices.get(run.report.main_device)) for run in runs]
    peaks = [(run.rank, device) for run, device in mains if device is not None]
    kinds = [device.device.partition(":")[0] for _, device in peaks]
    if not kinds:
        return None
    kind = max(dict.fromkeys(kinds), key=kinds.count)
    peaks = [(rank, d) for rank, d in peaks if d.device.partition(":")[0] == kind]
    if len(peaks) < 2:
        return None
    high = max(peaks, key=lambda p: (p[1].peak_bytes, -p[0]))
    low = min((p for p in peaks if p is not high), key=lambda p: (p[1].peak_bytes, p[0]))
    found = Imbalance(kind, high[0], high[1].peak_bytes, low[0], low[1].peak_bytes, None)
    categories = [(rank, d.categories_at_peak) for rank, d in peaks if d.categories_at_peak]
    if len(categories) < 2:
        return found
    best: tuple[int, str, tuple[int, int], tuple[int, int]] | None = None
    names = dict.fromkeys([*CATEGORIES, *(n for _, c in categories for n in c)])
    for name in names:
        values = [(c.get(name, 0), rank) for rank, c in categories]
        most = max(values, key=lambda v: (v[0], -v[1]))
        least = min(values)
        spread = most[0] - least[0]
        if spread > 0 and (best is None or spread > best[0]):
            best = (spread, name, most, least)
    if best is None:
        return found
    _, name, most, least = best
    return Imbalance(
        kind,
        high[0],
        high[1].peak_bytes,
        low[0],
        low[1].peak_bytes,
        name,
        category_high_rank=most[1],
        category_high_bytes=most[0],
        category_low_rank=least[1],
        category_low_bytes=least[0],
    )


class Launch:
    """This process's place in a job a launcher started (``torchrun``): its rank, the
    job's size, and the launcher's store, through which ``torchmem run`` gathers the
    reports on rank 0.

    :meth:`connect` before the script runs (rank 0 may host the store, and the script's
    own ``init_process_group`` then shares it); :meth:`exchange` after.
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.rank = _integer(environ, "RANK")
        self.world_size = _integer(environ, "WORLD_SIZE")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is not below WORLD_SIZE={self.world_size}")
        self.address = environ["MASTER_ADDR"]
        self.port = _integer(environ, "MASTER_PORT")
        # torchrun's agent hosts the store; other launchers leave it to rank 0.
        self.agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        run = environ.get("TORCHELASTIC_RUN_ID", "job")
        self.prefix = f"torchmem/{run}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._store: Any = None

    @staticmethod
    def from_environ(environ: Mapping[str, str] | None = None) -> Launch | None:
        """The launch described by `environ` (default: ``os.environ``); None where it
        does not name a rank, a world size and a store address, or where the job is one
        process: a single process then, with nothing to gather.

        Raises:
            ValueError: one of those variables has a bad value; the message names it.
        """
        environ = os.environ if environ is None else environ
        needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(environ.get(name) for name in needed):
            return None
        launch = Launch(environ)
        return launch if launch.world_size > 1 else None

    def connect(self) -> None:
        """Reach the launcher's store (or, on rank 0 without torchrun's agent, host it)."""
        # Documented as torch.distributed's, but not in its __all__.
        from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

        master = self.rank == 0 and not self.agent_store
        store = TCPStore(
            self.address,
            self.port,
            self.world_size,
            is_master=master,
            timeout=CONNECT_TIMEOUT,
            wait_for_workers=False,
            multi_tenant=master,
        )
        self._store = PrefixStore(self.prefix, store)

    def exchange(
        self, report: RunRecord, error: str | None = None, *, top: int = TOP
    ) -> RanksReport | None:
        """Send this rank's report; return the reports to print here, or None.

        Rank 0 waits for every rank's report and returns them all. It stops waiting
        early, and returns what arrived (the rest as missing), when it is asked to
        terminate (``SIGTERM``: the launcher does that once a rank died), or :data:`GRACE`
        seconds after it learns that a rank's script failed: the other ranks may be stuck
        in a collective that the failed rank never joined.

        A rank whose script failed waits until rank 0 has printed (:meth:`finish`), so
        that its exit does not make the launcher stop rank 0 first. Where rank 0 has not
        printed within :data:`GRACE` seconds (it may be stuck, or dead), one such rank
        returns what arrived, to print it instead. Every other rank returns None at once.
        """
        store = self._store
        if store is None:
            raise UsageError("connect() first")
        failed = bool(report.exit_code)
        store.set(f"report/{self.rank}", _payload(self.rank, report, error))
        if failed:
            store.add("failed", 1)
        store.add("sent", 1)
        if self.rank == 0:
            store.set("gathering", "1")
            everyone = lambda: store.add("sent", 0) >= self.world_size  # noqa: E731
            _wait_for(everyone, failure=lambda: failed or store.add("failed", 0) > 0)
            return self._arrived(top)
        if not failed:
            return None
        try:
            # Rank 0 prints within GRACE once it is gathering; until then it may be stuck.
            deadline = time.monotonic() + GRACE

            def settled() -> bool:
                if store.check(["printed"]):
                    return True
                return time.monotonic() >= deadline and not store.check(["gathering"])

            _wait_for(settled, failure=lambda: False)
            if store.check(["printed"]):
                return None
            # One of the failed ranks prints, the first to claim it.
            if store.compare_set("printer", "", str(self.rank)) != str(self.rank).encode():
                return None
            return self._arrived(top)
        except RuntimeError:  # the store went away with rank 0
            return None

    def _arrived(self, top: int) -> RanksReport:
        store = self._store
        keys = [f"report/{rank}" for rank in range(self.world_size)]
        payloads = [json.loads(store.get(key)) for key in keys if store.check([key])]
        return assemble(payloads, range(self.world_size), top=top)

    def finish(self) -> None:
        """On rank 0, after printing: tell the ranks whose scripts failed that they may
        exit now."""
        if self._store is not None and self.rank == 0:
            self._store.set("printed", "1")


def _wait_for(done: Callable[[], bool], *, failure: Callable[[], bool]) -> None:
    """Poll `done` until it is true, until ``SIGTERM`` arrives, or until :data:`GRACE`
    seconds after `failure` first said true."""
    stopped: list[int] = []
    previous = None
    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        previous = signal.signal(signal.SIGTERM, lambda number, frame: stopped.append(number))
    failed_at = None
    try:
        while not stopped and not done():
            now = time.monotonic()
            if failed_at is None and failure():
                failed_at = now
            if failed_at is not None and now - failed_at >= GRACE:
                return
            time.sleep(POLL)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None
