"""The tally: a stream counted in chunks of any size equals the same stream counted at
once by brute force, and what it keeps does not grow with the number of events."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch

import torchmem
from torchmem.events.tally import (
    ADOPT,
    ALLOC,
    CLOSE,
    COLUMNS,
    FREE,
    HIT,
    MARK,
    OPEN,
    WINDOW,
    Tally,
)
from torchmem.events.timeline import FINE, KNOWN

BASE = 1200
"""Two storages adopted at the start (300 B each), two later (100 B each), 400 B hidden."""


def random_stream(seed: int, steps: int) -> np.ndarray:
    """Rows as a recording makes them: adopted storages, allocations and frees at random
    addresses (some reused), marks, and forward and backward probes of two modules."""
    rng = random.Random(seed)
    rows: list[list[int]] = []
    live: dict[int, int] = {}  # address -> sequence number of its allocation
    sizes: dict[int, int] = {}
    clock = 0

    def row(ptr: int, size: int, site: int, ref: int, kind: int) -> None:
        nonlocal clock
        clock += rng.randint(1, 3_000_000)
        rows.append([clock, ptr, size, site, ref, kind])

    for address in (1, 2):  # alive at the start; BASE covers them and 400 hidden bytes
        live[address], sizes[address] = len(rows), 300
        row(address, 300, 0, len(rows), ADOPT)
    probe = 0
    adopt_at = {steps // 3: 61, 2 * steps // 3: 62}  # made before the start, seen later
    for step in range(steps):
        if step in adopt_at:
            address = adopt_at[step]
            live[address], sizes[address] = len(rows), 100
            row(address, 100, 0, len(rows), ADOPT)
        probe += 1
        module = rng.choice((11, 12))
        row(probe, 0, module, 0, OPEN)
        for _ in range(rng.randint(1, 6)):
            choice = rng.random()
            if choice < 0.5 or not live:
                address = rng.randint(3, 40)
                if address in live:
                    continue
                live[address], sizes[address] = len(rows), rng.randint(1, 500)
                row(address, sizes[address], rng.randint(0, 3), -1, ALLOC)
            elif choice < 0.8:
                address = rng.choice(sorted(live))
                row(address, -sizes[address], -1, live.pop(address), FREE)
            else:
                address = rng.choice(sorted(live))
                payload = rng.randint(0, 5) << 3 | rng.randint(0, KNOWN - 1)
                row(address, 0, payload, live[address], MARK)
        row(probe, 0, module, 0, CLOSE)
        if rng.random() < 0.5:  # a backward pass, with hits, then some use, then its close
            probe += 1
            row(probe, 0, module, 1, OPEN)
            address = rng.randint(41, 60)
            if address not in live:
                live[address], sizes[address] = len(rows), rng.randint(1, 900)
                row(address, sizes[address], 7, -1, ALLOC)  # site 7: the engine's
            row(probe, 0, module, 1, HIT)
            if rng.random() < 0.5 and address in live:
                row(address, -sizes[address], -1, live.pop(address), FREE)
            row(probe, 0, module, 1, CLOSE)
    row(99, -50, -1, -1, FREE)  # memory from before the start, not adopted
    return np.array(rows, np.int64).reshape(-1, COLUMNS)


def brute_force(rows: np.ndarray) -> dict[str, object]:
    """The peak, what was alive then and at the end (by category), and each module's
    forward and backward highs, counted row by row. An adopted storage was alive from the
    start until its free, whenever it was adopted."""
    adopted: dict[int, int] = {}  # key -> row of its free
    for i, (_, _, _, _, ref, kind) in enumerate(rows.tolist()):
        if kind == ADOPT:
            adopted[i] = len(rows)
        elif kind == FREE and ref in adopted:
            adopted[ref] = i
    known = sum(int(rows[key, 2]) for key in adopted)
    current, peak = BASE, BASE
    category = {key: KNOWN for key in adopted}  # other
    alive: dict[int, int] = {key: int(rows[key, 2]) for key in adopted}
    made: set[int] = set()
    at_peak = set(adopted)
    hidden = peak_hidden = BASE - known
    opened: dict[int, int] = {}
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    kept: dict[int, int] = {}
    rise: dict[int, int] = {}
    history = []
    lives = []  # after each row: the allocations alive
    for i, (_, ptr, size, site, ref, kind) in enumerate(rows.tolist()):
        if kind == ALLOC:
            alive[i], category[i] = size, KNOWN
            made.add(i)
            current += size
        elif kind == FREE:
            current += size
            if alive.pop(ref, None) is None:
                hidden += size
        elif kind == MARK and ref in alive:
            category[ref] = min(category[ref], site & 7)
        history.append(current)
        lives.append(list(alive.items()))
        if kind == OPEN:
            opened[ptr] = i
        elif kind in (HIT, CLOSE) and ptr in opened:
            high = max(history[opened[ptr] :])
            table = backward if ref & 1 else forward
            if kind == HIT or not ref & 1:
                table[site] = max(table.get(site, high), high)
            began = history[opened[ptr]]
            if kind == HIT:
                rise[site] = max(rise.get(site, high - began), high - began)
            elif not ref & 1:
                kept[site] = max(kept.get(site, current - began), current - began)
        if current > peak:
            peak = current
            at_peak = {k for k in made if k in alive} | {k for k, f in adopted.items() if f > i}
            peak_hidden = hidden
    # After each row: bytes of each category but other, each allocation counted as its
    # category for its whole life.
    layers = []
    for alive_then in lives:
        layer = [0] * KNOWN
        for key, size in alive_then:
            if category[key] < KNOWN:
                layer[category[key]] += size
        layers.append(layer)
    end = [0] * (KNOWN + 1)
    for key, size in alive.items():
        end[category[key]] += size
    end[KNOWN] += hidden
    return {
        "peak": peak,
        "end": current,
        "at_peak": {key: category[key] for key in at_peak},
        "hidden_at_peak": peak_hidden,
        "end_categories": end,
        "forward": forward,
        "backward": backward,
        "kept": kept,
        "rise": rise,
        "history": history,
        "layers": layers,
    }


def brute_force_timeline(
    rows: np.ndarray, truth: dict, width: int, stop: int, points: int
) -> list[tuple[int, tuple[int, ...]]]:
    """Per interval of `width` ns, resampled as :meth:`Tally.timeline` does: the highest use
    and the categories (other last) at the first moment it was reached, from the start of
    the interval (the use carried from before) or after one of its rows."""
    history, layers = truth["history"], truth["layers"]
    used = min(max(stop, int(rows[-1, 0])) // width + 1, FINE)
    intervals = [[(BASE, [0, 0, 0, 0])] for _ in range(used)]
    carried = (BASE, [0, 0, 0, 0])
    at = 0
    for k in range(used):
        intervals[k] = [carried]
        while at < len(rows) and rows[at, 0] // width == k:
            intervals[k].append((history[at], layers[at]))
            at += 1
        carried = intervals[k][-1]
    # max() keeps the first of equals.
    highest = [max(moments, key=lambda m: m[0]) for moments in intervals]
    group = -(-used // points)
    found = []
    for first in range(0, used, group):
        use, layer = max(highest[first : first + group], key=lambda m: m[0])
        found.append((use, (*layer, use - sum(layer))))
    return found


def tallied(
    rows: np.ndarray, chunks: list[int], engine: set[int] | None = None, base: int = BASE
) -> Tally:
    """`rows` fed in chunks of these sizes (the rest at once); site 7 is the engine's."""
    tally = Tally(base, 0)
    tally.engine = {7} if engine is None else engine
    start = 0
    for size in chunks:
        tally.feed(rows[start : start + size])
        start += size
    tally.feed(rows[start:])
    tally.finish()
    return tally


