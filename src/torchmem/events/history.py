"""PyTorch's CUDA allocator history, shared between torchmem's recordings and the program.

PyTorch keeps one history per process (``torch.cuda.memory._record_memory_history``), and a
program may record its own snapshot with it (``_dump_snapshot``) while torchmem records the
same run. While any torchmem recording is open, the program's calls are intercepted:

- turning it on, or changing its settings: the history records what both ask for (the
  richer context and stacks, the larger ``max_entries``), so the program's own
  ``_dump_snapshot`` holds at least what it asked for;
- turning it off: nothing is thrown away (turning it off in PyTorch discards the history);
  the program's wish is kept for later;
- ``clear_history=True``: the history is cleared as asked, after torchmem took a copy of
  what the recordings still need.

When the last recording stops, the program's own state is put back: off if it was off, its
own settings if it set some; a history that was already on when torchmem started (with
settings torchmem could not see) is used as it is and left on. What a recording could not
see is said in :attr:`HistoryLease.notes`.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

from torchmem._compat import (
    cuda_history_enabled,
    cuda_history_set,
    cuda_history_snapshot,
    intercept_cuda_history,
    stop_intercepting_cuda_history,
)

_CONTEXTS = (None, "state", "alloc", "all")
"""``context`` values, each recording what the ones before it do and more."""
_STACKS = ("python", "all")
_NEEDED = ("alloc", "free_completed", "segment_alloc", "segment_free")
"""Actions the recordings read: never skipped while one is open."""
_UNKNOWN = "unknown"


@dataclass
class Settings:
    """Arguments of one ``_record_memory_history`` call, by name (``enabled`` first)."""

    enabled: str | None
    options: dict[str, Any] = field(default_factory=dict)


def _call_settings(args: tuple[Any, ...], kwargs: dict[str, Any], original: Any) -> Settings:
    """The program's call as :class:`Settings`, whatever way it passed them."""
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    named = dict(bound.arguments) if bound is not None else dict(kwargs)
    if bound is None and args:
        named["enabled"] = args[0]
    named.pop("args", None)
    named.update(named.pop("kwargs", {}) or {})
    enabled = named.pop("enabled", "all")
    if isinstance(enabled, bool):  # the legacy form: True or False
        enabled = "all" if enabled else None
    return Settings(enabled, named)


def _richer(values: tuple[Any, ...], a: Any, b: Any) -> Any:
    return max(a, b, key=lambda v: values.index(v) if v in values else -1)


class _SharedHistory:
    """The one coordinator of the process's CUDA history (it is process-wide too)."""

    def __init__(self) -> None:
        self.leases: list[HistoryLease] = []
        self.theirs: Settings | str | None = None
        """The program's own state: None (off), its :class:`Settings`, or ``"unknown"``
        (on before torchmem started, with settings it could not see)."""
        self.cleared: list[dict[str, Any]] = []
        """Copies of the history taken before the program cleared it."""
        self.entries: int | None = None
        """The ``max_entries`` set last (None: the program's, unseen)."""

    def acquire(self, stacks: bool, entries: int) -> HistoryLease:
        lease = HistoryLease(self, stacks, entries)
        if not self.leases:
            self.cleared = []
            self.theirs = _UNKNOWN if cuda_history_enabled() else None
            intercept_cuda_history(self._intercepted)
        self.leases.append(lease)
        try:
            self._apply()
        except BaseException:  # the recording does not start: nothing of ours stays
            self.leases.remove(lease)
            if not self.leases:
                stop_intercepting_cuda_history()
            raise
        if self.theirs == _UNKNOWN:
            lease.notes.append(
                "The program had turned PyTorch's CUDA memory history on before the"
                " recording started: torchmem used it with the program's settings."
            )
        return lease

    def release(self, lease: HistoryLease) -> dict[str, Any]:
        """The history when `lease` ends (with what the program cleared before it); the
        program's own state is put back when the last lease ends."""
        try:
            history = cuda_history_snapshot()
        finally:
            self.leases.remove(lease)
            if self.leases:
                self._apply()
            else:
                try:
                    if self.theirs is None:
                        cuda_history_set(None)
                    elif isinstance(self.theirs, Settings):
                        options = self.theirs.options
                        options = {k: v for k, v in options.items() if k != "clear_history"}
                        cuda_history_set(self.theirs.enabled, **options)
                finally:
                    stop_intercepting_cuda_history()
        if self.cleared:
            history = {**history, "device_traces": _joined([*self.cleared, history])}
        for index, trace in enumerate(history.get("device_traces", [])):
            first = trace[0].get("time_us", 0) * 1000 if trace else 0
            if first > lease.wall if self.entries is None else len(trace) >= self.entries:
                lease.lost[index] = (first - lease.wall) / 1e9
        return history

    def _apply(self, clear: bool = False) -> None:
        """Set what every open lease and the program's own settings need together (and
        clear the history first, with `clear`)."""
        if self.theirs == _UNKNOWN:
            self.entries = None
            return
        context = None
        entries = 0
        for lease in self.leases:
            context = _richer(_CONTEXTS, context, "alloc" if lease.stacks else None)
            entries = max(entries, lease.entries)
        options: dict[str, Any] = {"context": context, "stacks": "python"}
        if isinstance(self.theirs, Settings) and self.theirs.enabled is not None:
            theirs = self.theirs.options
            options = {**theirs, **options}
            options["context"] = _richer(_CONTEXTS, context, theirs.get("context", "all"))
            options["stacks"] = _richer(_STACKS, "python", theirs.get("stacks", "all"))
            entries = max(entries, theirs.get("max_entries", entries))
            skipped = theirs.get("skip_actions") or []
            options["skip_actions"] = [a for a in skipped if a not in _NEEDED] or None
        options["max_entries"] = self.entries = entries
        options["clear_history"] = clear
        cuda_history_set("all", **options)

    def _intercepted(self, args: tuple[Any, ...], kwargs: dict[str, Any], original: Any) -> None:
        call = _call_settings(args, kwargs, original)
        clear = bool(call.options.get("clear_history")) and call.enabled is not None
        if clear:
            self.cleared.append(cuda_history_snapshot())
        self.theirs = call if call.enabled is not None else None
        self._apply(clear)


def _joined(parts: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The device traces of several copies of the history, one after the other."""
    traces: list[list[dict[str, Any]]] = []
    for part in parts:
        for i, trace in enumerate(part.get("device_traces", [])):
            traces.extend([] for _ in range(i + 1 - len(traces)))
            traces[i].extend(trace)
    return traces


_shared = _SharedHistory()


@dataclass(eq=False)
class HistoryLease:
    """One recording's use of the history, from :func:`acquire` to :meth:`release`."""

    owner: _SharedHistory
    stacks: bool
    entries: int
    notes: list[str] = field(default_factory=list)
    """What the recording could not see, in sentences for its report."""
    wall: int = field(default_factory=time.time_ns)
    """``time.time_ns()`` when the lease began."""
    lost: dict[int, float] = field(default_factory=dict)
    """Device index -> seconds from the lease's start that the history no longer holds
    (it keeps only its last ``max_entries`` actions); set by :meth:`release`."""

    def release(self) -> dict[str, Any]:
        """Stop using the history; return it (``torch.cuda.memory._snapshot()``'s dict)."""
        return self.owner.release(self)


def acquire(stacks: bool, entries: int) -> HistoryLease:
    """Start using PyTorch's CUDA allocator history for one recording: with the Python
    stack of each allocation where `stacks`, keeping at least the last `entries` actions."""
    return _shared.acquire(stacks, entries)
