"""Training steps in a device's event stream: where each ends, the use there, and the
highest use inside it; and whether the use at the steps' ends keeps rising.

A step ends where ``optimizer.step()`` returns; in a run with no optimizer, where a
backward pass through the outermost modules ends (its last gradient); in a run with
neither, where a forward call of the first outermost module called returns. The first
step begins where the recording began, each other where the one before it ended; what
runs after the last end belongs to no step. Steps that end with nothing between them that
begins a forward pass (two optimizers stepped one after the other; the gradients of a
model and of its loss module) are one step, ending at the last of them.

Kept as the stream passes: four int64 per step (its end's time, row, use, and the highest
use since the step before), about 32 bytes a step for each of the three kinds of end (a
million steps: about 100 MB, as the phases of :mod:`torchmem.events.phases`); exact, as
the stream is (every allocation and free), and linear in the rows. Of the allocations
freed, those of the step in progress and, over the last :data:`WINDOW` steps, those that
outlived the step they were made in: a growth's lines are what these steps made and kept
less what they freed of earlier ones.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from torchmem.events.rows import CLOSE, HIT, KIND, OPEN, REF, SITE, STEP
from torchmem.events.table import Table as Table

BY = ("optimizer.step()", "backward", "forward")
"""What ends a step, in the order of preference: the first found in a run is used."""
MIN_STEADY = 3
"""Steps after the first that must have ended before a rise is a finding."""
RISING = 0.9
"""The share of the steady steps whose end must be above the one before."""
WINDOW = 8
"""The last steps whose frees of earlier steps' allocations are kept, at most."""
_LOW = np.iinfo(np.int64).min


class Ends:
    """The rows of one kind where a step may end, as the stream passes: per end, its time
    (``time.monotonic_ns()``), sequence number, the use after it, and the highest use since
    the end before (the recording's start for the first). Ends with no separator between
    them are one: the last of them."""

    def __init__(self, base: int) -> None:
        self.rows = array("q")
        """``time, seq, use, high`` of each end, flat."""
        self._high = base
        """The highest use since the last end kept (at the start: the use then)."""
        self._joinable = False
        """Whether no separator came since the last end kept (the next end replaces it)."""

    def feed(
        self, at: np.ndarray, separators: np.ndarray, times: np.ndarray, cur: np.ndarray, seq: int
    ) -> None:
        """The ends at rows `at` (sorted) of a chunk of rows whose first is row `seq`, the
        separators at rows `separators` (sorted), the chunk's `times` and use `cur`."""
        if not len(at):
            self._high = max(self._high, int(cur.max())) if len(cur) else self._high
            self._joinable = self._joinable and not len(separators)
            return
        highs = np.maximum.reduceat(cur[: at[-1] + 1], np.r_[0, at[:-1] + 1])
        highs[0] = max(int(highs[0]), self._high)
        before = np.searchsorted(separators, at)
        if self._joinable and before[0] == 0 and self.rows:
            highs[0] = max(int(highs[0]), self.rows[-1])
            del self.rows[-4:]
        groups = np.flatnonzero(np.r_[True, before[1:] != before[:-1]])
        ends = at[np.r_[groups[1:] - 1, len(at) - 1]]
        found = np.stack(
            [times[ends], seq + ends, cur[ends], np.maximum.reduceat(highs, groups)], axis=1
        )
        self.rows.extend(found.ravel().tolist())
        rest = cur[at[-1] + 1 :]
        self._high = int(rest.max()) if len(rest) else _LOW
        self._joinable = int(before[-1]) == len(separators)

    def read(self) -> np.ndarray:
        """The ends, one row each: time, sequence number, use, highest use since the end
        before."""
        found: np.ndarray = np.frombuffer(self.rows, np.int64).reshape(-1, 4).copy()
        return found


@dataclass(frozen=True)
class Found:
    """Where a chunk of rows may end a step, of each kind of :data:`BY`: the rows, and
    those that separate two ends (an end with no separator since the one before replaces
    it)."""

    rows: dict[str, tuple[np.ndarray, np.ndarray]]
    """Per kind: the rows that may end a step, the rows that separate them."""

    @property
    def ends(self) -> np.ndarray:
        """Every row that may end a step, sorted (what is alive at one may outlive its
        step: it needs a record)."""
        return np.unique(np.concatenate([at for at, _ in self.rows.values()]))


