"""A tally's timeline: the highest use in each interval of the run, and what it was made of.

Each interval keeps its highest use and the bytes of each of
:data:`~torchmem.records.run.CATEGORIES` at the first moment that use was reached. An
allocation counts as one category for its whole life: the first (in :data:`CATEGORIES`
order) a mark gives it while it is alive, ``other`` where none does (as PyTorch's memory
profiler counts a tensor by what it was used as). A mark comes after its allocation (a
gradient is seen as one at the optimizer's step, the optimizer's state after its first
step): the intervals whose highest moment came between the two are corrected when it
comes. Bytes alive from before the start that no mark named stay ``other``. So each
interval's categories sum to its use, and the peak's are :attr:`categories_at_peak`.

:data:`FINE` intervals at most: past them, neighbours merge (the higher keeps its
categories) and each interval doubles. Memory is bounded whatever the run's length; the
cost is linear in the rows, plus a sort of the marks and frees of each chunk and, for each
mark that gives an allocation a category, a look at the :data:`FINE` intervals.
"""

from __future__ import annotations

import numpy as np

from torchmem.events.table import Table
from torchmem.records.run import CATEGORIES

FINE = 1024
"""Intervals the timeline keeps; past them, neighbours merge and each doubles."""
FIRST_WIDTH = 1 << 10
"""Nanoseconds of a timeline interval at first (about a microsecond: a short run keeps
its detail; each halving of the resolution costs one pass over :data:`FINE` intervals)."""
KNOWN = len(CATEGORIES) - 1
"""Categories counted one by one: all but the last, ``other``, which is the rest (and
the category of an allocation no mark named)."""
_NONE = 8
"""A category lower than none: no mark."""
_EMPTY = -2
"""The sequence number of an interval with no row: no allocation was alive then."""

Changes = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Rows of a chunk where a category's bytes change (sorted), the bytes of each of the
first :data:`KNOWN` categories after each of them less those before the chunk, and the
marks that moved an allocation, one a row: its allocation's sequence number (-1: alive
since the start), the mark's, the category it left, the one it went to, its bytes."""


def category_changes(
    seq: int,
    table: Table,
    size: np.ndarray,
    made: np.ndarray,
    marks: tuple[np.ndarray, np.ndarray, np.ndarray],
    frees: tuple[np.ndarray, np.ndarray],
) -> Changes:
    """Where the bytes of the first :data:`KNOWN` categories change in a chunk of rows
    whose first has sequence number `seq`: at a mark that gives its allocation a lower
    category than it had, and at the free of an allocation in one of them.

    Args:
        table: the allocations alive before the chunk and those it makes that outlive it,
            with their categories before the chunk's marks.
        size: each row's bytes.
        made: per row, whether it allocates (1) or adopts (-1) an allocation (else 0).
        marks: the marks' rows, the allocations they name, their payloads
            (``name << 3 | category``).
        frees: the frees' rows and the allocations they name.
    """
    rows, refs, payloads = marks
    sizes, first, born, known = _lookup(seq, table, size, made, refs)
    rows, keys, sizes, first, born = (a[known] for a in (rows, refs, sizes, first, born))
    category = payloads[known] & 7
    # Per allocation, in row order: the lowest category of its marks so far.
    order = np.lexsort((rows, keys))
    rows, keys, sizes, first, born, category = (
        a[order] for a in (rows, keys, sizes, first, born, category)
    )
    starts = np.r_[True, keys[1:] != keys[:-1]] if len(keys) else np.zeros(0, bool)
    group = np.cumsum(starts) * 16
    lowest = np.minimum.accumulate(category - group) + group
    before = np.r_[_NONE, lowest[:-1]] if len(keys) else lowest
    before[starts] = _NONE
    after, before = np.minimum(first, lowest), np.minimum(first, before)
    moved = after < before
    at, out, delta = [rows[moved], rows[moved]], [after[moved], before[moved]], [sizes[moved]]
    delta.append(-sizes[moved])
    moves = np.stack([born, rows + seq, before, after, sizes])[:, moved]
    # A free takes its bytes out of the category its allocation has then.
    freed, gone = frees
    gone_size, gone_cat, _, found = _lookup(seq, table, size, made, gone)
    freed, gone, gone_size, gone_cat = freed[found], gone[found], gone_size[found], gone_cat[found]
    if len(keys):
        ends = np.r_[starts[1:], True]
        owners, final = keys[ends], lowest[ends]
        j = np.minimum(np.searchsorted(owners, gone), len(owners) - 1)
        gone_cat = np.where(owners[j] == gone, np.minimum(gone_cat, final[j]), gone_cat)
    at.append(freed)
    out.append(gone_cat)
    delta.append(-gone_size)
    return (*_cumulative(np.concatenate(at), np.concatenate(out), np.concatenate(delta)), moves)


