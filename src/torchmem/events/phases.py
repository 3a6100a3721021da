"""The phases of training a watcher saw: each forward call of an outermost module, each
backward pass through one, each ``optimizer.step()``; timed on ``time.monotonic_ns()``,
the clock of the event logs.

One entry (three int64) per phase, kept for the whole run: memory and cost are linear in
the phases, about 24 bytes each (a million training steps: about 100 MB), unlike the rest
of the event engine, which is bounded; a report needs each step to mark it.
"""

from __future__ import annotations

import time
from array import array

from torchmem.records.run import PHASES, Phase

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

    def begin(self, kind: int, key: int) -> None:
        """A forward call (`key`: its probe's number) or a step (`key`: the optimizer's id)
        begins now."""
        self._begun[kind, key] = time.monotonic_ns()

    def end(self, kind: int, key: int) -> None:
        """The phase begun with `kind` and `key` ends now."""
        start = self._begun.pop((kind, key), None)
        if start is not None:
            self._done.extend((kind, start, time.monotonic_ns()))

    def opened(self, number: int) -> None:
        """The backward pass of an outermost module's forward call (probe `number`) began:
        the gradient of one of its outputs is ready."""
        self._passes[number] = [time.monotonic_ns(), -1]

    def hit(self, number: int) -> None:
        """A gradient the backward pass of probe `number` ends with is ready: the pass ends
        at the last of them."""
        found = self._passes.get(number)
        if found is not None:
            found[1] = time.monotonic_ns()

    def closed(self, number: int) -> None:
        """The backward pass of probe `number` can run no more (kept if it reached an end)."""
        found = self._passes.pop(number, None)
        if found is not None and found[1] >= 0:
            self._done.extend((BACKWARD, found[0], found[1]))

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
