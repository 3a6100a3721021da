"""PyTorch memory snapshots, read offline and safely.

A snapshot (``torch.cuda.memory._dump_snapshot(path)``) is a pickle of
``torch.cuda.memory._snapshot()``: the caching allocator's segments and their blocks, and
per device a trace of its recent actions. A pickle can run any code when loaded, so
:func:`load_snapshot` reads it with an unpickler that builds plain data only, in time and
memory bounded by the file's size (:mod:`torchmem.records.snapshot_file`): nothing from
the file runs.

The trace is a ring buffer: it may start in the middle of a run. Its replay (allocations
add the bytes of their blocks, completed frees subtract them) is therefore anchored at its
end, where it must equal the bytes the snapshot's segments hold active on that device
(``active_allocated`` and ``active_pending_free`` blocks: a freed block counts until its
free completes); the bytes in use when the trace starts follow from that. Blocks, not the
requests the trace records (:mod:`torchmem.records.caching`): ``max_memory_allocated()``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from torchmem.errors import SnapshotError
from torchmem.records import TOP
from torchmem.records.caching import NO_LIMIT, read_trace, replay_trace, timeline
from torchmem.records.frames import Frame, SiteKey, Stack, stack_site
from torchmem.records.run import Site
from torchmem.records.sites import sites_of
from torchmem.records.snapshot import (
    DEVICE_NAMES,
    OOM,
    Block,
    DeviceSnapshot,
    Segment,
    SiteChange,
    SnapshotDiffRecord,
    SnapshotRecord,
)
from torchmem.records.snapshot_file import SnapshotUnpickler as _Unpickler, open_regular, without_gc
from torchmem.report import Report

ACTIVE = ("active_allocated", "active_pending_free")
"""The states of a block in use."""
MAX_POINTS = 2000
"""A timeline has at most this many intervals."""
NO_FRAMES = "<no frames>"
"""The site of an allocation recorded without a Python stack (PyTorch's own threads)."""
BEFORE_TRACE = "<before the trace>"
"""The site of the bytes allocated before the trace's first entry."""
LIMIT = 2**63
"""Every number of a snapshot is below this, and not negative: PyTorch writes int64s."""
MAX_STACK_FRAMES = 1_000_000
"""A snapshot's sites keep stacks of this many Python frames in all, devices in order,
largest sites first: a site past them keeps none. A few bytes of a hostile file can make one
long stack the stack of a site on each of thousands of devices; PyTorch's are tens of
frames."""


def load_snapshot(path: str | Path, what_if: bool = False) -> Snapshot:
    """Read the memory snapshot at `path` (``torch.cuda.memory._dump_snapshot(path)``)
    without running anything from it. With `what_if`, each device's trace is also replayed
    under other allocator settings (:func:`torchmem.estimator.whatif.what_if`, its
    defaults): :attr:`DeviceSnapshot.what_if`.

    Raises:
        SnapshotError: the file is not a regular file (refused before it is opened), not a
            pickle, not a snapshot, or asks for anything but plain data (a class, a
            function, an extension code: refused before anything runs).
        OSError: the file cannot be read.
    """
    name = str(path)
    with open_regular(path) as file, without_gc():
        try:
            data = _Unpickler(file, name).load()
        except SnapshotError:
            raise
        except Exception as exc:  # a damaged pickle fails anywhere in the opcode loop
            raise SnapshotError(f"{name} is not a pickle: {exc}") from None
        snapshot = Snapshot.from_dict(data, name, what_if)
        del data  # freed while the collector still pauses, which would walk all of it once more
    return snapshot


@dataclass(frozen=True)
class Snapshot(SnapshotRecord, Report):
    """A memory snapshot, analysed (the fields are :class:`SnapshotRecord`'s): prints as
    text, shows as HTML in Jupyter, saves JSON and a self-contained HTML page, compares
    with another snapshot."""

    renderer = "snapshot"
    top: int = TOP
    """How many sites and segments the text and HTML list."""

    @classmethod
    def from_dict(cls, data: object, source: str = "", what_if: bool = False) -> Snapshot:
        """Analyse a snapshot in memory (``torch.cuda.memory._snapshot()``); `source`
        names it in reports and errors; `what_if` as :func:`load_snapshot`.

        Raises:
            SnapshotError: `data` is not a snapshot; the message says what is wrong.
        """
        with without_gc():
            devices = _Reader(source).devices(data)
            if what_if and isinstance(data, dict):  # it is, or the reader failed
                from torchmem.estimator.whatif import what_if as replayed

                for i, d in devices.items():  # a GPU's trace: the CPU's has no cache
                    if d.entries and d.name.startswith("cuda"):
                        devices[i] = replace(d, what_if=replayed(data, device=i))
            return cls(devices, source)

    def diff(self, later: Snapshot) -> SnapshotDiff:
        """What changed from this snapshot to `later`: totals and the allocation sites of
        the blocks in use, all devices together."""
        before, after = _site_bytes(self), _site_bytes(later)
        changes = [
            SiteChange(*key, before.get(key, 0), after.get(key, 0))
            for key in dict.fromkeys([*before, *after])
            if before.get(key, 0) != after.get(key, 0)
        ]
        changes.sort(key=lambda c: abs(c.change_bytes), reverse=True)
        totals = {
            "allocated": (self.allocated_bytes, later.allocated_bytes),
            "active": (self.active_bytes, later.active_bytes),
            "reserved": (self.reserved_bytes, later.reserved_bytes),
        }
        return SnapshotDiff(self.source, later.source, totals, tuple(changes))


@dataclass(frozen=True)
class SnapshotDiff(SnapshotDiffRecord):
    """What :meth:`Snapshot.diff` returns (the fields are :class:`SnapshotDiffRecord`'s)."""

    def __str__(self) -> str:
        from torchmem.render import snapshot

        return snapshot.diff_text(self, TOP)


def _site_bytes(snapshot: SnapshotRecord) -> dict[tuple[str, int, str], int]:
    found: dict[tuple[str, int, str], int] = {}
    for device in snapshot.devices.values():
        for s in device.sites:
            key = (s.file, s.line, s.function)
            found[key] = found.get(key, 0) + s.bytes
    return found


class _Entry(NamedTuple):
    """A trace entry whose site, or out-of-memory event, a report shows."""

    action: str
    address: int
    bytes: int
    time: float
    """Seconds from the trace's first entry (0.0 where the trace has no times)."""
    frames: object
    where: tuple[int, int]
    """(entry, device): where the entry is, for an error message."""
    device_free: int | None


_Stacks = dict[Any, Any]
"""Sites by frames list (its id), and each stack seen once, bucketed by length and ends."""
_Sizes = dict[tuple[Frame, Stack], int]
"""Bytes by site and stack."""


def _stack_site(
    frames: object, stacks: _Stacks, find: Callable[..., tuple[str, int, str]], *args: Any
) -> tuple[str, int, str]:
    """The site of `frames` from `stacks`, else ``find(*args)``, kept there. A bucket's
    lists are compared whole: fast for shared frame dicts (identity first), right for equal."""
    if type(frames) is not list or not frames:
        return find(*args)
    bucket = stacks.setdefault((len(frames), id(frames[0]), id(frames[-1])), [])
    key = next((site for known, site in bucket if known == frames), None)
    if key is None:
        key = find(*args)
        bucket.append((frames, key))
    stacks[id(frames)] = key
    return key


_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...], Any], ...]] = {
    "segment": (
        ("device", int, 0),
        ("address", int, None),
        ("blocks", list, []),
        ("total_size", int, None),
        ("stream", int, 0),
        ("segment_type", (str, type(None)), None),
    ),
    "block": (("size", int, None), ("state", str, None), ("address", int, 0)),
    "trace entry": (
        ("action", str, None),
        ("time_us", int, 0),
        ("addr", int, 0),
        ("size", int, 0),
        ("device_free", (int, type(None)), None),
    ),
}
"""Each dict's (key, type, default: None where it must be there), in the order checked."""