@pytest.mark.parametrize("seed", range(12))
def test_any_chunking_counts_what_brute_force_counts(seed: int) -> None:
    rows = random_stream(seed, 300)
    rng = random.Random(seed)
    chunks = [rng.randint(1, 200) for _ in range(rng.randint(0, 20))]
    tally, whole = tallied(rows, chunks), tallied(rows, [])
    truth = brute_force(rows)
    for found in (tally, whole):
        assert (found.peak, found.current) == (truth["peak"], truth["end"])
        assert (
            dict(zip(found.at_peak.key.tolist(), found.at_peak.cat.tolist(), strict=True))
            == truth["at_peak"]
        )
        assert found.hidden_at_peak == truth["hidden_at_peak"]
        end = np.bincount(found.live.cat, weights=found.live.size, minlength=5).astype(int)
        assert [*end[:KNOWN], int(end[KNOWN]) + found.hidden] == truth["end_categories"]
        assert (found.forward, found.backward) == (truth["forward"], truth["backward"])
        assert (found.kept, found.rise) == (truth["kept"], truth["rise"])
        assert found.line.now.tolist() == [int(b) for b in end[:KNOWN]]
        stop = int(rows[-1, 0])
        timeline, layers = found.line.read(stop, 50)
        expected = brute_force_timeline(rows, truth, found.line.width, stop, 50)
        assert [(b, layer) for (_, b), layer in zip(timeline, layers, strict=True)] == expected
    assert tally.at_peak.owner.tolist() == whole.at_peak.owner.tolist()
    timeline = tally.timeline(int(rows[-1, 0]), 50)
    assert max(high for _, high in timeline) == truth["peak"]
    assert len(timeline) <= 50 and [t for t, _ in timeline] == sorted(t for t, _ in timeline)


