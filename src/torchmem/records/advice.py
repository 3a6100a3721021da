"""Advice's record: changes to a training step, each with the memory the estimator computed
it saves.

Made by :func:`torchmem.advise`; read by :mod:`torchmem.render.advice`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHANGES = ("checkpoint", "autocast", "set_to_none", "foreach")
"""The changes advice tries, in the order it lists them: activation checkpointing of the
modules that keep the most for backward, the forward under bfloat16 autocast, gradients
zeroed with ``set_to_none=True``, the optimizer's step with ``foreach=False``."""


@dataclass(frozen=True)
class Change:
    """One change to the step and what the estimator computed it saves, the others left
    as they are."""

    kind: str
    """One of :data:`CHANGES`."""
    action: str
    """What to change in the step's code, one sentence."""
    peak_bytes: int
    """The estimated peak allocated with this change."""
    reserved_bytes: int
    """The estimated peak reserved with this change (CUDA: whole segments; CPU: the
    peak)."""
    saving_bytes: int
    """The step's estimated peak less :attr:`peak_bytes` (more than 0 for every change
    listed)."""
    reserved_saving_bytes: int
    """The step's estimated peak reserved less :attr:`reserved_bytes` (may be 0, or less
    where the allocator's segments fall otherwise)."""
    modules: tuple[str, ...] = ()
    """``checkpoint``: the modules whose forward calls to checkpoint, named as an
    estimate's modules are."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "action": self.action,
            "modules": list(self.modules),
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "saving_bytes": self.saving_bytes,
            "reserved_saving_bytes": self.reserved_saving_bytes,
        }


@dataclass(frozen=True)
class LargestBatch:
    """The largest batch that fits a GPU's memory, as the step is and with every change
    listed."""

    gpu: str
    """The GPU's name or capacity as given where it was a string (``"H100-80GB"``,
    ``"80 GiB"``); empty where it was a number of bytes."""
    capacity_bytes: int
    """The memory the batch must fit in."""
    batch: int
    """The largest batch of the step as it is (0: not even 1 fits)."""
    advised_batch: int
    """The largest batch with every change listed applied together (the same as
    :attr:`batch` where none is)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "batch": self.batch,
            "advised_batch": self.advised_batch,
        }


@dataclass(frozen=True)
class AdviceRecord:
    """Changes that lower a step's estimated peak, each with its computed saving."""

    function: str
    """The qualified name of the function advised on."""
    device: str
    """The target: ``"cpu"`` or ``"cuda"``, as an estimate's."""
    peak_bytes: int
    """The step's estimated peak allocated, as it is."""
    reserved_bytes: int
    """The step's estimated peak reserved, as it is."""
    changes: tuple[Change, ...]
    """Each change the estimator computed to save memory, largest saving first."""
    advised_peak_bytes: int
    """The estimated peak with every change listed applied together (savings do not add
    up: two changes may lower the same peak); :attr:`peak_bytes` where none is."""
    advised_reserved_bytes: int
    """The estimated peak reserved with every change listed applied together."""
    largest_batch: LargestBatch | None = None
    """Where a GPU or capacity was given: the largest batch that fits it."""
    notes: tuple[str, ...] = ()
    """Each change tried and not listed, and why; what the estimates assumed."""
    seconds: float = 0.0
    """How long the advice took (every estimate it made)."""

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (docs/json.md)."""
        batch = self.largest_batch
        return {
            "function": self.function,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "changes": [change.to_json() for change in self.changes],
            "advised_peak_bytes": self.advised_peak_bytes,
            "advised_reserved_bytes": self.advised_reserved_bytes,
            "largest_batch": None if batch is None else batch.to_json(),
            "notes": list(self.notes),
            "seconds": self.seconds,
        }
