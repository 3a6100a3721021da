"""PyTorch memory snapshots, read offline and safely.

A snapshot (``torch.cuda.memory._dump_snapshot(path)``) is a pickle of
``torch.cuda.memory._snapshot()``: the caching allocator's segments and their blocks, and
per device a trace of its recent actions. A pickle can run any code when loaded, so
:func:`load_snapshot` reads it with an unpickler that builds plain data only (dicts, lists,
strings, numbers, bytes, tuples, sets, booleans, None) and refuses every global and every
persistent id: nothing from the file runs.

The trace is a ring buffer: it may start in the middle of a run. Its replay (allocations
add their bytes, completed frees subtract them) is therefore anchored at its end, where it
must equal the bytes the snapshot's segments hold active on that device (``active_allocated``
and ``active_pending_free`` blocks: a freed block counts until its free completes); the
bytes in use when the trace starts follow from that.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, NoReturn

from torchmem.errors import SnapshotError
from torchmem.records.frames import Frame, SiteKey, stack_site
from torchmem.records.run import Site
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

TOP = 10
"""How many sites and segments a report lists by default."""
MAX_POINTS = 2000
"""A timeline has at most this many intervals."""
NO_FRAMES = "<no frames>"
"""The site of an allocation recorded without a Python stack (PyTorch's own threads)."""
BEFORE_TRACE = "<before the trace>"
"""The site of the bytes allocated before the trace's first entry."""


class _Unpickler(pickle.Unpickler):
    """Builds plain data only: every global and persistent id is refused."""

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self.name = name

    def _refuse(self, what: str) -> NoReturn:
        raise SnapshotError(
            f"refused to load {self.name}: it asks for {what}, and a snapshot holds plain"
            " data only; nothing from it was run"
        )

    def find_class(self, module: str, name: str) -> NoReturn:
        self._refuse(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> NoReturn:
        self._refuse(f"a persistent object {pid!r}")


def load_snapshot(path: str | Path) -> Snapshot:
    """Read the memory snapshot at `path` (``torch.cuda.memory._dump_snapshot(path)``)
    without running anything from it.

    Raises:
        SnapshotError: the file is not a pickle, not a snapshot, or asks for anything but
            plain data (a class, a function: refused before anything runs).
        OSError: the file cannot be read.
    """
    name = str(path)
    with Path(path).open("rb") as file, _without_gc():
        try:
            data = _Unpickler(file, name).load()
        except SnapshotError:
            raise
        except Exception as exc:  # a damaged pickle fails anywhere in the opcode loop
            raise SnapshotError(f"{name} is not a pickle: {exc}") from None
        return Snapshot.from_dict(data, name)


@contextlib.contextmanager
def _without_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as it was before, after): a snapshot is
    millions of small containers without cycles, and while they are made the collector
    would walk them all again and again, which more than doubles the time of a large one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Snapshot(SnapshotRecord):
    """A memory snapshot, analysed (the fields are :class:`SnapshotRecord`'s): prints as
    text, shows as HTML in Jupyter, saves a self-contained HTML page, compares with
    another snapshot."""

    @classmethod
    def from_dict(cls, data: object, source: str = "") -> Snapshot:
        """Analyse a snapshot in memory (``torch.cuda.memory._snapshot()``); `source`
        names it in reports and errors.

        Raises:
            SnapshotError: `data` is not a snapshot; the message says what is wrong.
        """
        with _without_gc():
            return cls(_Reader(source).devices(data), source)

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

    def __str__(self) -> str:
        from torchmem.render import snapshot

        return snapshot.text(self, TOP)

    def _repr_html_(self) -> str:
        from torchmem.render import snapshot

        return snapshot.html(self, TOP)

    def save_html(self, path: str | Path, top: int = TOP) -> None:
        """Write a self-contained HTML page to `path` (no scripts, no network), listing
        `top` sites and segments."""
        from torchmem.render import snapshot

        Path(path).write_text(snapshot.page(self, top), encoding="utf-8")

    def to_dataframe(self) -> Any:
        """One row per segment; needs pandas."""
        from torchmem.render import snapshot

        return snapshot.dataframe(self)


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


def _sites(sizes: dict[tuple[str, int, str], int]) -> tuple[Site, ...]:
    """Sites, largest first, with the stack their keys carry (:class:`SiteKey`)."""
    ordered = sorted(sizes.items(), key=lambda item: item[1], reverse=True)
    return tuple(Site(*key, size, getattr(key, "stack", ())) for key, size in ordered if size)


class _Entry(NamedTuple):  # a named tuple: made up to a million times per snapshot
    action: str
    address: int
    bytes: int
    time: float
    """Seconds from the trace's first entry."""
    frames: object
    """As the snapshot has them: read (:meth:`_Reader.site`) only for the allocations
    alive at the peak, not for each of a trace's up to a million entries."""
    where: tuple[int, int]
    """(entry, device): where the entry is, for an error message."""
    device_free: int | None


class _Reader:
    """Reads a snapshot's dicts into records, with an error naming the bad part."""

    def __init__(self, source: str) -> None:
        self.source = source or "the snapshot"
        # By id(): the snapshot's lists and dicts live as long as the reader reads them.
        self._picked: dict[int, SiteKey] = {}
        self._frames: dict[int, Frame] = {}

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
        sites: dict[int, dict[tuple[str, int, str], int]] = {}
        for i, raw in enumerate(data["segments"]):
            segment = self.segment(raw, f"segment {i}", sites)
            segments.setdefault(segment.device, []).append(segment)
        traces = self.items(data, "device_traces", "it")
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
                _sites(sites.get(index, {})),
            )
            entries = self.trace(traces[index] if index < len(traces) else [], index)
            found[index] = _replayed(device, entries, self.entry_site) if entries else device
        return found

    def segment(
        self, raw: object, where: str, sites: dict[int, dict[tuple[str, int, str], int]]
    ) -> Segment:
        device = self.field(raw, "device", where, int, 0)
        address = self.field(raw, "address", where, int)
        blocks = []
        at = address
        for j, block in enumerate(self.items(raw, "blocks", where)):
            here = f"{where}, block {j}"
            size = self.field(block, "size", here, int)
            state = self.field(block, "state", here, str)
            blocks.append(Block(self.field(block, "address", here, int, at), size, state))
            at = blocks[-1].address + size
            if state == "active_allocated":
                frames = block.get("frames")
                if frames is None and block.get("history"):  # older PyTorch, as it reads them
                    frames = self.field(block["history"][0], "frames", here, list, [])
                key = self.site(frames or [], here)
                own = sites.setdefault(device, {})
                own[key] = own.get(key, 0) + size
        allocated = sum(b.bytes for b in blocks if b.state == "active_allocated")
        pending = sum(b.bytes for b in blocks if b.state == "active_pending_free")
        return Segment(
            device,
            address,
            self.field(raw, "total_size", where, int),
            allocated,
            allocated + pending,
            max((b.bytes for b in blocks if b.state == "inactive"), default=0),
            self.field(raw, "stream", where, int, 0),
            self.field(raw, "segment_type", where, (str, type(None))),
            tuple(blocks),
        )

    def bad_entry(self, entry: object, where: str) -> NoReturn:
        """Fail with what is wrong with a trace entry that is not as it should be."""
        self.field(entry, "action", where, str)
        self.field(entry, "time_us", where, int, 0)
        self.field(entry, "addr", where, int, 0)
        self.field(entry, "size", where, int, 0)
        self.field(entry, "device_free", where, (int, type(None)))
        self.fail(f"{where} is not a trace entry")

    def trace(self, raw: object, device: int) -> list[_Entry]:
        if not isinstance(raw, list):
            self.fail(f"the trace of device {device} is a {type(raw).__name__}, not a list")
        entries = []
        start: int | None = None
        last = 0
        for k, entry in enumerate(raw):
            # The checks of field(), inline: a trace has up to a million entries.
            if type(entry) is not dict:
                self.bad_entry(entry, f"entry {k} of the trace of device {device}")
            get = entry.get
            action = get("action")
            time_us = get("time_us", last)
            address = get("addr", 0)
            size = get("size", 0)
            free = get("device_free")
            if not (
                type(action) is str
                and type(time_us) is int
                and type(address) is int
                and type(size) is int
                and (free is None or type(free) is int)
            ):
                self.bad_entry(entry, f"entry {k} of the trace of device {device}")
            start = time_us if start is None else start
            last = time_us
            entries.append(
                _Entry(
                    action,
                    address,
                    size,
                    (time_us - start) / 1e6,
                    get("frames", []),
                    (k, device),
                    free,
                )
            )
        return entries


