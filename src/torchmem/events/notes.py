"""What the watcher notes down, kept without holding the program's objects: the names
marks give (:class:`NameTable`), the variables that name storages at the end
(:class:`Variable`), a root module's names (:class:`Tree`), and marks and probes for a
stream made later (:class:`Notes`)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, NamedTuple

import torch

from torchmem._objects import class_name
from torchmem.events.tally import MARK

NOTES = 1 << 18
"""Marks and probes a :class:`Notes` buffer keeps at most (the latest)."""
_DTYPES: dict[torch.dtype, str] = {}
"""``str()`` of each dtype seen (it costs more than a look-up)."""


class NameTable:
    """What marks named, by index: ``(name, shape, dtype)`` (see :attr:`Notes.rows`). Shared
    by the recordings that share a log, so that one's index means the same to all."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[Any, ...] | None, tuple[int, ...], str]] = []
        self._index: dict[tuple[Any, ...], int] = {}

    def intern(self, name: tuple[Any, ...] | None, tensor: torch.Tensor) -> int:
        dtype = _DTYPES.get(tensor.dtype) or _DTYPES.setdefault(tensor.dtype, str(tensor.dtype))
        entry = (name, tuple(tensor.shape), dtype)
        index = self._index.get(entry)
        if index is None:
            index = self._index[entry] = len(self.entries)
            self.entries.append(entry)
        return index


class Variable(NamedTuple):
    """A variable of the recorded code holding a storage at the end, which names it."""

    name: str
    shape: tuple[int, ...] | None
    """The tensor's shape, where it spans its whole storage (None: a view of part)."""
    dtype: str | None
    """``str()`` of its dtype, where :attr:`shape` is known."""


class Tree(NamedTuple):
    """What a root module's report names need, kept without holding the module."""

    kind: str
    """The root's class's name."""
    modules: list[tuple[int, str]]
    """``(id, dotted name)`` of the root and every module in it."""
    params: list[tuple[int, str]]
    """``(id, dotted name)`` of every parameter in it."""

    @classmethod
    def of(cls, root: torch.nn.Module) -> Tree:
        return cls(
            class_name(root),
            [(id(m), name) for name, m in root.named_modules(remove_duplicate=False)],
            [(id(p), name) for name, p in root.named_parameters(remove_duplicate=False)],
        )


class Notes:
    """Marks and probes kept in Python, with their times, for a stream made later (CUDA's
    allocator history, the estimator's log): the latest :data:`NOTES`."""

    def __init__(self) -> None:
        self.rows: deque[tuple[int, int, int, int, int, str]] = deque(maxlen=NOTES)
        """``(time, kind, ptr or probe number, payload or module, ref, device)``."""
        self.lost = 0
        """Notes older than those kept."""

    def _add(self, row: tuple[int, int, int, int, int, str]) -> None:
        if len(self.rows) == NOTES:
            self.lost += 1
        self.rows.append(row)

    def mark(self, ptr: int, payload: int, device: str) -> None:
        self._add((time.monotonic_ns(), MARK, ptr, payload, -1, device))

    def probe(self, kind: int, number: int, module: int, ref: int) -> None:
        self._add((time.monotonic_ns(), kind, number, module, ref, ""))
