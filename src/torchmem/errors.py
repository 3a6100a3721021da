"""torchmem's exceptions."""

from __future__ import annotations

import importlib
from types import ModuleType


class TorchmemError(Exception):
    """Base class of the errors torchmem raises itself."""


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
