"""From a device's tally to its training steps and, where memory rises at the end of each
step, the lines whose allocations outlive their step and why they do.

Why, where it can be told (nothing is claimed that was not seen):

- held by a variable, a list, tuple or dictionary, an object's attribute, a module's
  hook or a module's global: what :func:`~torchmem.events.holders.holders` found when
  the recording stopped;
- kept with an autograd graph: tensors autograd saved for a backward pass (a
  saved-tensor hook marked them) that no Python object holds but a graph; the modules
  that saved them are named, and the forward calls that saved them told apart: a
  backward pass went through them (only ``retain_graph=True`` keeps saved tensors after
  that) or none did (a forward pass with gradients on whose output no backward pass
  used: evaluation without ``torch.no_grad()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchmem.events import steps
from torchmem.events.analysis import source
from torchmem.events.holders import GRAPH, UNSEEN
from torchmem.events.hooks import ACTIVATIONS
from torchmem.events.notes import NameTable
from torchmem.events.sources import Tallied
from torchmem.events.table import Table
from torchmem.meters.native import NO_PYTHON_SITE
from torchmem.records.frames import NO_PYTHON
from torchmem.records.run import STEPS_LISTED, Growth, GrowthSite, Step

SITES = 5
"""Lines a growth lists at most."""
FREED = "alive at the last step's end, freed before the recording stopped (what held it was gone)"
"""The reason given for allocations freed before the recording stopped."""
MODULES_NAMED = 3
"""Modules a reason names at most (the others are counted)."""


@dataclass(frozen=True)
class Kept:
    """What a device's steps are, and what outlives the steps of its rise."""

    table: steps.StepTable
    rise: tuple[int, int, bool] | None
    """``(first step, bytes per step, exact)`` of :func:`~torchmem.events.steps.rise`."""
    survivors: Table
    """The allocations made in the steps counted (of the rise) and alive at the last
    step's end."""
    freed: np.ndarray
    """Which of :attr:`survivors` were freed before the recording stopped (a loop in a
    function that returned): nothing holds them any more to be asked why."""
    counted: int
    """How many steps :attr:`survivors` come from: those of the rise but the last, whose
    allocations may still be held by the program's variables (all of them where the rise
    has only :data:`~torchmem.events.steps.MIN_STEADY` steps)."""


def kept(found: Tallied) -> Kept | None:
    """The steps of a device's tally and, where their ends rise, what outlives them; None
    where no step ended."""
    table = steps.table(found.tally.steps, found.tally.start)
    if table is None:
        return None
    rise = steps.rise(table.end)
    if rise is None:
        return Kept(table, None, Table.empty(), np.zeros(0, bool), 0)
    gone = found.tally.steps.gone(int(table.last_row[-1]))
    alive = found.tally.live.concat(gone)
    first, last = rise[0], len(table) - 1
    if last - first >= steps.MIN_STEADY:
        last -= 1
    step = np.searchsorted(table.last_row, alive.born)
    survivors = alive.take((alive.born >= 0) & (step >= first) & (step <= last))
    freed = np.isin(survivors.key, gone.key)
    return Kept(table, rise, survivors, freed, last - first + 1)


