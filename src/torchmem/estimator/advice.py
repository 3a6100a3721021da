"""Advice with numbers: changes to a training step, each with the memory the estimator
computed it saves.

Each change is tried by estimating the step with it made (:mod:`torchmem.estimator.changes`
makes it while the step runs on fake tensors, without editing the step's code); a change
is listed only where that estimate's peak is lower than the step's own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torchmem.estimator import gpus
from torchmem.estimator.api import Estimate, estimate, max_batch_size
from torchmem.estimator.changes import Changes, Seen, applied
from torchmem.records.advice import AdviceRecord, Change, LargestBatch
from torchmem.records.run import ModulePeak
from torchmem.report import Report
from torchmem.units import readable_size

CHECKPOINT_KINDS = 3
"""How many classes of modules checkpointing is tried with (those whose instances keep the
most for backward), one estimate each."""


@dataclass(frozen=True)
class Advice(AdviceRecord, Report):
    """What :func:`advise` returns (the fields are
    :class:`~torchmem.records.advice.AdviceRecord`'s): prints as a table, shows as HTML in
    Jupyter, and writes its JSON."""

    renderer = "advice"


def advise(
    fn: Callable[..., Any],
    *args: Any,
    device: str = "cuda",
    capacity: int | float | str | None = None,
    **kwargs: Any,
) -> Advice:
    """Changes that lower the memory ``fn(*args, **kwargs)`` needs on `device`, each with
    the saving the estimator computed by estimating the step with it made (see
    :func:`~torchmem.estimate` for `fn`, `args` and `device`). Tried, each alone:

    - activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``) of
      every module of a class whose modules keep the most for backward (the
      :data:`CHECKPOINT_KINDS` classes of modules, below the outermost module, that call
      submodules of their own, each tried; the best listed, its modules named);
    - the outermost modules' forward under ``torch.autocast(dtype=torch.bfloat16)``, where
      the step does not use autocast already;
    - ``zero_grad(set_to_none=True)``, where the step calls ``zero_grad(set_to_none=False)``;
    - ``foreach=False`` for the optimizer, where a step uses ``foreach`` (on CUDA by
      default; on the CPU only where asked for).

    A change is listed only where its estimated peak allocated is lower than the step's;
    the notes say why each other one is not. The changes listed are estimated together
    too (:attr:`~torchmem.records.advice.AdviceRecord.advised_peak_bytes`).

    Args:
        capacity: a GPU's name (``"H100-80GB"``, see :data:`~torchmem.estimator.gpus.GPUS`)
            or its memory (bytes, or a size like ``"80 GiB"``): also find the largest batch
            that fits it, as the step is and with the changes listed, by
            :func:`~torchmem.max_batch_size`. `fn` then takes the batch size first, and
            ``args[0]`` is the batch the changes are estimated at.
    """
    started = time.perf_counter()
    limit = None if capacity is None else gpus.capacity(capacity)
    if limit is not None and (not args or not isinstance(args[0], int)):
        raise TypeError("advise() with a capacity calls fn with the batch size first: give it")
    trial = _Trial(fn, args, kwargs, device)
    seen = Seen()
    before = trial.estimate(Changes(), seen)
    trial.device_type = before.device
    found, notes = _tried(trial, before, seen)
    together = _together([changes for _, changes in found])
    after = before if together is None else trial.estimate(together)
    largest = None
    if limit is not None:
        largest = _largest_batch(
            trial, capacity if isinstance(capacity, str) else "", limit, together
        )
    return Advice(
        function=before.function,
        device=before.device,
        peak_bytes=before.peak_bytes,
        reserved_bytes=before.reserved_bytes,
        changes=tuple(change for change, _ in found),
        advised_peak_bytes=after.peak_bytes,
        advised_reserved_bytes=after.reserved_bytes,
        largest_batch=largest,
        notes=tuple(notes),
        seconds=time.perf_counter() - started,
    )


def _tried(
    trial: _Trial, before: Estimate, seen: Seen
) -> tuple[list[tuple[Change, Changes]], list[str]]:
    """Each change that lowers the peak, largest saving first, with how to make it; the
    notes: the estimate's, and why each other change is not listed."""
    found: list[tuple[Change, Changes]] = []
    notes = list(before.notes)
    for attempt in (_checkpoint, _autocast, _set_to_none, _no_foreach):
        tried, note = attempt(trial, before, seen)
        if tried is not None:
            found.append(tried)
        if note:
            notes.append(note)
    found.sort(key=lambda pair: -pair[0].saving_bytes)
    return found, notes


