"""torchmem's exceptions."""

from __future__ import annotations

import importlib
from types import ModuleType


class TorchmemError(Exception):
    """Base class of the errors torchmem raises itself."""


class UsageError(TorchmemError, RuntimeError):
    """torchmem used in a way that cannot work (a recording read before it stopped, or
    started twice; ranks gathered without a process group): the message says what to do
    instead. A RuntimeError too, as such misuse was before."""


class BuildError(TorchmemError):
    """The counting CPU allocator could not be built, loaded or trusted here (the CPU
    meter falls back to its dispatch mode)."""


class CommandError(TorchmemError):
    """A ``torchmem`` command cannot do what was asked: the command line prints the message
    as one line and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class SnapshotError(TorchmemError):
    """A file is not a memory snapshot torchmem can read: not a pickle, not a snapshot, or
    a pickle that asks to run code (refused: nothing from it runs)."""


class EstimateError(TorchmemError):
    """A function cannot be estimated on fake tensors (the message says why)."""


class UnknownValue(EstimateError):
    """A value fake tensors do not know decides a shape (an index, a size, what
    ``nonzero`` finds): guessing it would give a wrong shape in silence."""


class OutOfMemory(TorchmemError):
    """The estimator's model of PyTorch's caching allocator could not serve a request
    within its capacity (the estimate of a batch that does not fit)."""

    def __init__(self, nbytes: int, event: int) -> None:
        super().__init__(f"out of memory allocating {nbytes} bytes (event {event})")
        self.nbytes = nbytes
        """The request, in bytes."""
        self.event = event
        """The index of the allocation event that asked for it."""


class TorchmemWarning(UserWarning):
    """Something torchmem could not do as well as it would have liked (it says what it
    does instead)."""


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Import optional dependency `module` (``"matplotlib.figure"``) for `feature`, or
    raise an ImportError that says what to install: torchmem's `extra` where
    ``pyproject.toml`` defines one (``pip install "torchmem[plot]"``), else the package."""
    package = module.partition(".")[0]
    try:
        importlib.import_module(package)
        return importlib.import_module(module)
    except ImportError as exc:
        how = f'pip install "torchmem[{extra}]"' if extra else f"pip install {package.lower()}"
        raise ImportError(f"{feature} needs {package}: {how}") from exc
