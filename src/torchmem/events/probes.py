"""A module's backward pass as a probe of a recording's stream: it opens where the
gradient of one of the module's outputs is ready, hits at each gradient of its inputs (or
of its parameters), and closes at the module's next call."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

from torchmem.events.tally import CLOSE, HIT, OPEN

numbers = itertools.count()
"""Probe numbers, unique in the process (recordings that nest share one log)."""


class Backward:
    """One forward call's backward: a probe that opens at the gradient of one of its
    outputs, hits at each gradient of its inputs (or parameters), and closes at the
    module's next call."""

    def __init__(self, key: int, depth: int, probe: Callable[[int, int, int, int], None]) -> None:
        self.key = key
        self.ref = depth << 1 | 1
        self.number = next(numbers)
        self.started = False
        self.ended = False
        self.handles: list[RemovableHandle] = []
        self.params: list[int] = []
        """The ids of the parameters whose gradients end it (where no input needs one)."""
        self._probe = probe

    def begin(self, grad: Any) -> None:
        if not self.started:
            self.started = True
            self._probe(OPEN, self.number, self.key, self.ref)

    def end(self, grad: Any) -> None:
        if self.started:
            self.ended = True
            self._probe(HIT, self.number, self.key, self.ref)

    def close(self) -> None:
        if self.started:
            self._probe(CLOSE, self.number, self.key, self.ref)
