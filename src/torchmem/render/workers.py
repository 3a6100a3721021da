"""A run's DataLoader workers (:class:`~torchmem.records.workers.Workers`): a section of
the run's report, after its devices."""

from __future__ import annotations

from torchmem.records.workers import Workers
from torchmem.render.kit import SAMPLED, Section, more, seconds, size


def section(workers: Workers | None, top: int) -> Section | None:
    """One row per worker, the `top` highest peaks first: its pid, its peak RSS (sampled),
    when it was first and last seen; None where no worker was seen (or none looked for)."""
    if workers is None or not workers.processes:
        return None
    ranked = sorted(workers.processes, key=lambda w: -w.peak_rss_bytes)
    rows = [
        (
            str(worker.pid),
            size(worker.peak_rss_bytes, mark=SAMPLED),
            seconds(worker.first_seen),
            seconds(worker.last_seen),
        )
        for worker in ranked[:top]
    ]
    said = (
        f"{SAMPLED} sampled: read from /proc every {workers.interval:g}s (a rise after the last"
        " reading is missed); RSS counts the pages a worker shares with this process"
        " (inherited at fork, batches in shared memory)."
    )
    left = more(len(ranked) - len(rows), "worker")
    return Section(
        "DataLoader workers (processes of their own):",
        rows,
        header=("worker pid", "peak RSS", "first seen", "last seen"),
        more=f"{left}. {said}" if left else said,
    )