class _Trial:
    """The step, estimated with changes made."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.device = device
        self.device_type = "cuda"
        """The estimate's target (``"cuda"`` or ``"cpu"``), once the first is made."""

    def changed(self, changes: Changes, seen: Seen | None = None) -> Callable[..., Any]:
        """`fn` with `changes` made while it runs."""
        changes = replace(changes, device_type=self.device_type)

        @functools.wraps(self.fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            with applied(changes, seen):
                return self.fn(*args, **kwargs)

        return step

    def estimate(self, changes: Changes, seen: Seen | None = None) -> Estimate:
        return estimate(self.changed(changes, seen), *self.args, device=self.device, **self.kwargs)


def _change(
    kind: str, action: str, before: Estimate, after: Estimate, modules: tuple[str, ...] = ()
) -> Change:
    return Change(
        kind=kind,
        action=action,
        peak_bytes=after.peak_bytes,
        reserved_bytes=after.reserved_bytes,
        saving_bytes=before.peak_bytes - after.peak_bytes,
        reserved_saving_bytes=before.reserved_bytes - after.reserved_bytes,
        modules=modules,
    )


_Tried = tuple[tuple[Change, Changes] | None, str | None]
"""A change found to save memory (with how to make it), or None; and a note of why not."""


def _verdict(
    kind: str,
    action: str,
    before: Estimate,
    after: Estimate,
    changes: Changes,
    modules: tuple[str, ...] = (),
) -> _Tried:
    """The change where `after` peaks lower than `before`; else a note of what it did."""
    change = _change(kind, action, before, after, modules)
    if change.saving_bytes > 0:
        return (change, changes), None
    rise = -change.saving_bytes
    what = "leaves the peak as it is" if not rise else f"raises the peak by {readable_size(rise)}"
    return None, f"{kind}: not advised: estimated, {action[0].lower()}{action[1:]} {what}."


def checkpoint_candidates(modules: Sequence[ModulePeak]) -> list[tuple[str, tuple[str, ...]]]:
    """Classes of modules to checkpoint, most kept for backward first, each with the names
    of its modules: modules below an outermost one that call submodules of their own and
    keep bytes for a backward pass (checkpointing a single layer saves nothing: its input
    stays kept), the outermost of a class where one holds another; at most
    :data:`CHECKPOINT_KINDS` classes."""
    names = {m.name for m in modules}
    parents = {_parent(name) for name in names}
    kept: dict[str, int] = {}
    found: dict[str, list[str]] = {}
    for module in modules:
        if module.backward_peak_bytes is None or module.forward_kept_bytes <= 0:
            continue
        if module.name not in parents or not any(a in names for a in _ancestors(module.name)):
            continue  # calls no submodule, or an outermost module
        found.setdefault(module.type, []).append(module.name)
        kept[module.type] = kept.get(module.type, 0) + module.forward_kept_bytes
    groups = []
    for kind, members in found.items():
        chosen = set(members)
        outer = tuple(n for n in members if not any(a in chosen for a in _ancestors(n)))
        groups.append((kind, outer))
    groups.sort(key=lambda group: -kept[group[0]])
    return groups[:CHECKPOINT_KINDS]


def _parent(name: str) -> str | None:
    return name.rpartition(".")[0] if name else None


def _ancestors(name: str) -> list[str]:
    found = []
    parent = _parent(name)
    while parent is not None:
        found.append(parent)
        parent = _parent(parent)
    return found


def _checkpoint(trial: _Trial, before: Estimate, seen: Seen) -> _Tried:
    candidates = checkpoint_candidates(before.modules)
    if not candidates:
        return None, (
            "checkpoint: not tried: no module below the outermost one calls submodules of"
            " its own and keeps activations for backward (checkpointing a single layer"
            " saves nothing: its input stays kept)."
        )
    tried = []
    for kind, names in candidates:
        changes = Changes(checkpoint=frozenset(names))
        action = (
            f"Checkpoint each {kind} ({_listed(names)}) with torch.utils.checkpoint.checkpoint"
            "(module, ..., use_reentrant=False)"
        )
        tried.append(
            _verdict("checkpoint", action, before, trial.estimate(changes), changes, names)
        )
    saving = [(found, note) for found, note in tried if found is not None]
    if saving:
        return max(saving, key=lambda pair: pair[0][0].saving_bytes)
    return None, " ".join(note for _, note in tried if note)


def _listed(names: Sequence[str], most: int = 4) -> str:
    shown = [name or "the model" for name in names[:most]]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


def _autocast(trial: _Trial, before: Estimate, seen: Seen) -> _Tried:
    if seen.autocast:
        return None, "autocast: not tried: the forward already runs under autocast."
    changes = Changes(autocast=True)
    action = (
        f"Run the model's forward under torch.autocast({trial.device_type!r}, dtype=torch.bfloat16)"
    )
    return _verdict("autocast", action, before, trial.estimate(changes), changes)


def _set_to_none(trial: _Trial, before: Estimate, seen: Seen) -> _Tried:
    if not seen.kept_gradients:
        return None, "set_to_none: not tried: the step never calls zero_grad(set_to_none=False)."
    changes = Changes(set_to_none=True)
    action = "Zero gradients with zero_grad(set_to_none=True), the default, not False"
    return _verdict("set_to_none", action, before, trial.estimate(changes), changes)


def _no_foreach(trial: _Trial, before: Estimate, seen: Seen) -> _Tried:
    if not seen.foreach_steps:
        return None, (
            "foreach: not tried: no optimizer step uses foreach (on the CPU, optimizers"
            " step one tensor at a time unless given foreach=True; fused ones have no"
            " foreach temporaries)."
        )
    changes = Changes(no_foreach=True)
    action = "Create the optimizer with foreach=False (one parameter at a time in its step)"
    return _verdict("foreach", action, before, trial.estimate(changes), changes)


def _together(found: list[Changes]) -> Changes | None:
    """Every change of `found` at once; None where there is none."""
    if not found:
        return None
    return Changes(
        checkpoint=frozenset().union(*(c.checkpoint for c in found)),
        autocast=any(c.autocast for c in found),
        set_to_none=any(c.set_to_none for c in found),
        no_foreach=any(c.no_foreach for c in found),
    )


def _largest_batch(trial: _Trial, gpu: str, limit: int, together: Changes | None) -> LargestBatch:
    """The largest batch that fits `limit` bytes, as the step is and with `together`."""
    rest = trial.args[1:]

    def largest(changes: Changes) -> int:
        step = trial.changed(changes)
        return max_batch_size(step, limit, *rest, device=trial.device, **trial.kwargs)

    batch = largest(Changes())
    advised = batch if together is None else largest(together)
    return LargestBatch(gpu=gpu, capacity_bytes=limit, batch=batch, advised_batch=advised)
