"""A device's event stream, tallied as it arrives: in time linear in the events and in
memory bounded by what the report needs, whatever the run's length.

The stream is rows of :data:`COLUMNS` int64, in time order, each of one :data:`KINDS`:
an allocation, a free, a storage alive at the start (adopted), a mark (what a storage
was: a parameter, a gradient, ...) and a probe (a module's forward or backward pass
opening, reaching an end, closing). A row's sequence number is its place in the stream;
a free, an adoption and a mark name the allocation they concern by its sequence number
(:data:`REF`), which the producer (the counting allocator, or
:func:`~torchmem.events.sources.stream`) tells from the address. A storage made before
the stream started is adopted when a mark first names it: it was alive all along.

:class:`Tally` keeps only what the report reads: the allocations alive now and those
alive at the highest use so far (each with its size, site, time, category and name), a
timeline of per-interval maxima and their categories that halves its resolution as the
run grows (:mod:`torchmem.events.timeline`), each module's highest use and what its
passes added, and a window of the most recent allocations and frees. Everything else is
dropped as soon as it is counted.
"""

from __future__ import annotations

import numpy as np

from torchmem.events.rows import (
    ADOPT as ADOPT,
    ALLOC as ALLOC,
    CLOSE as CLOSE,
    COLUMNS as COLUMNS,
    FREE as FREE,
    HIT as HIT,
    KIND as KIND,
    KINDS as KINDS,
    MARK as MARK,
    OPEN as OPEN,
    PTR as PTR,
    REF as REF,
    SITE as SITE,
    SIZE as SIZE,
    STEP as STEP,
    TIME as TIME,
)
from torchmem.events.steps import StepEnds
from torchmem.events.table import Table
from torchmem.events.timeline import KNOWN, Timeline, category_changes

BEFORE_SITE = -4
"""The site of a storage alive when the recording started."""
UNNAMED = -1
WINDOW = 1 << 16
"""How many of the latest allocations and frees a tally keeps as they were."""

_NEVER = np.iinfo(np.int64).max
_MODULE, _DEPTH, _BACKWARD, _BEGIN, _HIGH, _LAST, _AT, _BASE = range(8)
"""An open probe's fields: module, depth, backward (0 or 1), time it opened, highest use
from its opening to the start of the rows in hand, time of its last hit (-1: none),
where it opened in the rows in hand (0: before them), use when it opened."""


