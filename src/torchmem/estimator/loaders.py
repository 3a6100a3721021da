"""A DataLoader's workers, run in the estimating process.

An estimate follows one process: worker processes would run the dataset on fake tensors
they cannot send back (PyTorch fails deep inside the loader). While an estimate runs, a
``DataLoader`` with ``num_workers > 0`` makes its batches in this process, as with
``num_workers=0``: the same batches, made by the same dataset and collate function, so
the memory they take in the training step is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader


class InProcess:
    """How many iterations over a DataLoader with workers ran in this process instead."""

    def __init__(self) -> None:
        self.loaders = 0


@contextlib.contextmanager
def loaders_in_process() -> Iterator[InProcess]:
    """While open, iterating any ``DataLoader`` makes its batches in this process."""
    seen = InProcess()
    original = DataLoader.__iter__

    def in_process(loader: DataLoader[Any]) -> Any:
        workers, timeout = loader.num_workers, loader.timeout
        if workers == 0:
            return original(loader)
        seen.loaders += 1
        # Read when the iterator is made, never after: the loader is as it was once made.
        loader.num_workers, loader.timeout = 0, 0
        try:
            return original(loader)
        finally:
            loader.num_workers, loader.timeout = workers, timeout

    DataLoader.__iter__ = in_process  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        DataLoader.__iter__ = original  # type: ignore[method-assign]