class _Reader:
    """Reads a snapshot's dicts into records, with an error naming the bad part."""

    def __init__(self, source: str) -> None:
        self.source = source or "the snapshot"
        # By id(): the snapshot's lists and dicts live as long as the reader reads them.
        self._picked: dict[int, SiteKey] = {}
        self._frames: dict[int, Frame] = {}
        self._stack_frames = MAX_STACK_FRAMES

    def sites(self, sizes: _Sizes) -> tuple[Site, ...]:
        """Sites, largest first, with their stacks while :data:`MAX_STACK_FRAMES` last."""
        found, self._stack_frames = sites_of(sizes, self._stack_frames)
        return found

    def fail(self, why: str) -> NoReturn:
        raise SnapshotError(f"{self.source} is not a memory snapshot: {why}")

    def field(
        self,
        entry: object,
        key: str,
        where: str,
        kind: type | tuple[type, ...],
        default: Any = None,
    ) -> Any:
        if not isinstance(entry, dict):
            self.fail(f"{where} is a {type(entry).__name__}, not a dict")
        value = entry.get(key, default)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            missing = key not in entry
            self.fail(f"{where} has {'no' if missing else 'a bad'} {key!r}")
        if type(value) is int and not 0 <= value < LIMIT:
            self.fail(f"{where} has a bad {key!r}")
        return value

    def items(self, entry: object, key: str, where: str) -> list[Any]:
        return self.field(entry, key, where, list, [])  # type: ignore[no-any-return]

    def site(self, frames: object, where: str) -> tuple[str, int, str]:
        """The site of an allocation's frames (:func:`torchmem.records.frames.stack_site`), as a
        key that carries its Python stack. A snapshot shares its frame dicts (hundreds for
        millions of frames) and many of its lists: each is checked and read once."""
        picked = self._picked.get(id(frames))
        if picked is not None:
            return picked
        if not isinstance(frames, list):
            self.fail(f"{where} has bad frames")
        if not frames:
            return NO_FRAMES, 0, ""
        read = self._frames
        listed = []
        for f in frames:
            frame = read.get(id(f))
            if frame is None:
                frame = read[id(f)] = (
                    self.field(f, "filename", where, str),
                    self.field(f, "line", where, int),
                    self.field(f, "name", where, str),
                )
            listed.append(frame)
        key = self._picked[id(frames)] = SiteKey(*stack_site(listed))
        return key

    def block_site(self, frames: object, where: str, j: int) -> tuple[str, int, str]:
        return self.site(frames or [], f"{where}, block {j}")  # the string for new stacks only

    def entry_site(self, entry: _Entry) -> tuple[str, int, str]:
        """The site of a trace entry (:meth:`site` of its frames)."""
        index, device = entry.where
        return self.site(entry.frames, f"entry {index} of the trace of device {device}")

    def devices(self, data: object) -> dict[int, DeviceSnapshot]:
        if not isinstance(data, dict):
            self.fail(f"it holds a {type(data).__name__}, not a dict")
        if not isinstance(data.get("segments"), list):
            self.fail("it has no list of 'segments'")
        segments: dict[int, list[Segment]] = {}
        sites: dict[int, _Sizes] = {}
        stacks: _Stacks = {}
        for i, raw in enumerate(data["segments"]):
            segment = self.segment(raw, f"segment {i}", sites, stacks)
            segments.setdefault(segment.device, []).append(segment)
        traces = self.items(data, "device_traces", "it")
        settings = data.get("allocator_settings")
        expandable = isinstance(settings, dict) and settings.get("expandable_segments") is True
        split = settings.get("max_split_size", -1) if isinstance(settings, dict) else -1
        max_split = split if type(split) is int and split > 0 else NO_LIMIT
        names = data.get(DEVICE_NAMES, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            self.fail(f"its {DEVICE_NAMES!r} is not a list of strings")
        found = {}
        for index in sorted({*segments, *(i for i, t in enumerate(traces) if t)}):
            own = sorted(segments.get(index, []), key=lambda s: s.total_bytes, reverse=True)
            allocated = sum(s.allocated_bytes for s in own)
            active = sum(s.active_bytes for s in own)
            device = DeviceSnapshot(
                index,
                names[index] if index < len(names) else f"cuda:{index}",
                allocated,
                active,
                sum(s.total_bytes for s in own),
                tuple(own),
                self.sites(sites.get(index, {})),
            )
            raw = traces[index] if index < len(traces) else []
            trace = self.trace(raw, index, expandable, max_split)
            if trace.raw:
                device = _replayed(device, trace, self, stacks)
            found[index] = device
        return found

    def segment(
        self,
        raw: object,
        where: str,
        sites: dict[int, _Sizes],
        stacks: _Stacks,
    ) -> Segment:
        # The checks of field(), inline: a snapshot has thousands of segments and blocks.
        if type(raw) is dict:
            get = raw.get
            device, address, total = get("device", 0), get("address"), get("total_size")
            stream, kind, items = get("stream", 0), get("segment_type"), get("blocks", [])
        if not (
            type(raw) is dict
            and type(device) is int
            and type(address) is int
            and type(items) is list
            and type(total) is int
            and type(stream) is int
            and (kind is None or type(kind) is str)
            and 0 <= device < LIMIT
            and 0 <= address < LIMIT
            and 0 <= total < LIMIT
            and 0 <= stream < LIMIT
        ):
            self.bad(raw, where, "segment")
        blocks = []
        at = address
        allocated = pending = largest = 0
        for j, block in enumerate(items):
            if type(block) is dict:
                size, state, at = block.get("size"), block.get("state"), block.get("address", at)
            if not (
                type(block) is dict
                and type(size) is int
                and type(state) is str
                and 0 <= size < LIMIT
                and type(at) is int
                and 0 <= at < LIMIT
            ):
                self.bad(block, f"{where}, block {j}", "block")
            blocks.append(Block(at, size, state))
            at += size
            if state == "active_allocated":
                allocated += size
                frames = block.get("frames")
                if frames is None and block.get("history"):  # older PyTorch, as it reads them
                    here = f"{where}, block {j}"
                    first = self.items(block, "history", here)[0]
                    frames = self.field(first, "frames", here, list, [])
                key = _stack_site(frames, stacks, self.block_site, frames, where, j)
                own = sites.setdefault(device, {})
                pair = (key, getattr(key, "stack", ()))
                own[pair] = own.get(pair, 0) + size
            elif state == "active_pending_free":
                pending += size
            elif state == "inactive" and size > largest:
                largest = size
        active, held = allocated + pending, tuple(blocks)
        return Segment(device, address, total, allocated, active, largest, stream, kind, held)

    def check(self, raw: object, where: str, what: str) -> None:
        """Fail with what is wrong with `raw`, a `what` (:data:`_FIELDS`), if anything."""
        for key, kind, default in _FIELDS[what]:
            self.field(raw, key, where, kind, default)

    def bad(self, raw: object, where: str, what: str) -> NoReturn:
        """Fail with what is wrong with `raw`, a `what` found bad."""
        self.check(raw, where, what)
        self.fail(f"{where} is not a {what}")

    def trace(
        self, raw: object, device: int, expandable: bool = False, max_split: int = NO_LIMIT
    ) -> _Trace:
        if not isinstance(raw, list):
            self.fail(f"the trace of device {device} is a {type(raw).__name__}, not a list")

        def bad(entry: object, k: int) -> NoReturn:
            self.bad(entry, f"entry {k} of the trace of device {device}", "trace entry")

        events, ooms = read_trace(raw, bad)
        end = next((t for t in (e.get("time_us", 0) for e in reversed(raw)) if t), 0)
        start = raw[0].get("time_us", 0) if raw else 0
        # read_trace checks the types only, and a number past LIMIT could overflow a float
        low, high = (min(map(min, events)), max(map(max, events))) if events else (0, 0)
        wide = min(low, start) < 0 or max(high, end) >= LIMIT
        for k in range(len(raw)) if wide else ooms:
            self.check(raw[k], f"entry {k} of the trace of device {device}", "trace entry")
        return _Trace(raw, events, ooms, device, start, end, end != 0, expandable, max_split)


class _Trace(NamedTuple):
    """A device's trace, checked."""

    raw: list[dict[str, Any]]
    """The entries as the snapshot has them (frames are read only where needed)."""
    events: list[tuple[int, int, int, int, int]]
    """(:data:`~torchmem.records.caching.KINDS` number, address, bytes, µs, entry index)."""
    ooms: list[int]
    device: int
    start: int
    """µs: the time of its first entry, and of its last with a time."""
    end: int
    timed: bool
    """Whether any of its entries has a time; where none has, entry numbers stand in."""
    expandable: bool
    max_split: int
    """``max_split_size_mb`` in bytes (:data:`~torchmem.records.caching.NO_LIMIT`: unset)."""

    def seconds(self, time_us: int, before: float) -> float:
        """Seconds from the trace's start to `time_us`; `before` where it has no time."""
        return (time_us - self.start) / 1e6 if time_us else before

    def entry(self, k: int) -> _Entry:
        """Entry `k` (an index), for its site or its out-of-memory event."""
        raw = self.raw[k]
        return _Entry(
            raw["action"],
            raw.get("addr", 0),
            raw.get("size", 0),
            self.seconds(raw.get("time_us", 0), 0.0),
            raw.get("frames", []),
            (k, self.device),
            raw.get("device_free"),
        )


def _replayed(
    device: DeviceSnapshot, trace: _Trace, reader: _Reader, stacks: _Stacks
) -> DeviceSnapshot:
    """`device` with the peak, timeline, sites at the peak (named by `reader`) and OOM of its
    trace, all in block bytes (:func:`~torchmem.records.caching.replay_trace`)."""
    segments = [(s.address, s.total_bytes) for s in device.segments]
    in_use = [(b.address, b.bytes) for s in device.segments for b in s.blocks if b.state in ACTIVE]
    events, timed = trace.events, trace.timed
    start = trace.start if timed else None
    done = replay_trace(segments, in_use, events, start, trace.expandable, trace.max_split)
    base = device.active_bytes - done.end  # the anchor: the replay ends at the snapshot
    at_peak: _Sizes = {}
    for k in done.live:
        entry = events[k][4]
        frames = trace.raw[entry].get("frames")
        key = stacks.get(id(frames)) or _stack_site(
            frames, stacks, reader.entry_site, trace.entry(entry)
        )
        pair = (key, getattr(key, "stack", ()))
        at_peak[pair] = at_peak.get(pair, 0) + done.blocks[k]
    unexplained = base + done.highest - sum(at_peak.values())
    if unexplained > 0:
        at_peak[(BEFORE_TRACE, 0, ""), ()] = unexplained
    oom = None
    if trace.ooms:
        last = trace.entry(trace.ooms[-1])
        largest = max((s.largest_free_bytes for s in device.segments), default=0)
        oom = OOM(last.bytes, last.time, last.device_free, largest, trace.ooms[-1] + 1)
    span = trace.seconds(trace.end, 0.0) if timed else len(trace.raw)
    points = [(x, base + b) for x, b in done.points]
    peak = done.peak_at
    return DeviceSnapshot(
        device.device,
        device.name,
        device.allocated_bytes,
        device.active_bytes,
        device.reserved_bytes,
        device.segments,
        device.sites,
        peak_bytes=base + done.highest,
        peak_time=done.peak_x if timed else None,
        duration=span if timed else 0.0,
        timeline=timeline(points, span, MAX_POINTS, integral=not timed),
        sites_at_peak=reader.sites(at_peak),
        oom=oom,
        entries=len(trace.raw),
        peak_entry=events[peak][4] + 1 if peak >= 0 else 0,
        timed=timed,
    )