def _replayed(
    device: DeviceSnapshot, entries: list[_Entry], site: Callable[[_Entry], tuple[str, int, str]]
) -> DeviceSnapshot:
    """`device` with the peak, timeline, sites at the peak and OOM of its trace."""
    changes = [e for e in entries if e.action in ("alloc", "free_completed")]
    running = highest = 0
    peak_at = -1  # the index in `changes` after which the peak held; -1: the start
    points: list[tuple[float, int]] = [(0.0, 0)]
    for k, e in enumerate(changes):
        running += e.bytes if e.action == "alloc" else -e.bytes
        points.append((e.time, running))
        if running > highest:
            highest, peak_at = running, k
    base = device.active_bytes - running  # the anchor: the replay ends at the snapshot
    live: dict[int, _Entry] = {}
    for e in changes[: peak_at + 1]:
        if e.action == "alloc":
            live[e.address] = e
        else:
            live.pop(e.address, None)
    at_peak: dict[tuple[str, int, str], int] = {}
    for e in live.values():
        key = site(e)
        at_peak[key] = at_peak.get(key, 0) + e.bytes
    unexplained = base + highest - sum(at_peak.values())
    if unexplained > 0:
        at_peak[(BEFORE_TRACE, 0, "")] = unexplained
    ooms = [e for e in entries if e.action == "oom"]
    largest = max((s.largest_free_bytes for s in device.segments), default=0)
    duration = entries[-1].time
    return DeviceSnapshot(
        device.device,
        device.name,
        device.allocated_bytes,
        device.active_bytes,
        device.reserved_bytes,
        device.segments,
        device.sites,
        peak_bytes=base + highest,
        peak_time=changes[peak_at].time if peak_at >= 0 else 0.0,
        duration=duration,
        timeline=_timeline([(t, base + b) for t, b in points], duration),
        sites_at_peak=_sites(at_peak),
        oom=None if not ooms else OOM(ooms[-1].bytes, ooms[-1].time, ooms[-1].device_free, largest),
    )


def _timeline(
    points: Iterable[tuple[float, int]], duration: float
) -> tuple[tuple[float, int], ...]:
    """The highest bytes of `points` (time, bytes from then on) in each of at most
    :data:`MAX_POINTS` equal intervals of `duration` seconds; exact, not sampled."""
    ordered = list(points)
    if duration <= 0:
        return ((0.0, max(b for _, b in ordered)),)
    count = min(MAX_POINTS, len(ordered))
    out = []
    i, value = 0, ordered[0][1]
    for k in range(count):
        end = duration * (k + 1) / count
        high = value
        while i < len(ordered) and (ordered[i][0] <= end or k == count - 1):
            value = ordered[i][1]
            high = max(high, value)
            i += 1
        out.append((end, high))
    return tuple(out)
