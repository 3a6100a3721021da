"""A run's DataLoader workers (:class:`~torchmem.records.workers.Workers`): a section of
the run's report, after its devices."""

from __future__ import annotations

from torchmem.records.workers import Workers
from torchmem.render.kit import SAMPLED, Section, seconds, size


def section(workers: Workers | None) -> Section | None:
    """One row per worker: its pid, its peak RSS (sampled), when it was first and last
    seen; None where no worker was seen (or none was looked for)."""
    if workers is None or not workers.processes:
        return None
    rows = [
        (
            str(worker.pid),
            size(worker.peak_rss_bytes, mark=SAMPLED),
            seconds(worker.first_seen),
            seconds(worker.last_seen),
        )
        for worker in workers.processes
    ]
    return Section(
        "DataLoader workers (processes of their own):",
        rows,
        header=("worker pid", "peak RSS", "first seen", "last seen"),
        more=(
            f"{SAMPLED} sampled: read from /proc every {workers.interval:g}s (a rise after"
            " the last reading is missed); RSS counts the pages a worker shares with this"
            " process (inherited at fork, batches in shared memory)."
        ),
    )
