"""A recording in PyTorch's memory snapshot format: the dictionary
``torch.cuda.memory._snapshot()`` returns and ``_dump_snapshot`` pickles, so that
PyTorch's own viewer (``pytorch.org/memory_viz``) and ``torch.cuda._memory_viz`` open a
CPU run as they open a CUDA one.

- CUDA devices: PyTorch's own history, as the caching allocator recorded it.
- CPU tensors: built from the counting allocator's log, as tallied. CPU memory has no
  cache, so each allocation alive at the end is a segment of its own holding one
  ``active_allocated`` block (reserved equals allocated), and the trace has, for each
  allocation, ``segment_alloc`` then ``alloc``, and for each free ``free_requested``,
  ``free_completed`` then ``segment_free``: for the latest
  :data:`~torchmem.events.tally.WINDOW` allocations and frees (the tally keeps no
  more), as PyTorch's own history keeps only its latest actions. Frames are the
  allocating line of the user's code (one frame; none for storages that were alive when
  the recording started). The CPU's index in ``device_traces`` is the one after the
  GPUs' (0 without GPUs), as in PyTorch's ``_profile_to_snapshot``.
"""

from __future__ import annotations

import time
from typing import Any

from torchmem.events.sources import Tallied
from torchmem.events.tally import BEFORE_SITE, PTR, SITE, SIZE, TIME
from torchmem.records.snapshot import DEVICE_NAMES

Frame = dict[str, Any]


def cpu_snapshot_parts(
    found: Tallied, device: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The segments alive at the end, and the trace, of the CPU recording `found`, as
    device `device`."""
    # time.monotonic_ns() in the log; PyTorch's time_us is microseconds since the epoch.
    offset = time.time_ns() - time.monotonic_ns()

    def frames_of(site: int) -> list[Frame]:
        key = found.sites.get(site) if site != BEFORE_SITE else None
        return [] if key is None else [{"filename": key[0], "line": key[1], "name": key[2]}]

    live = found.tally.live
    segments = [
        _segment(device, address, size, frames_of(site))
        for address, size, site in zip(
            live.ptr.tolist(), live.size.tolist(), live.site.tolist(), strict=True
        )
    ]
    trace: list[dict[str, Any]] = []
    made: dict[int, list[Frame]] = {}  # address -> the frames of its allocation
    rows = found.tally.recent_rows()
    for when, address, size, site in rows[:, [TIME, PTR, SIZE, SITE]].tolist():
        time_us = (when + offset) // 1000
        if size > 0:
            frames = made[address] = frames_of(site)
            for action in ("segment_alloc", "alloc"):
                trace.append(_entry(action, address, size, time_us, frames))
        else:
            frames = made.pop(address, [])
            for action in ("free_requested", "free_completed", "segment_free"):
                trace.append(_entry(action, address, -size, time_us, frames))
    segments.sort(key=lambda segment: segment["address"])
    return segments, trace


def snapshot(cpu: Tallied | None, cuda: dict[str, Any] | None) -> dict[str, Any]:
    """The snapshot of a recording: PyTorch's CUDA history `cuda` (``_snapshot()``'s
    dictionary, or None), with the CPU `log` (or None) as the device after the GPUs, and
    the name of each device under :data:`~torchmem.records.snapshot.DEVICE_NAMES`."""
    segments = list(cuda["segments"]) if cuda else []
    traces = [list(t) for t in cuda["device_traces"]] if cuda else []
    names = [f"cuda:{index}" for index in range(len(traces))]
    if cpu is not None:
        cpu_segments, cpu_trace = cpu_snapshot_parts(cpu, len(traces))
        segments += cpu_segments
        traces.append(cpu_trace)
        names.append("cpu")
    return {"segments": segments, "device_traces": traces, DEVICE_NAMES: names}


def _entry(
    action: str, address: int, size: int, time_us: int, frames: list[Frame]
) -> dict[str, Any]:
    return {
        "action": action,
        "addr": address,
        "size": size,
        "stream": 0,
        "time_us": time_us,
        "frames": frames,
    }


def _segment(device: int, address: int, size: int, frames: list[Frame]) -> dict[str, Any]:
    block = {
        "address": address,
        "size": size,
        "requested_size": size,
        "state": "active_allocated",
        "frames": frames,
    }
    return {
        "device": device,
        "address": address,
        "total_size": size,
        "allocated_size": size,
        "active_size": size,
        "requested_size": size,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": frames,
        "blocks": [block],
    }