class Tally:
    """One device's stream, tallied chunk by chunk (:meth:`feed`).

    Args:
        base: bytes in use at the start.
        start: ``time.monotonic_ns()`` at the start.
        first: the sequence number of the first row it is fed.
        engine: site indices of allocations autograd's engine made (named after the
            module whose backward pass ran then); more may be added as they appear.
    """

    def __init__(self, base: int, start: int, first: int = 0) -> None:
        self.base = base
        self.start = start
        self.first = first
        self.engine: set[int] = set()
        self.seq = first
        """Sequence number of the next row."""
        self.current = base
        self.hidden = base
        """Bytes alive from before the start that no adopted record holds."""
        self.live = Table.empty()
        self.peak = base
        self.peak_seq = first - 1
        """Sequence number of the row at the highest use; ``first - 1``: the start."""
        self.peak_time = start
        self.at_peak = Table.empty()
        self.hidden_at_peak = base
        self.events = 0
        """Allocations and frees tallied."""
        self.forward: dict[int, int] = {}
        """Module index -> highest use during its forward passes."""
        self.backward: dict[int, int] = {}
        self.kept: dict[int, int] = {}
        """Module index -> the most one forward pass added: use when it returned less use
        when it began."""
        self.rise: dict[int, int] = {}
        """Module index -> the most one backward pass rose above the use when it began."""
        self._open: dict[int, list[int]] = {}
        """Probes open, by number (fields: :data:`_MODULE`, ...)."""
        self._spans: list[tuple[int, int, int, int]] = []
        """Closed backward passes: (begin, last hit, depth, module), while engine
        allocations made during them may still be named."""
        self._pending = np.empty(0, np.int64)
        """Keys of engine allocations not yet named (a backward pass was open then)."""
        self._pending_time = np.empty(0, np.int64)
        self.line = Timeline(base, start)
        """The highest use per interval, and its categories."""
        self.recent: list[np.ndarray] = []
        """The latest allocation and free rows (at most :data:`WINDOW` of them)."""
        self.dropped = 0
        """Allocations and frees no longer in :attr:`recent`."""
        self.steps = StepEnds(base)
        """Where training steps may end, with the use there and the highest since."""

    # Feeding ---------------------------------------------------------------------------

    def feed(self, rows: np.ndarray) -> None:
        """Tally `rows` (shape ``(n, COLUMNS)``), the next ones of the stream."""
        n = len(rows)
        if not n:
            return
        kind = rows[:, KIND]
        alloc = kind == ALLOC
        free = kind == FREE
        changing = alloc | free
        cur = self.current + np.cumsum(np.where(changing, rows[:, SIZE], 0))
        j = int(np.argmax(cur))
        rises = bool(cur[j] > self.peak)
        frees = np.flatnonzero(free)
        refs = rows[frees, REF]
        ends = self.steps.find(rows)
        kept = np.union1d(ends.ends, [j] if rises else np.empty(0, np.int64))
        passing, matched = self._passing(alloc, frees, refs, kept)
        made = np.flatnonzero((alloc & ~passing) | (kind == ADOPT))
        marks = np.flatnonzero(kind == MARK)
        table = self.live.concat(self._arrivals(rows, alloc, made, marks))
        layers = category_changes(
            self.seq,
            table,
            rows[:, SIZE],
            alloc.astype(np.int64) - (kind == ADOPT),
            (marks, rows[marks, REF], rows[marks, SITE]),
            (frees, refs),
        )
        if len(marks):
            self._mark(table, rows[marks, REF], rows[marks, SITE])
            if len(self.at_peak):
                self._mark(self.at_peak, rows[marks, REF], rows[marks, SITE])
        died = np.full(len(table), _NEVER, np.int64)
        looked = np.flatnonzero(~matched)
        at, found = table.find(refs[looked])
        died[at[found]] = self.seq + frees[looked[found]]
        lost = frees[looked[~found]]  # frees of storages alive from before the start
        unmatched = np.zeros(n, np.int64)
        unmatched[lost] = rows[lost, SIZE]
        hidden = self.hidden + np.cumsum(unmatched)
        self._probes(rows, kind, cur, table)
        self.steps.feed(rows[:, TIME], cur, self.seq, ends)
        self._queue_engine(rows, alloc, made)
        if rises:
            self.peak = int(cur[j])
            self.peak_seq = self.seq + j
            self.peak_time = int(rows[j, TIME])
            self.at_peak = table.take((table.born <= self.peak_seq) & (died > self.peak_seq))
            self.hidden_at_peak = int(hidden[j])
        self.live = table.take(died == _NEVER)
        self.steps.bury(table, died, died != _NEVER)
        self.current = int(cur[-1])
        self.hidden = int(hidden[-1])
        self.seq += n
        self.line.feed(rows[:, TIME], cur, layers, self.seq - n)
        self._name_engine()
        # A copy, not a view of the rows: `recent` keeps it.
        changes = rows.copy() if bool(changing.all()) else rows.take(np.flatnonzero(changing), 0)
        self.events += len(changes)
        self._keep_recent(changes)

    def _passing(
        self, alloc: np.ndarray, frees: np.ndarray, refs: np.ndarray, kept: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The allocations of a chunk freed in it too, which need no record unless alive at
        one of rows `kept` (sorted: a new peak, every end of a step here): they are counted
        in the use already (most of a run of tiny allocations). Returns them (a mask of the
        rows) and the frees that name them (a mask of `frees`, whose rows' :data:`REF` are
        `refs`)."""
        n = len(alloc)
        place = refs - self.seq  # where the allocation each free names is in these rows
        inside = np.flatnonzero((place >= 0) & (place < n))
        born, gone = place[inside], frees[inside]
        # The first row kept at or after each one's birth: before its free, alive there.
        after = np.searchsorted(kept, born)
        alive = (after < len(kept)) & (np.r_[kept, 0][after] < gone)
        short = alloc[born] & ~alive
        passing = np.zeros(n, bool)
        passing[born[short]] = True
        matched = np.zeros(len(frees), bool)
        matched[inside[short]] = True
        return passing, matched

    def _arrivals(
        self, rows: np.ndarray, alloc: np.ndarray, made: np.ndarray, marks: np.ndarray
    ) -> Table:
        """Records of the storages rows `made` allocate or adopt, and of those made before
        the start that rows `marks` name first. Those alive since before the start are
        alive at the peak too, and no longer hidden."""
        new = _records(
            rows,
            made,
            key=self.seq + made,
            born=np.where(alloc[made], self.seq + made, -1),
            site=np.where(alloc[made], rows[made, SITE], BEFORE_SITE),
        )
        # A storage made before the start, named by a mark only (this tally started inside
        # another, which saw it made): known from its mark's size.
        earlier = marks[(rows[marks, REF] >= 0) & (rows[marks, REF] < self.first)]
        if len(earlier):
            earlier = earlier[~self.live.find(rows[earlier, REF])[1]]
            earlier = earlier[np.unique(rows[earlier, REF], return_index=True)[1]]
        if len(earlier):
            new = new.concat(
                _records(
                    rows,
                    earlier,
                    key=rows[earlier, REF],
                    born=np.full(len(earlier), -1, np.int64),
                    site=np.full(len(earlier), BEFORE_SITE, np.int64),
                )
            )
        before = new.take(new.born < 0)
        if len(before):
            # Alive since before the start, and now: at the peak too, and never hidden.
            known = int(before.size.sum())
            self.hidden -= known
            self.hidden_at_peak -= known
            self.at_peak = self.at_peak.concat(before)
        return new

    def _queue_engine(self, rows: np.ndarray, alloc: np.ndarray, made: np.ndarray) -> None:
        """Hold the engine's allocations among rows `made` until they can be named."""
        engine = made[alloc[made] & np.isin(rows[made, SITE], np.fromiter(self.engine, np.int64))]
        if len(engine):
            self._pending = np.concatenate([self._pending, self.seq + engine])
            self._pending_time = np.concatenate([self._pending_time, rows[engine, TIME]])

    def _mark(self, table: Table, refs: np.ndarray, payloads: np.ndarray) -> None:
        """Give each record named by `refs` the first mark of its lowest category, unless
        it has one as low already."""
        at, found = table.find(refs)
        if not found.any():
            return
        at, payloads = at[found], payloads[found]
        order = np.arange(len(at), dtype=np.int64) + 1
        # Lowest category first, then the earliest mark; 0 stands for what it had.
        best = table.cat << 40
        np.minimum.at(best, at, (payloads & 7) << 40 | order)
        changed = (best & ((1 << 40) - 1)) > 0
        chosen = payloads[(best[changed] & ((1 << 40) - 1)) - 1]
        table.cat[changed] = chosen & 7
        table.name[changed] = chosen >> 3

    def _probes(self, rows: np.ndarray, kind: np.ndarray, cur: np.ndarray, table: Table) -> None:
        """Each module's highest use during its passes, what they added (a forward call:
        use at its close less use at its opening; a backward pass: its highest less use at
        its opening), and the spans of its backward passes (to name what autograd's engine
        allocated)."""
        at = np.flatnonzero((kind >= OPEN) & (kind <= CLOSE))
        if len(at):
            number, op, module = rows[at, PTR], kind[at], rows[at, SITE]
            # Where each probe opened in these rows (0: before them).
            opened = op == OPEN
            numbers, places = number[opened], at[opened]
            order = np.argsort(numbers)
            numbers, places = numbers[order], places[order]
            j = np.minimum(np.searchsorted(numbers, number), max(len(numbers) - 1, 0))
            here = numbers[j] == number if len(numbers) else np.zeros(len(at), bool)
            began = np.where(here, places[j] if len(numbers) else 0, 0)
            high, base = _range_max(cur, began, at), cur[began]
            known = here.copy()
            for k in np.flatnonzero(~here).tolist():
                probe = self._open.get(int(number[k]))
                if probe is not None:
                    high[k] = max(int(high[k]), probe[_HIGH])
                    base[k] = probe[_BASE]
                    known[k] = True
            returned = (op == CLOSE) & ((rows[at, REF] & 1) == 0) & known
            _most(self.forward, module[returned], high[returned])
            _most(self.kept, module[returned], cur[at[returned]] - base[returned])
            hits = (op == HIT) & known
            _most(self.backward, module[hits], high[hits])
            _most(self.rise, module[hits], high[hits] - base[hits])
            self._follow(rows[at, REF], rows[at, TIME], number, op, module, numbers, places, cur)
        if self._open:
            probes = list(self._open.values())
            starts = np.array([p[_AT] for p in probes], np.int64)
            ends = _range_max(cur, starts, np.full(len(probes), len(cur) - 1, np.int64))
            for probe, end in zip(probes, ends.tolist(), strict=True):
                probe[_HIGH] = max(probe[_HIGH], end)
                probe[_AT] = 0

    def _follow(
        self,
        ref: np.ndarray,
        when: np.ndarray,
        number: np.ndarray,
        op: np.ndarray,
        module: np.ndarray,
        numbers: np.ndarray,
        places: np.ndarray,
        cur: np.ndarray,
    ) -> None:
        """Keep the probes still open, and the spans of the backward passes that closed, from
        the probe rows of a chunk (`numbers`, `places`: those that opened here, sorted)."""
        opened = op == OPEN
        order = np.argsort(number[opened], kind="stable")
        began, refs = when[opened][order], ref[opened][order]
        hits = op == HIT
        # The last hit of each probe here (rows are in time order).
        hit, first = np.unique(number[hits][::-1], return_index=True)
        last = when[hits][::-1][first]
        closing = op == CLOSE
        closed = number[closing]
        ended = closing & ((ref & 1) == 1)
        if ended.any():
            self._end_spans(
                number[ended], ref[ended] >> 1, module[ended], numbers, began, hit, last
            )
        gone = set(closed.tolist())
        hit_at = dict(zip(hit.tolist(), last.tolist(), strict=True))
        for key in [k for k in self._open if k in gone]:
            del self._open[key]
        for key, probe in self._open.items():
            probe[_LAST] = hit_at.get(key, probe[_LAST])
        still = ~np.isin(numbers, closed)
        modules = module[opened][order]
        for key, owner, r, t, place in zip(
            numbers[still].tolist(),
            modules[still].tolist(),
            refs[still].tolist(),
            began[still].tolist(),
            places[still].tolist(),
            strict=True,
        ):
            use = int(cur[place])
            self._open[key] = [owner, r >> 1, r & 1, t, use, hit_at.get(key, -1), place, use]

    def _end_spans(
        self,
        keys: np.ndarray,
        depth: np.ndarray,
        owner: np.ndarray,
        numbers: np.ndarray,
        began: np.ndarray,
        hit: np.ndarray,
        last: np.ndarray,
    ) -> None:
        """Keep the spans of the backward passes that closed (probes `keys`, of `depth` and
        module `owner`): from their opening (here, probes `numbers` at times `began`; or
        before) to their last hit (here, probes `hit` at times `last`; or before)."""
        j, here = _lookup(keys, numbers)
        begin = np.where(here, began[j] if len(began) else 0, -1)
        k, seen = _lookup(keys, hit)
        final = np.where(seen, last[k] if len(last) else -1, -1)
        for i in np.flatnonzero(~here).tolist():  # opened before these rows
            probe = self._open.get(int(keys[i]))
            if probe is not None:
                begin[i] = probe[_BEGIN]
                if final[i] < 0:
                    final[i] = probe[_LAST]
        done = (begin >= 0) & (final >= 0)
        self._spans.extend(
            zip(
                begin[done].tolist(),
                final[done].tolist(),
                depth[done].tolist(),
                owner[done].tolist(),
                strict=True,
            )
        )

    def _name_engine(self) -> None:
        """Name the engine's allocations whose backward passes are all over: after the
        innermost module whose backward pass ran then. Those already dead and not alive
        at the peak need no name."""
        if not len(self._pending):
            self._spans = []
            return
        keep = self.live.find(self._pending)[1] | self.at_peak.find(self._pending)[1]
        pending, times = self._pending[keep], self._pending_time[keep]
        opened = [p[_BEGIN] for p in self._open.values() if p[_BACKWARD]]
        ready = times < min(opened) if opened else np.ones(len(times), bool)
        if ready.any() and self._spans:
            spans = np.array(sorted(self._spans), dtype=np.int64)
            t = times[ready][:, None]
            inside = (spans[:, 0] <= t) & (t <= spans[:, 1])
            # Innermost: the deepest, then the latest to begin (spans are sorted by begin).
            score = np.where(inside, spans[:, 2] * len(spans) + np.arange(len(spans)), -1)
            best = score.argmax(axis=1)
            named = score[np.arange(len(best)), best] >= 0
            keys, owners = pending[ready][named], spans[best[named], 3]
            for table in (self.live, self.at_peak):
                at, found = table.find(keys)
                table.owner[at[found]] = owners[found]
        self._pending, self._pending_time = pending[~ready], times[~ready]
        # A closed pass ended before anything still to come: only what waits needs it.
        if not len(self._pending):
            self._spans = []
        else:
            oldest = int(self._pending_time.min())
            self._spans = [s for s in self._spans if s[1] >= oldest]

    def _keep_recent(self, changes: np.ndarray) -> None:
        if len(changes):
            self.recent.append(changes[-WINDOW:])
        total = sum(len(r) for r in self.recent)
        while total > WINDOW:
            first = self.recent[0]
            if len(first) <= total - WINDOW:
                self.recent.pop(0)
                total -= len(first)
            else:
                self.recent[0] = first[total - WINDOW :].copy()  # not a view of all of it
                total = WINDOW
        self.dropped = self.events - total

    # Reading ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Name what is left to name once the stream has ended: every pass is over."""
        for probe in self._open.values():
            if probe[_BACKWARD] and probe[_LAST] >= 0:
                self._spans.append((probe[_BEGIN], probe[_LAST], probe[_DEPTH], probe[_MODULE]))
        self._open.clear()
        self._name_engine()

    @property
    def last_time(self) -> int:
        """``time.monotonic_ns()`` of the latest row tallied (the start before any)."""
        return self.line.last_time

    def timeline(self, stop: int, points: int) -> tuple[tuple[float, int], ...]:
        """At most `points` intervals from the start to `stop`: each one's end (seconds
        from the start) and the highest use in it (see :meth:`Timeline.read`)."""
        return self.line.read(stop, points)[0]

    def recent_rows(self) -> np.ndarray:
        """The latest allocation and free rows, oldest first."""
        if not self.recent:
            return np.empty((0, COLUMNS), np.int64)
        return np.concatenate(self.recent)


def _records(
    rows: np.ndarray, at: np.ndarray, key: np.ndarray, born: np.ndarray, site: np.ndarray
) -> Table:
    """Records of the storages of rows `at`, unmarked (category other) and unowned."""
    unset = (np.full(len(at), value, np.int64) for value in (KNOWN, UNNAMED, -1))
    return Table(key, born, rows[at, PTR], rows[at, SIZE], site, rows[at, TIME], *unset)


def _lookup(keys: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of `keys` in the sorted array `table`, and which were found."""
    j = np.minimum(np.searchsorted(table, keys), max(len(table) - 1, 0))
    return j, (table[j] == keys) if len(table) else np.zeros(len(keys), bool)


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``values[lo[i] : hi[i] + 1].max()`` for each i, from a sparse table of maxima over
    power-of-two spans."""
    out = np.empty(len(lo), np.int64)
    if not len(lo):
        return out
    level = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1  # floor(log2(length))
    table = values
    for k in range(int(level.max()) + 1):
        if k:
            step = 1 << (k - 1)
            table = np.maximum(table[:-step], table[step:])
        chosen = level == k
        if chosen.any():
            out[chosen] = np.maximum(table[lo[chosen]], table[hi[chosen] - (1 << k) + 1])
    return out


def _most(highest: dict[int, int], keys: np.ndarray, values: np.ndarray) -> None:
    """Raise ``highest[key]`` to each value of its key."""
    if not len(keys):
        return
    unique, inverse = np.unique(keys, return_inverse=True)
    best = np.full(len(unique), np.iinfo(np.int64).min, np.int64)
    np.maximum.at(best, inverse.reshape(-1), values)
    for key, value in zip(unique.tolist(), best.tolist(), strict=True):
        highest[key] = max(highest.get(key, value), value)
