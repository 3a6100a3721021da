"""What other caching-allocator settings would have reserved for a recorded run.

An allocator history (``torch.cuda.memory._snapshot()``, also a memory snapshot's file)
holds the segments and blocks at its end and a trace of the allocator's actions before
that. :func:`what_if` replays the trace's requests, the allocations and frees in their
order, through the model of the caching allocator (:mod:`torchmem.estimator.allocator`):
first the blocks in use at the trace's start are allocated again (their requests, in
address order), then the trace's allocations and frees follow. Under the settings the
history was recorded with, the replay must reserve and allocate exactly what the real
allocator did (the trace's segment actions and the exact replay of
:mod:`torchmem.estimator.replay` say what that was); only then does it say what each other
setting would have done. On five training steps recorded on an H100 under four settings
each, the replay of each step's default trace predicts the real ``max_memory_reserved()``
and ``max_memory_allocated()`` under every other setting to the byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torchmem.errors import OutOfMemory
from torchmem.estimator.allocator import Layout
from torchmem.estimator.replay import Action, following, replay, start_layout
from torchmem.estimator.settings import DEFAULTS, Settings, parse, recorded
from torchmem.records.whatif import Outcome, WhatIf

ALTERNATIVES = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "garbage_collection_threshold:0.6",
)
"""The settings :func:`what_if` tries by default (``""``: PyTorch's defaults); the one
the history was recorded with is left out."""
ACTIVE = ("active_allocated", "active_pending_free")
RELEASES = ("segment_free", "segment_unmap")


def what_if(
    history: dict[str, Any],
    alternatives: Sequence[str] = ALTERNATIVES,
    *,
    device: int = 0,
    allowed: int | None = None,
) -> WhatIf:
    """Replay `device`'s trace of `history` (``torch.cuda.memory._snapshot()``) under the
    settings it was recorded with and under each of `alternatives`
    (``PYTORCH_CUDA_ALLOC_CONF`` strings, such as ``"expandable_segments:True"``).

    `allowed` is the memory the process may use in bytes, where
    ``torch.cuda.set_per_process_memory_fraction`` set one: ``garbage_collection_threshold``
    acts only then (as in PyTorch), and a replay that needs more runs out of memory. None
    (the default): no fraction, no limit.

    The alternatives are given only where the replay under the recorded settings reproduces
    the real reserved and allocated peaks; where it does not, :attr:`WhatIf.note` says why.
    Cost: linear in the trace's length.

    Raises:
        ValueError: an alternative is not a setting the model follows, or has a bad value
            (the message names it).
    """
    wanted = [parse(conf) for conf in alternatives]
    settings = recorded(history.get("allocator_settings"))
    raw = history.get("device_traces") or []
    trace = [_action(e) for e in (raw[device] if device < len(raw) else [])]
    segments = [s for s in history.get("segments", []) if s.get("device", 0) == device]
    end = [_layout(s) for s in segments]
    requests = _requests(segments, trace)
    start = start_layout(end, trace, settings or DEFAULTS)
    allocations = sum(a.action == "alloc" for a in trace)
    real = _reserved_peak(start, trace)
    found = WhatIf(device, None, allocations, real, 0, None, (), allowed_bytes=allowed)
    if settings is None:
        note = "it was recorded under allocator settings the model does not follow"
        return replace(found, note=note)
    found = replace(found, settings=str(settings))
    if not trace:
        return replace(found, note="it has no trace of this device")
    if not (_consistent(end) and _consistent(start)):
        return replace(found, note="its segments and blocks overlap")
    try:
        return _replays(found, start, trace, requests, settings, wanted, allowed)
    except ValueError as exc:  # segments that overlap once the trace grows them
        return replace(found, today=None, note=f"its segments overlap: {exc}")


def _replays(
    found: WhatIf,
    start: list[Layout],
    trace: list[Action],
    requests: dict[int, int],
    settings: Settings,
    wanted: list[Settings],
    allowed: int | None,
) -> WhatIf:
    """`found` with the exact replay's allocated peak, today's replay and, where it
    reproduces the real peaks, the alternatives."""
    exact = replay(start, trace, settings)
    found = replace(found, allocated_peak_bytes=exact.allocated_peak)
    for kept in (False, True):
        today = _rerun(start, trace, requests, settings, allowed, kept)
        found = replace(found, today=today, kept=kept)
        if not exact.differences and found.reproduced:
            others = [s for s in dict.fromkeys(wanted) if s != settings]
            outcomes = (_rerun(start, trace, requests, s, allowed, kept) for s in others)
            return replace(found, alternatives=tuple(outcomes))
    note = "the model's replay under its settings does not reproduce the real peaks"
    return replace(found, note=note)


def _action(entry: dict[str, Any]) -> Action:
    get = entry.get
    return Action(entry["action"], _int(get("addr")), _int(get("size")), _int(get("stream")))


def _int(value: object, default: int = 0) -> int:
    """`value` where it is a number a snapshot holds (an int64 not negative), else
    `default`: a stream or a request no reader checked."""
    return value if type(value) is int and 0 <= value < 2**63 else default


def _layout(segment: dict[str, Any]) -> Layout:
    used = tuple((b["address"], b["size"]) for b in segment["blocks"] if b["state"] in ACTIVE)
    return Layout(
        segment["address"],
        segment["total_size"],
        _int(segment.get("stream")),
        segment.get("segment_type") == "small",
        used,
        segment.get("is_expandable") is True,
    )


def _requests(segments: list[dict[str, Any]], trace: list[Action]) -> dict[int, int]:
    """The request of each block in use at the trace's start, by address: where the trace
    frees it, the free's; where it is in use at the end too, the snapshot's."""
    found: dict[int, int] = {}
    live: set[int] = set()
    for entry in trace:
        if entry.action == "alloc":
            live.add(entry.address)
        elif entry.action == "free_completed" and entry.address in live:
            live.remove(entry.address)
        elif entry.action == "free_completed":
            found.setdefault(entry.address, entry.size)
    for s in segments:
        for b in s["blocks"]:
            if b["state"] in ACTIVE and b["address"] not in live:
                found.setdefault(b["address"], _int(b.get("requested_size"), b["size"]))
    return found


def _consistent(layouts: list[Layout]) -> bool:
    """Whether no two segments overlap, and each one's blocks lie inside it in address
    order without overlapping (as PyTorch writes them; a file may say otherwise)."""
    at = 0
    for segment in sorted(layouts):
        at = segment.address if segment.address >= at else -1
        for address, size in segment.used:
            at = address + size if address >= at >= 0 and size > 0 else -1
        if at < 0 or at > segment.address + segment.size:
            return False
        at = segment.address + segment.size
    return True


def _reserved_peak(start: list[Layout], trace: list[Action]) -> int:
    """The highest reserved bytes over the trace, from its segment actions."""
    reserved = peak = sum(s.size for s in start)
    for action, _, size, _ in trace:
        if action in ("segment_alloc", "segment_map"):
            reserved += size
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    return peak


def _rerun(
    start: list[Layout],
    trace: list[Action],
    requests: dict[int, int],
    settings: Settings,
    allowed: int | None,
    kept: bool,
) -> Outcome:
    """The trace's requests under `settings`, after those of the blocks in use at its
    start (in address order), or where `kept` with the segments and blocks of its start as
    they were: the model chooses every block and segment itself."""
    model = following(settings, allowed, capped=allowed is not None)
    blocks: dict[int, Any] = {}  # the model's blocks in use, by the trace's addresses
    out = False
    try:
        for segment in sorted(start):  # segments do not overlap: blocks in address order
            if kept:
                blocks.update((b.address, b) for b in model.adopt(segment))
                continue
            for address, size in segment.used:
                blocks[address] = model.malloc(requests.get(address, size), segment.stream)
        model.reserved_peak, model.allocated_peak = model.reserved, model.allocated
        model.at_peak = (model.reserved, model.largest_free())
        emptied = False
        for action, address, size, stream in trace:
            if action == "alloc":
                blocks[address] = model.malloc(size, stream)
            elif action == "free_completed" and address in blocks:
                model.free(blocks.pop(address))
            elif action in RELEASES and not emptied:
                model.empty_cache()  # the trace's releases: empty_cache() (the model's own
                # releases, short of memory, follow from its requests)
            emptied = action in RELEASES
    except OutOfMemory:
        out = True
    reserved, largest = model.at_peak
    return Outcome(str(settings), model.reserved_peak, model.allocated_peak, reserved, largest, out)