def test_an_allocation_counts_as_its_category_from_its_allocation_to_its_free() -> None:
    """A gradient marked two intervals after it was made counts as one from its allocation
    on; a storage alive since the start, adopted and marked later, from the start. An
    interval keeps the categories of the first moment of its highest use: a later moment
    at the same use is made of other bytes."""
    rows = np.array(
        [
            [10, 1, 100, 0, -1, ALLOC],  # 100 B, never marked: other
            [20, 1, -100, -1, 0, FREE],
            [30, 2, 100, 0, -1, ALLOC],  # 100 B, a gradient (marked later)
            [1030, 3, 50, 0, -1, ALLOC],  # next interval: 50 B, other
            [2100, 2, 0, 1 << 3 | 1, 2, MARK],  # it was a gradient
            [2200, 5, 30, 0, 5, ADOPT],  # 30 B alive since the start (in the base)
            [2300, 5, 0, 3 << 3 | 0, 5, MARK],  # a parameter
            [2400, 3, -50, -1, 3, FREE],
        ],
        np.int64,
    )
    for chunks in ([], [1], [1, 1, 1, 1, 1, 1], [2, 1], [4, 1, 2], [3, 3]):
        tally = tallied(rows, chunks, base=30)
        timeline, layers = tally.line.read(4000, 10)
        assert [b for _, b in timeline] == [130, 180, 180, 130]
        assert layers == (
            (30, 0, 0, 0, 0, 0, 100),  # its first moment at 130 B: before the gradient was made
            (30, 100, 0, 0, 0, 0, 50),
            (30, 100, 0, 0, 0, 0, 50),  # the use carried from the interval before
            (30, 100, 0, 0, 0, 0, 0),
        )


def test_engine_allocations_are_named_after_the_innermost_backward_pass() -> None:
    rows = np.array(
        [
            [10, 1, 0, 100, 1, OPEN],  # the model's backward pass (depth 0) from 10
            [11, 2, 0, 200, 3, OPEN],  # its layer's (depth 1) from 11 to 20
            [15, 500, 8, 7, -1, ALLOC],  # inside both: the layer's
            [20, 2, 0, 200, 3, HIT],
            [25, 600, 8, 7, -1, ALLOC],  # the model's only
            [30, 1, 0, 100, 1, HIT],
            [40, 700, 8, 7, -1, ALLOC],  # neither: after the model's last hit
            [50, 1, 0, 100, 1, CLOSE],
            [50, 2, 0, 200, 3, CLOSE],
        ],
        np.int64,
    )
    for chunks in ([], [1], [3, 1], [1, 1, 1, 1, 1, 1, 1, 1]):
        tally = tallied(rows, chunks, base=0)
        assert dict(zip(tally.live.ptr.tolist(), tally.live.owner.tolist(), strict=True)) == {
            500: 200,
            600: 100,
            700: -1,
        }


@pytest.mark.slow
def test_what_a_tally_keeps_does_not_grow_with_the_events() -> None:
    """Ten times the steps: no more records than addresses in use (62), at most a few spans
    and pending names, and a window of raw rows that stops at its size."""

    def kept(steps: int, engine: set[int]) -> tuple[int, int, int]:
        tally = tallied(streams[steps], [1000] * (steps // 100), engine)
        return (
            len(tally.live) + len(tally.at_peak),
            len(tally._spans) + len(tally._pending),
            len(tally.recent_rows()),
        )

    # About 2.6 allocation and free rows a step: the window (65,536) holds the small run's.
    streams = {steps: random_stream(0, steps) for steps in (10_000, 100_000)}
    for engine in ({7}, set()):  # with the engine's sites known, and without sites
        small, large = kept(10_000, engine), kept(100_000, engine)
        for records, waiting, _ in (small, large):
            assert records <= 2 * 62 and waiting <= 4
        assert small[2] < large[2] == WINDOW


@pytest.mark.slow
def test_a_recording_holds_no_more_for_a_million_allocations_than_for_a_quarter() -> None:
    """Our own memory (the tally's numpy arrays, which tracemalloc sees) is bounded by what
    the report needs, not by the number of allocations; none of it is the program's."""

    def ours(n: int) -> int:
        tracemalloc.start()
        with torchmem.record("cpu", sites=False) as rec:
            for _ in range(n):
                torch.empty(1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        cpu = rec.report().devices["cpu"]
        assert cpu.peak_bytes - cpu.start_bytes == 4  # one tiny tensor at a time
        return peak

    # What is left is a chunk being tallied (how big depends on how far the draining
    # thread lags) and the window of raw rows: a few MiB, not 80 bytes an allocation.
    small, large = ours(250_000), ours(1_000_000)
    assert large < small + 8 * 2**20 and large < 32 * 2**20


@pytest.mark.slow
def test_the_ram_peak_falls_inside_the_script(tmp_path) -> None:
    """Our analysis after the script is not in the script's ram figures: its peak is the
    script's 256 MiB buffer, at a time inside the script's span."""
    script = tmp_path / "spike.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            for _ in range(200_000):
                torch.empty(1)
            spike = bytearray(256 * 2**20)
            del spike
            """
        )
    )
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "-q", "--json", str(report), str(script)],
        check=True,
    )
    found = json.loads(report.read_text())
    ram = found["devices"]["ram"]
    assert 0 < ram["peak_time_s"] <= found["duration_s"]
    assert ram["peak_bytes"] - ram["start_bytes"] >= 256 * 2**20