def _lookup(
    seq: int, table: Table, size: np.ndarray, made: np.ndarray, refs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the allocations `refs` name: their bytes, their category before the chunk
    (``other``, :data:`KNOWN`, for one the chunk made), the sequence number of the row that
    made them (-1: alive since the start), and whether they are known (made in the chunk,
    or in `table`)."""
    place = refs - seq
    inside = (place >= 0) & (place < len(size))
    how = np.zeros(len(refs), np.int64)
    how[inside] = made[place[inside]]
    inside &= how != 0
    sizes = np.where(inside, size[np.where(inside, place, 0)], 0)
    born = np.where(how > 0, refs, -1)
    category = np.full(len(refs), KNOWN, np.int64)
    at, found = table.find(refs)
    if len(table):
        outside = ~inside & found
        sizes = np.where(outside, table.size[at], sizes)
        category = np.where(outside, table.cat[at], category)
        born = np.where(outside, table.born[at], born)
    return sizes, category, born, inside | found


def _cumulative(
    at: np.ndarray, category: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    keep = (category < KNOWN) & (size != 0)
    at, category, size = at[keep], category[keep], size[keep]
    order = np.argsort(at, kind="stable")
    at, category, size = at[order], category[order], size[order]
    steps = np.zeros((len(at), KNOWN), np.int64)
    steps[np.arange(len(at)), category] = size
    return at, np.cumsum(steps, axis=0)


class Timeline:
    """The timeline of one tally (see the module's docstring).

    Args:
        base: bytes in use at the start (``other``, until marks name them).
        start: ``time.monotonic_ns()`` at the start.
    """

    def __init__(self, base: int, start: int) -> None:
        self.base = base
        self.start = start
        self.width = FIRST_WIDTH
        self.last_time = start
        self.now = np.zeros(KNOWN, np.int64)
        """Bytes of the first :data:`KNOWN` categories after the rows fed so far."""
        self._high = np.full(FINE, -1, np.int64)
        """Highest use in each interval (-1: no row)."""
        self._last = np.full(FINE, -1, np.int64)
        """Use after the last row of each interval."""
        self._parts = np.zeros((2 * FINE + 1, KNOWN), np.int64)
        """Categories where each interval's highest use was first reached, then after the
        last row of each interval, then at the start."""
        self._seq = np.full(2 * FINE + 1, _EMPTY, np.int64)
        """The sequence number of the row of each of :attr:`_parts` (-1: the start)."""
        self._seq[-1] = -1

    def feed(self, times: np.ndarray, cur: np.ndarray, changes: Changes, seq: int) -> None:
        """The next rows: their times, the use after each, :func:`category_changes`, and
        the sequence number of the first."""
        self.last_time = max(self.last_time, int(times.max()))
        index = np.maximum((times - self.start) >> (self.width.bit_length() - 1), 0)
        while int(index.max()) >= FINE:
            self._halve()
            index >>= 1
        # One value per run of rows in the same interval (rows come in time order, nearly:
        # another thread's row may come late, and an interval then has several runs).
        ends = np.append(np.flatnonzero(index[1:] != index[:-1]), len(index) - 1)
        starts = np.insert(ends[:-1] + 1, 0, 0)
        highs = np.maximum.reduceat(cur, starts)
        run = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(index))))
        reached = np.flatnonzero(cur == highs[run])
        first = reached[np.unique(run[reached], return_index=True)[1]]
        # Per interval, its highest run (the first of equals), if higher than before.
        order = np.lexsort((np.arange(len(starts)), -highs, index[ends]))
        chosen = order[np.r_[True, index[ends][order][1:] != index[ends][order][:-1]]]
        slots = index[ends][chosen]
        higher = highs[chosen] > self._high[slots]
        self._high[slots[higher]] = highs[chosen][higher]
        self._keep(slots[higher], first[chosen][higher], changes, seq)
        # The last run of each interval.
        last = ends[len(ends) - 1 - np.unique(index[ends][::-1], return_index=True)[1]]
        self._last[index[last]] = cur[last]
        self._keep(FINE + index[last], last, changes, seq)
        at, sums, moves = changes
        if len(at):
            self.now = self.now + sums[-1]
        self._correct(moves)

    def _keep(self, slots: np.ndarray, rows: np.ndarray, changes: Changes, seq: int) -> None:
        """Keep in `slots` the categories after each of `rows` (of the chunk being fed)."""
        at, sums, _ = changes
        j = np.searchsorted(at, rows, side="right") - 1
        found = np.zeros((len(rows), KNOWN), np.int64)
        found[j >= 0] = sums[j[j >= 0]]
        self._parts[slots] = self.now + found
        self._seq[slots] = seq + rows

    def _correct(self, moves: np.ndarray) -> None:
        """Count each allocation a mark moved as its new category at the moments kept
        between its allocation and the mark, too."""
        if not moves.shape[1]:
            return
        born, marked, old, new, size = moves
        weights = np.zeros((len(size), KNOWN), np.int64)
        weights[np.arange(len(size)), new] = size
        known = old < KNOWN
        weights[np.flatnonzero(known), old[known]] -= size[known]
        # Each move spans the moments kept from its allocation to its mark: a run of them
        # in order of their rows, added as a difference at its two ends.
        order = np.argsort(self._seq, kind="stable")
        ranked = self._seq[order]
        steps = np.zeros((len(ranked) + 1, KNOWN), np.int64)
        np.add.at(steps, np.searchsorted(ranked, born), weights)
        np.add.at(steps, np.searchsorted(ranked, marked), -weights)
        self._parts[order] += np.cumsum(steps[:-1], axis=0)

    def _halve(self) -> None:
        pairs = np.arange(0, FINE, 2)
        top = pairs + (self._high[1::2] > self._high[0::2])
        end = pairs + (self._last[1::2] >= 0)
        self._high = _widened(self._high[top], -1)
        self._last = _widened(self._last[end], -1)
        parts, seq = self._parts, self._seq
        self._parts = np.concatenate(
            [_widened(parts[top], 0), _widened(parts[FINE + end], 0), parts[-1:]]
        )
        self._seq = np.concatenate(
            [_widened(seq[top], _EMPTY), _widened(seq[FINE + end], _EMPTY), seq[-1:]]
        )
        self.width *= 2

    def read(
        self, stop: int, points: int
    ) -> tuple[tuple[tuple[float, int], ...], tuple[tuple[int, ...], ...]]:
        """At most `points` intervals from the start to `stop`: each one's end (seconds
        from the start) and highest use; and the bytes of each of the categories (all of
        them, ``other`` last) at that highest use."""
        span = max(stop, self.last_time) - self.start
        used = min(span // self.width + 1, FINE)
        before, carried = self.base, 2 * FINE
        values: list[int] = []
        parts: list[int] = []
        highs, lasts = self._high[:used].tolist(), self._last[:used].tolist()
        for i, (high, end) in enumerate(zip(highs, lasts, strict=True)):
            values.append(max(high, before))
            parts.append(i if high > before else carried)
            if end >= 0:
                before, carried = end, FINE + i
        group = -(-used // points)
        found, layers = [], []
        for first in range(0, used, group):
            top = first + int(np.argmax(values[first : first + group]))
            end = min((first + group) * self.width, span)
            found.append((end / 1e9, values[top]))
            known = [int(b) for b in self._parts[parts[top]]]
            layers.append((*known, values[top] - sum(known)))
        return tuple(found), tuple(layers)


def _widened(merged: np.ndarray, empty: int) -> np.ndarray:
    """`merged` (the first half of the intervals, merged in pairs), then empty intervals."""
    return np.concatenate([merged, np.full((FINE - len(merged), *merged.shape[1:]), empty)])
