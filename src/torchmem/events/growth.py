"""From a device's tally to its training steps and, where memory rises at the end of each
step, the lines whose allocations outlive their step and why they do; and the variables
that keep autograd graphs of every step.

The lines are what the last steps of the rise (at most
:data:`~torchmem.events.steps.WINDOW`) changed, line by line: the bytes their allocations
made and alive at the last step's end, less those made before the steps and freed in
them (a tensor replaced each step by a larger one grows by the difference), shared over
the steps so that the lines sum to the growth per step exactly; none that changed nothing.

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

A variable that keeps the autograd graphs of (nearly) every step is a growth of its own
(:attr:`~torchmem.records.run.Growth.graphs`), even where the tensors do not grow: after
a backward pass a graph keeps no tensor, but its nodes are the process's memory
(``total_loss += loss``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchmem.events import steps
from torchmem.events.analysis import BEFORE, source
from torchmem.events.holders import GRAPH, UNSEEN
from torchmem.events.hooks import ACTIVATIONS
from torchmem.events.notes import NameTable
from torchmem.events.sources import Tallied
from torchmem.events.table import Table
from torchmem.events.tally import BEFORE_SITE
from torchmem.meters.native import NO_PYTHON_SITE
from torchmem.records.frames import NO_PYTHON
from torchmem.records.run import STEPS_LISTED, Growth, GrowthSite, HeldGraph, Step

SITES = 5
"""Lines a growth lists at most (the others together, as one more)."""
FREED = "alive at the last step's end, freed before the recording stopped (what held it was gone)"
"""The reason given for allocations freed before the recording stopped."""
MODULES_NAMED = 3
"""Modules a reason names at most (the others are counted)."""
Where = tuple[str, int, str]
"""A line: file, line number, function."""


@dataclass(frozen=True)
class Kept:
    """What a device's steps are, and what the last steps of its rise changed."""

    table: steps.StepTable
    rise: tuple[int, int, bool] | None
    """``(first step, bytes per step, exact)`` of :func:`~torchmem.events.steps.rise`."""
    made: Table
    """The allocations made in the last :attr:`window` steps and alive at their end (the
    steps of the rise but the last, where it has more than
    :data:`~torchmem.events.steps.MIN_STEADY`: what the last one made may be still held by
    the loop's variables)."""
    lost: Table
    """The allocations made before those steps (or the recording) and freed in them."""
    freed: np.ndarray
    """Which of :attr:`made` were freed before the recording stopped (a loop in a
    function that returned): nothing holds them any more to be asked why."""
    window: int
    """How many steps :attr:`made` and :attr:`lost` come from: the last of the rise, at
    most :data:`~torchmem.events.steps.WINDOW` (0 where there is no rise)."""
    unnamed: int
    """What those steps changed that no allocation's record tells: storages from before
    the recording that no record held, freed in them."""
    current: Table
    """The allocations alive when the recording stopped that were made from the first of
    those steps on (what a line's allocations were replaced by since: a tensor made anew
    each step)."""


def kept(found: Tallied, ram: np.ndarray) -> Kept | None:
    """The steps of a device's tally (`ram`: the process's RSS where steps may have ended,
    :meth:`~torchmem.events.phases.Phases.ram`) and, where their ends rise, what the last
    steps of the rise changed; None where no step ended."""
    tally = found.tally
    table = steps.table(tally.steps, tally.start, ram)
    if table is None:
        return None
    rise = steps.rise(table.end)
    if rise is None:
        empty = Table.empty()
        return Kept(table, None, empty, empty, np.zeros(0, bool), 0, 0, empty)
    last = len(table) - 1
    if last - rise[0] >= steps.MIN_STEADY:
        last -= 1  # what the last step made may be the loop's variables': the step before's is not
    window = min(steps.WINDOW, last - rise[0] + 1)
    start, end = int(table.last_row[last - window]), int(table.last_row[last])
    after = tally.steps.gone(end)
    alive = tally.live.concat(after)
    made = alive.take((alive.born > start) & (alive.born <= end))
    lost = tally.steps.gone(start, end)
    lost = lost.take(lost.born <= start)
    change = int(table.end[last] - table.end[last - window])
    unnamed = change - int(made.size.sum()) + int(lost.size.sum())
    current = tally.live.take(tally.live.born > start)
    freed = np.isin(made.key, after.key)
    return Kept(table, rise, made, lost, freed, window, unnamed, current)


