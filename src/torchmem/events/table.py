"""A tally's allocations, one per index of each column (see :mod:`torchmem.events.tally`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FIELDS = ("key", "born", "ptr", "size", "site", "time", "cat", "name", "owner")


@dataclass
class Table:
    """Allocations, one per index of each column, sorted by :attr:`key`."""

    key: np.ndarray
    """The sequence number the stream names it by (its allocation's; an adopted storage's
    from its adoption, or from its allocation if that was seen)."""
    born: np.ndarray
    """Sequence number of the row that made it; -1 for storages alive at the start."""
    ptr: np.ndarray
    size: np.ndarray
    site: np.ndarray
    time: np.ndarray
    cat: np.ndarray
    """Category index, :data:`~torchmem.records.run.CATEGORIES` order (the last: other)."""
    name: np.ndarray
    """Index of the mark payload that named it (:data:`~torchmem.events.tally.UNNAMED`)."""
    owner: np.ndarray
    """For one autograd's engine made: the index of the module whose backward pass ran
    then; else -1."""

    @classmethod
    def empty(cls) -> Table:
        return cls(*(np.empty(0, np.int64) for _ in _FIELDS))

    def __len__(self) -> int:
        return len(self.key)

    def take(self, index: np.ndarray) -> Table:
        return Table(*(getattr(self, f)[index] for f in _FIELDS))

    def concat(self, other: Table) -> Table:
        joined = Table(*(np.concatenate([getattr(self, f), getattr(other, f)]) for f in _FIELDS))
        if len(joined) > 1 and np.any(joined.key[1:] < joined.key[:-1]):
            joined = joined.take(np.argsort(joined.key, kind="stable"))
        return joined

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of `keys` in this table, and which were found."""
        at = np.searchsorted(self.key, keys)
        at = np.minimum(at, max(len(self.key) - 1, 0))
        found = (self.key[at] == keys) if len(self.key) else np.zeros(len(keys), bool)
        return at, found