class StepEnds:
    """Where a step may end, of each kind of :data:`BY`, as a tally's stream passes; and
    the allocations that died after the latest end of each kind (alive at the last step's
    end, which a program may free before the recording stops: a loop in a function that
    returned)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.kinds = {by: Ends(base) for by in BY}
        self.root = -1
        """The module index of the first outermost module whose forward call returned."""
        self._gone: list[tuple[Table, np.ndarray]] = []
        """Records that died after the earliest of the kinds' latest ends, with the row of
        their free."""

    def find(self, rows: np.ndarray) -> Found:
        """Where the chunk `rows` may end a step: an optimizer's step, a gradient an
        outermost module's backward pass ends with (depth 0), the return of a forward call
        of the first outermost module called; separated by an outermost module's forward
        call beginning (and, for backward passes, a step)."""
        kind, ref = rows[:, KIND], rows[:, REF]
        opened = (kind == OPEN) & (ref == 0)
        returned = np.where((kind == CLOSE) & (ref == 0), rows[:, SITE], -1)
        if self.root < 0 and (returned >= 0).any():
            self.root = int(returned[returned >= 0][0])
        stepped, begins = kind == STEP, np.flatnonzero(opened)
        return Found(
            {
                BY[0]: (np.flatnonzero(stepped), begins),
                BY[1]: (
                    np.flatnonzero((kind == HIT) & (ref == 1)),
                    np.flatnonzero(opened | stepped),
                ),
                BY[2]: (np.flatnonzero((returned == self.root) & (self.root >= 0)), begins),
            }
        )

    def feed(self, times: np.ndarray, cur: np.ndarray, seq: int, found: Found) -> None:
        """A chunk of rows (the first is row `seq`): their times, the use after each, and
        where they may end a step (:meth:`find`)."""
        for by, (at, separators) in found.rows.items():
            self.kinds[by].feed(at, separators, times, cur, seq)

    def bury(self, records: Table, died: np.ndarray, dead: np.ndarray) -> None:
        """The records `dead` of `records` died, at rows `died`: kept where that was after
        the latest end of a step (of the kind that ends them now, the first of :data:`BY`
        found), or, for those made in an earlier step than they died in, after the end
        :data:`WINDOW` + 1 steps before it (none before a step ended)."""
        chosen = next((e.rows for e in self.kinds.values() if e.rows), None)
        if chosen is None:
            return
        ends = np.frombuffer(chosen, np.int64)[1::4]
        # The window may end a step before the last: one end more.
        latest, after = int(ends[-1]), int(ends[max(len(ends) - 2 - WINDOW, 0)])
        late = dead & (died > after)
        found = self._gone + ([(records.take(late), died[late])] if late.any() else [])
        self._gone = []
        for r, d in found:
            # An end between its birth and its death: it outlived the step it was made in.
            next_end = np.minimum(np.searchsorted(ends, r.born, side="right"), len(ends) - 1)
            keep = (d > latest) | ((d > after) & (ends[next_end] > r.born) & (ends[next_end] < d))
            if keep.any():
                self._gone.append((r, d) if keep.all() else (r.take(keep), d[keep]))

    def gone(self, after: int, until: int | None = None) -> Table:
        """The records that died after row `after` (and at or before row `until`)."""
        found = Table.empty()
        for records, died in self._gone:
            found = found.concat(
                records.take((died > after) & (True if until is None else died <= until))
            )
        return found

    def read(self) -> tuple[str, np.ndarray] | None:
        """What ended the steps (one of :data:`BY`) and the steps' ends (rows of
        :meth:`Ends.read`); None where no step ended."""
        for by, ends in self.kinds.items():
            if ends.rows:
                return by, ends.read()
        return None


@dataclass(frozen=True)
class StepTable:
    """The steps of a run on one device, in arrays of one entry a step."""

    by: str
    """What ended them: one of :data:`BY`."""
    start: np.ndarray
    """Bytes in use when each began."""
    peak: np.ndarray
    """The highest bytes in use in each."""
    end: np.ndarray
    """Bytes in use when each ended."""
    began: np.ndarray
    """``time.monotonic_ns()`` when each began."""
    ended: np.ndarray
    last_row: np.ndarray
    """Sequence number of each one's last row: a row belongs to the first step whose last
    row is at or after it."""
    ram: np.ndarray
    """The process's resident memory (RSS, bytes) when each ended; -1 where it was not
    read."""

    def __len__(self) -> int:
        return len(self.end)


def table(ends: StepEnds, start: int, ram: np.ndarray) -> StepTable | None:
    """The steps of a tally's stream (`start`: ``time.monotonic_ns()`` at its start), with
    the readings of the process's RSS `ram` (``time, rss`` rows in time order, from
    :meth:`~torchmem.events.phases.Phases.ram`): each step's is the last read at or before
    its end and after its beginning."""
    found = ends.read()
    if found is None:
        return None
    by, rows = found
    began_use = np.r_[ends.base, rows[:-1, 2]]
    began = np.r_[start, rows[:-1, 0]]
    at = np.searchsorted(ram[:, 0], rows[:, 0], side="right") - 1
    read = (at >= 0) & (ram[np.maximum(at, 0), 0] >= began) if len(ram) else at >= 0
    return StepTable(
        by,
        began_use,
        np.maximum(began_use, rows[:, 3]),
        rows[:, 2],
        began,
        rows[:, 0],
        rows[:, 1],
        np.where(read, ram[np.maximum(at, 0), 1] if len(ram) else -1, -1),
    )


def rise(end: np.ndarray) -> tuple[int, int, bool] | None:
    """Whether the bytes in use at the steps' ends (`end`) keep rising after the first
    step: ``(first step that rises, bytes per step from it, whether every step from it
    rose by exactly that)``; None where they do not.

    A rise is a finding where, from some step on, at least :data:`MIN_STEADY` steps ended
    and at least :data:`RISING` of them ended above the step before; the earliest such
    step is where it begins. Bytes per step are the rise from the end before it to the
    last end, over the steps; exact where each rose by the same (where all but the first
    of them did, the rise begins at the second)."""
    diff = np.diff(end)  # diff[k - 1]: what step k added
    if len(diff) < MIN_STEADY:
        return None
    up = diff > 0
    # Over steps k to the last, for each k from 1: how many rose, how many, and by what.
    rose = np.cumsum(up[::-1])[::-1]
    count = np.arange(len(diff), 0, -1)
    added = np.cumsum(diff[::-1])[::-1]
    ok = up & (rose >= RISING * count) & (added > 0) & (count >= MIN_STEADY)
    if not ok.any():
        return None
    first = int(np.argmax(ok))
    tail = diff[first:]
    if len(tail) > MIN_STEADY and (tail[1:] == tail[1]).all() and tail[0] != tail[1]:
        first, tail = first + 1, tail[1:]  # a first step unlike the others: periodic after it
    return first + 1, int(added[first]) // len(tail), bool((tail == tail[0]).all())
