"""The phases of training a watcher saw: each forward call of an outermost module, each
backward pass through one, each ``optimizer.step()``; timed on ``time.monotonic_ns()``,
the clock of the event logs; and the process's resident memory (RSS) where a step may end.

One entry (three int64) per phase, kept for the whole run: memory and cost are linear in
the phases, about 24 bytes each (a million training steps: about 100 MB), unlike the rest
of the event engine, which is bounded; a report needs each step to mark it. RSS is read
(``/proc/self/statm`` on Linux: a few microseconds) where an ``optimizer.step()`` returns;
until one has, also where a backward pass through an outermost module reaches an end and,
until one has, where an outermost module's forward call returns: once a run has steps of
one kind, only that kind is read (see :data:`~torchmem.events.steps.BY`). One reading
(two int64) is kept per step's end (or per backward pass), 16 bytes.
"""

from __future__ import annotations

import time
from array import array

import numpy as np

from torchmem.meters import meter
from torchmem.records.run import PHASES, Phase
from torchmem.resolve import RAM

FORWARD, BACKWARD, STEP = range(3)
"""Kinds of phase, the indices of :data:`~torchmem.records.run.PHASES`."""


class Phases:
    """Phases as they begin and end (the watcher's hooks call it)."""

    def __init__(self) -> None:
        self._done = array("q")
        """``kind, start, end`` of each phase that ended, flat."""
        self._begun: dict[tuple[int, int], int] = {}
        """``(kind, key)`` -> start, of phases begun and not yet ended."""
        self._passes: dict[int, list[int]] = {}
        """Backward passes open, by probe number: ``[start, last hit]`` (-1: none yet)."""
        self._ended = 0
        """The start of the phase that ended last."""
        self._awaited: dict[int, int] = {}
        """Probe number of a backward pass not yet begun -> start of its forward call."""
        self.backed = array("q")
        """The starts of the forward calls a backward pass went through."""
        self._ram = array("q")
        """``time, rss`` of each reading of the process's resident memory, flat."""
        self._rss = meter(RAM).used
        self._read = FORWARD
        """The latest kind of step end seen (:data:`FORWARD`, :data:`BACKWARD`,
        :data:`STEP`): RSS is read at it and at the kinds after it."""

    def begin(self, kind: int, key: int) -> None:
        """A forward call (`key`: its probe's number) or a step (`key`: the optimizer's id)
        begins now."""
        self._begun[kind, key] = time.monotonic_ns()

    def end(self, kind: int, key: int) -> None:
        """The phase begun with `kind` and `key` ends now."""
        start = self._begun.pop((kind, key), None)
        if start is not None:
            now = time.monotonic_ns()
            self._done.extend((kind, start, now))
            self._ended = start
            if kind >= self._read:
                self._read = kind
                self._ram.extend((now, self._rss()))

    def awaits(self, number: int) -> None:
        """The forward call that ended last has a backward pass to come: probe `number`."""
        self._awaited[number] = self._ended

    def opened(self, number: int) -> None:
        """The backward pass of an outermost module's forward call (probe `number`) began:
        the gradient of one of its outputs is ready."""
        self._passes[number] = [time.monotonic_ns(), -1, -1]
        forward = self._awaited.pop(number, None)
        if forward is not None:
            self.backed.append(forward)

    def hit(self, number: int) -> None:
        """A gradient the backward pass of probe `number` ends with is ready: the pass ends
        at the last of them."""
        found = self._passes.get(number)
        if found is not None:
            found[1] = time.monotonic_ns()
            if self._read <= BACKWARD:
                self._read = BACKWARD
                found[2] = self._rss()

    def closed(self, number: int) -> None:
        """The backward pass of probe `number` can run no more (kept if it reached an end)."""
        self._awaited.pop(number, None)
        found = self._passes.pop(number, None)
        if found is not None and found[1] >= 0:
            self._done.extend((BACKWARD, found[0], found[1]))
            if found[2] >= 0:
                self._ram.extend((found[1], found[2]))

    def forwards(self) -> np.ndarray:
        """The forward calls that ended, in time order: ``start, end`` on
        ``time.monotonic_ns()``, and 1 where a backward pass went through it (else 0)."""
        done = np.frombuffer(self._done, np.int64).reshape(-1, 3)
        spans = done[done[:, 0] == FORWARD][:, 1:]
        spans = spans[np.argsort(spans[:, 0], kind="stable")]
        backed = np.isin(spans[:, 0], np.frombuffer(self.backed, np.int64))
        return np.column_stack([spans, backed.astype(np.int64)])

    def ram(self) -> np.ndarray:
        """The process's resident memory where steps may have ended: ``time`` (on
        ``time.monotonic_ns()``, just before the step's end was logged) and ``rss`` (bytes)
        of each reading, in time order."""
        found = np.frombuffer(self._ram, np.int64).reshape(-1, 2)
        return found[np.argsort(found[:, 0], kind="stable")]

    def read(self, origin: int) -> tuple[Phase, ...]:
        """The phases that ended, in time order, in seconds from `origin`
        (``time.monotonic_ns()``). Backward passes that overlap (a loss module's, then its
        model's, as the gradient flows from one into the other) are one pass."""
        done = self._done
        spans = sorted(zip(done[1::3], done[2::3], done[0::3], strict=True))
        passes: list[tuple[int, int, int]] = []
        for start, end, kind in (s for s in spans if s[2] == BACKWARD):
            if passes and start <= passes[-1][1]:
                passes[-1] = (passes[-1][0], max(passes[-1][1], end), kind)
            else:
                passes.append((start, end, kind))
        spans = sorted([s for s in spans if s[2] != BACKWARD] + passes)
        return tuple(
            Phase(PHASES[kind], (start - origin) / 1e9, (end - origin) / 1e9)
            for start, end, kind in spans
        )