def asked(result: Kept) -> np.ndarray:
    """The addresses whose holders say why a rise's lines grow: of :attr:`Kept.made` not
    freed, and of :attr:`Kept.current` from a line whose all were (replaced since)."""
    made, current = result.made, result.current
    gone = {(s, o) for s, o, f in zip(made.site, made.owner, result.freed, strict=True) if f}
    gone -= {(s, o) for s, o, f in zip(made.site, made.owner, result.freed, strict=True) if not f}
    replaced = [(s, o) in gone for s, o in zip(current.site, current.owner, strict=True)]
    return np.concatenate([made.ptr[~result.freed], current.ptr[np.array(replaced, bool)]])


def made_in_steps(found: Tallied, table: steps.StepTable) -> dict[int, int]:
    """The storages alive now that the steps made: address -> the step that made it."""
    live = found.tally.live
    made = (live.born >= 0) & (live.born <= table.last_row[-1])
    step = np.searchsorted(table.last_row, live.born[made])
    return dict(zip(live.ptr[made].tolist(), step.tolist(), strict=True))


def step_records(table: steps.StepTable, origin: int) -> tuple[Step, ...]:
    """The steps as records (times from `origin`, ``time.monotonic_ns()``): each one,
    or past :data:`STEPS_LISTED` the first and groups of steps in a row."""
    n = len(table)
    size = 1 if n <= STEPS_LISTED else -(-(n - 1) // (STEPS_LISTED - 1))
    firsts = [0, *range(1, n, size)] if size > 1 else list(range(n))
    found = []
    for i, first in enumerate(firsts):
        last = (firsts[i + 1] if i + 1 < len(firsts) else n) - 1
        ram = int(table.ram[last])
        found.append(
            Step(
                first,
                int(table.start[first]),
                int(table.peak[first : last + 1].max()),
                int(table.end[last]),
                (int(table.began[first]) - origin) / 1e9,
                (int(table.ended[last]) - origin) / 1e9,
                last - first + 1,
                None if ram < 0 else ram,
            )
        )
    return tuple(found)


def lasting(graphs: Sequence[HeldGraph], table: steps.StepTable) -> tuple[HeldGraph, ...]:
    """The graphs of `graphs` kept from (nearly) every step of `table`: at least
    :data:`~torchmem.events.steps.RISING` of them, and more than
    :data:`~torchmem.events.steps.MIN_STEADY` (a graph kept a few steps, as truncated
    backpropagation through time keeps one, is no growth)."""
    least = max(steps.MIN_STEADY + 1, math.ceil(steps.RISING * len(table)))
    return tuple(g for g in graphs if g.steps >= least)


def growth(
    found: Tallied,
    result: Kept,
    names: NameTable,
    modules: dict[int, str],
    forwards: np.ndarray,
    held: dict[int, str],
    graphs: tuple[HeldGraph, ...] = (),
) -> Growth | None:
    """The growth finding of a device: where its steps' ends rise, or where `graphs` (see
    :func:`lasting`) keep the autograd graphs of every step; else None.

    Args:
        names: the marks' names, by index.
        modules: module id -> its name in the report.
        forwards: the forward calls (:meth:`~torchmem.events.phases.Phases.forwards`).
        held: address -> what held the storage there when the recording stopped
            (:func:`~torchmem.events.holders.holders`).
    """
    table = result.table
    if result.rise is None:
        if not graphs or len(table) <= steps.MIN_STEADY:
            return None
        ram = _ram_per_step(table, 1)
        return Growth(found.device, 0, 1, len(table) - 1, False, (), ram, graphs)
    first, per_step, exact = result.rise
    listed = _sites(found, result, names, modules, forwards, held)
    ram = _ram_per_step(table, first)
    return Growth(found.device, per_step, first, len(table) - first, exact, listed, ram, graphs)


def _ram_per_step(table: steps.StepTable, first: int) -> int | None:
    """The rise of the process's RSS over the second half of the steps from `first` to
    the last, per step (the first half has what a run's caches, and the recording's own,
    take once); None where either end was not read."""
    begin = first - 1 + (len(table) - first) // 2
    before, last = int(table.ram[begin]), int(table.ram[-1])
    if before < 0 or last < 0:
        return None
    return (last - before) // (len(table) - 1 - begin)


def _sites(
    found: Tallied,
    result: Kept,
    names: NameTable,
    modules: dict[int, str],
    forwards: np.ndarray,
    held: dict[int, str],
) -> tuple[GrowthSite, ...]:
    """The lines of a rise, each with its share of the growth per step (never 0), most
    first: :data:`SITES` of them, the others together."""
    assert result.rise is not None
    nets = _nets(found, result, modules)
    lines = {where: net for where, net in nets.items() if net}
    shares = _shared(list(lines.values()), result.window, result.rise[1])
    made = _members(found, result.made, modules)
    now = _members(found, result.current, modules)
    found_sites = []
    for where, share in zip(lines, shares, strict=True):
        if not share:
            continue
        chosen = np.array(made.get(where, []), np.int64)
        rows, freed = result.made.take(chosen), result.freed[chosen]
        if len(rows) and freed.all() and where in now:  # replaced since: by what lives now
            rows = result.current.take(np.array(now[where], np.int64))
            freed = np.zeros(len(rows), bool)
        why = reason(rows, freed, names, modules, forwards, held) if len(rows) else None
        key = found.sites.get(int(rows.site[0])) if len(rows) and where[1] else None
        found_sites.append(GrowthSite(*where, share, source(key) if key else None, why))
    found_sites.sort(key=lambda s: s.bytes_per_step, reverse=True)
    listed, rest = found_sites[:SITES], found_sites[SITES:]
    if sum(s.bytes_per_step for s in rest):
        more = GrowthSite(f"<{len(rest)} more lines>", 0, "", sum(s.bytes_per_step for s in rest))
        listed.append(more)
    return tuple(listed)


def _nets(found: Tallied, result: Kept, modules: dict[int, str]) -> dict[Where, int]:
    """What the steps measured changed, by line: :attr:`Kept.made` less
    :attr:`Kept.lost`, and what no record tells at ``<before recording>``."""
    nets: dict[Where, int] = {}
    for table, sign in ((result.made, 1), (result.lost, -1)):
        for where, members in _members(found, table, modules).items():
            nets[where] = nets.get(where, 0) + sign * int(table.size[members].sum())
    if result.unnamed:
        nets[BEFORE, 0, ""] = nets.get((BEFORE, 0, ""), 0) + result.unnamed
    return nets


def _members(found: Tallied, table: Table, modules: dict[int, str]) -> dict[Where, list[int]]:
    """The allocations of `table` by line: their indices."""
    site = np.where(table.born < 0, BEFORE_SITE, table.site)
    pairs = np.stack([site, table.owner], axis=1)
    unique, inverse = np.unique(pairs, axis=0, return_inverse=True)
    found_lines: dict[Where, list[int]] = {}
    for group, (at, by) in enumerate(unique.tolist()):
        where = _where(found, at, by, modules)
        found_lines.setdefault(where, []).extend(np.flatnonzero(inverse == group).tolist())
    return found_lines


def _where(found: Tallied, site: int, owner: int, modules: dict[int, str]) -> Where:
    """The line of an allocation made at `site` (by autograd's engine for module
    `owner`, where that is not -1)."""
    if owner >= 0:
        return (f"backward of {modules.get(owner, 'a module')}", 0, "")
    key = found.sites.get(site)
    if key is not None:
        return (key[0], key[1], key[2])
    return (_pseudo(site), 0, "")


def _shared(nets: list[int], steps_measured: int, per_step: int) -> list[int]:
    """Each line's bytes a step (`nets` over `steps_measured`), in whole bytes that sum to
    the growth's `per_step` exactly: where the steps rose alike, that is what each line
    changed a step; else (the growth is a mean over more steps) a byte more for the
    largest remainders, or less for the smallest, and in proportion to what each changed
    where a byte each is not enough (all 0 where the lines changed nothing in all)."""
    shares = [net // steps_measured for net in nets]
    rest = [net - share * steps_measured for net, share in zip(nets, shares, strict=True)]
    missing = per_step - sum(shares)
    if abs(missing) > len(nets):
        return _proportion(nets, per_step)
    order = sorted(range(len(nets)), key=lambda i: (rest[i], nets[i]))
    for i in order[::-1][:missing] if missing > 0 else order[:-missing]:
        shares[i] += 1 if missing > 0 else -1
    return shares


def _proportion(nets: list[int], per_step: int) -> list[int]:
    """`per_step` shared in proportion to `nets`, in whole bytes that sum to it (the
    largest remainders get a byte more); all 0 where they sum to nothing."""
    total = sum(nets)
    if total <= 0:
        return [0] * len(nets)
    scaled = [net * per_step for net in nets]
    shares = [value // total for value in scaled]
    order = sorted(range(len(nets)), key=lambda i: (shares[i] * total - scaled[i], i))
    for i in order[: per_step - sum(shares)]:
        shares[i] += 1
    return shares


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
    if site == BEFORE_SITE:
        return BEFORE
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