def step_records(table: steps.StepTable, origin: int) -> tuple[Step, ...]:
    """The steps as records (times from `origin`, ``time.monotonic_ns()``): each one,
    or past :data:`STEPS_LISTED` the first and groups of steps in a row."""
    n = len(table)
    size = 1 if n <= STEPS_LISTED else -(-(n - 1) // (STEPS_LISTED - 1))
    firsts = [0, *range(1, n, size)] if size > 1 else list(range(n))
    found = []
    for i, first in enumerate(firsts):
        last = (firsts[i + 1] if i + 1 < len(firsts) else n) - 1
        found.append(
            Step(
                first,
                int(table.start[first]),
                int(table.peak[first : last + 1].max()),
                int(table.end[last]),
                (int(table.began[first]) - origin) / 1e9,
                (int(table.ended[last]) - origin) / 1e9,
                last - first + 1,
            )
        )
    return tuple(found)


def growth(
    found: Tallied,
    result: Kept,
    names: NameTable,
    modules: dict[int, str],
    forwards: np.ndarray,
    held: dict[int, str],
) -> Growth | None:
    """The growth finding of a device (None where its steps' ends do not rise).

    Args:
        names: the marks' names, by index.
        modules: module id -> its name in the report.
        forwards: the forward calls (:meth:`~torchmem.events.phases.Phases.forwards`).
        held: address -> what held the storage there when the recording stopped
            (:func:`~torchmem.events.holders.holders`).
    """
    if result.rise is None:
        return None
    first, per_step, exact = result.rise
    rows = result.survivors
    pairs = np.stack([rows.site, rows.owner], axis=1)
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    totals = np.bincount(inverse, weights=rows.size, minlength=len(unique))
    sites: dict[tuple[str, int, str], list[int]] = {}
    for group in np.argsort(-totals, kind="stable").tolist():
        site, owner = (int(v) for v in unique[group])
        key = found.sites.get(site)
        where = (key[0], key[1], key[2]) if key is not None else (_pseudo(site), 0, "")
        if owner >= 0:
            where = (f"backward of {modules.get(owner, 'a module')}", 0, "")
        sites.setdefault(where, []).extend(np.flatnonzero(inverse == group).tolist())
    listed = []
    for where, members in list(sites.items())[:SITES]:
        chosen = np.array(members, np.int64)
        group_rows = rows.take(chosen)
        key = found.sites.get(int(group_rows.site[0]))
        why = reason(group_rows, result.freed[chosen], names, modules, forwards, held)
        listed.append(
            GrowthSite(
                *where,
                int(group_rows.size.sum()) // result.counted,
                source(key) if key is not None and where[1] else None,
                why,
            )
        )
    listed.sort(key=lambda s: s.bytes_per_step, reverse=True)
    steady = len(result.table) - first
    return Growth(found.device, per_step, first, steady, exact, tuple(listed))


def reason(
    rows: Table,
    freed: np.ndarray,
    names: NameTable,
    modules: dict[int, str],
    forwards: np.ndarray,
    held: dict[int, str],
) -> str | None:
    """Why allocations `rows` outlive their step, in words; None where nothing says. Those
    `freed` before the recording stopped say only that, and what autograd saved."""
    if freed.all():
        saved = rows.cat == ACTIVATIONS
        owners = _owners(rows, saved, names, modules)
        by = f" by {_listed(owners)}" if owners else ""
        return FREED + (f"; saved for backward{by}" if saved.any() else "")
    rows = rows.take(~freed)
    by_bytes: dict[str, int] = {}
    for ptr, size in zip(rows.ptr.tolist(), rows.size.tolist(), strict=True):
        if ptr in held:
            by_bytes[held[ptr]] = by_bytes.get(held[ptr], 0) + size
    found = sorted(by_bytes, key=lambda h: -by_bytes[h])
    parts = [h for h in found if _direct(h)][:2]
    # Saved for backward, and held by no Python object but through a graph: it keeps them.
    direct = np.array([_direct(held.get(p, UNSEEN)) for p in rows.ptr.tolist()], bool)
    saved = (rows.cat == ACTIVATIONS) & ~direct
    if saved.any():
        owners = _owners(rows, saved, names, modules)
        graph = next((h.removeprefix(GRAPH) for h in found if h.startswith(GRAPH)), None)
        whose = f"the autograd graph of {graph}" if graph else "its autograd graph"
        text = f"kept with {whose}{_saved_by(owners)}"
        after = _backed(rows.time[saved], forwards)
        if after is not None:
            text += (
                ", after a backward pass through it (retain_graph=True)"
                if after
                else ", and no backward pass went through it (evaluation without torch.no_grad())"
            )
        parts.append(text)
    return "; ".join(parts) or None


def _owners(rows: Table, saved: np.ndarray, names: NameTable, modules: dict[int, str]) -> list[str]:
    """The modules that saved allocations `saved` of `rows` for backward, named."""
    owners: dict[str, None] = {}
    for index in np.unique(rows.name[saved]).tolist():
        entry = names.entries[index][0] if 0 <= index < len(names.entries) else None
        if entry is not None and entry[0] == "saved":
            owners.setdefault(modules.get(entry[1], "the model"))
    return list(owners)


def _pseudo(site: int) -> str:
    """The file a site with no frame is listed under."""
    return NO_PYTHON if site == NO_PYTHON_SITE else "<no site recorded>"


def _direct(holder: str) -> bool:
    """Whether `holder` (a text of :func:`~torchmem.events.holders.holders`) is a Python
    object holding the tensor itself, not a graph."""
    return not holder.startswith(GRAPH) and holder != UNSEEN


def _saved_by(owners: Sequence[str]) -> str:
    if not owners:
        return " (tensors saved for backward)"
    return f" (saved tensors of {_listed(owners)})"


def _listed(owners: Sequence[str]) -> str:
    """``2 modules: fc1 (Linear), act (ReLU)``."""
    named = ", ".join(owners[:MODULES_NAMED])
    more = f" and {len(owners) - MODULES_NAMED} more" if len(owners) > MODULES_NAMED else ""
    noun = "module" if len(owners) == 1 else "modules"
    return f"{len(owners)} {noun}: {named}{more}"


def _backed(times: np.ndarray, forwards: np.ndarray) -> bool | None:
    """Whether a backward pass went through the forward calls that saved tensors made at
    `times` (each the first call ending at or after it): True for all, False for none,
    None where they differ or no call is known."""
    if not len(forwards):
        return None
    at = np.searchsorted(forwards[:, 1], times)
    if (at >= len(forwards)).any():
        return None
    backed = forwards[at, 2]
    if (backed == 1).all():
        return True
    if (backed == 0).all():
        return False
    return None
