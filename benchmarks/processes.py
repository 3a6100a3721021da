"""Whole commands in new processes, timed and weighed: each run's wall time, its peak RSS,
and how long after the script's last line it ended.

The peak RSS is the command's own ``ru_maxrss``, from ``os.wait4``, read by a small
launcher (``python -S``, a few MiB) that starts the command and waits for it: Linux
counts in a child's peak the memory of the process it was forked from (the benchmark's
own, hundreds of MiB with torch imported), and ``RUSAGE_CHILDREN`` would be the largest
of every child so far. A script tells its last line by printing :data:`MARK` and
``time.monotonic()`` (one clock for every process on the machine); the command's end is
when the launcher's ``os.wait4`` returns. For plain ``python`` that gap is the
interpreter's shutdown; under ``torchmem run`` it is also the recording's stop and its
report. Contenders alternate, `repeat` rounds, the baseline first in each; each figure
is the median of its rounds.

A contender still running at :data:`LIMIT` times the baseline's time in the same round
(at least :data:`FLOOR` seconds) is stopped there and not run again: its row says so,
with the time it ran and its peak RSS until then (lower bounds). A recording that grows
quadratically would otherwise take hours.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MARK = "torchmem-benchmark: last line at"
"""What a script prints, then ``time.monotonic()``, as its last line."""
LIMIT = 5
"""A contender is stopped at this many times the baseline's time in the same round..."""
FLOOR = 60.0
"""... or this many seconds, if more."""

MiB = 2**20


@dataclass(frozen=True)
class Process:
    """One run of a command."""

    seconds: float
    """Wall time, from just before its start to its end."""
    rss: int
    """Peak resident set size, bytes."""
    tail: float | None
    """Seconds from the script's last line (:data:`MARK`) to the process's end; None when
    it printed none."""
    stopped: bool = False
    """Whether it was stopped at its time limit (its times and peak are then lower
    bounds)."""


@dataclass(frozen=True)
class Run:
    """A contender's medians over its rounds, and how they compare to the baseline's."""

    case: str
    contender: str
    seconds: float
    ratio: float
    """Wall time over the baseline's."""
    rss: int
    over: int
    """Peak RSS over the baseline's, bytes."""
    tail: float | None
    stopped: bool = False
    """Whether it was stopped at its time limit: `seconds`, `ratio`, `rss` and `over` are
    then those of that run, lower bounds."""


LAUNCHER = """
import json, os, subprocess, sys, threading, time
limit = float(sys.argv[2])
start = time.monotonic()
child = subprocess.Popen(sys.argv[3:])
stopped = threading.Event()
def stop():
    stopped.set()
    child.kill()
timer = threading.Timer(limit, stop)
if limit > 0:
    timer.start()
_, status, usage = os.wait4(child.pid, 0)
ended = time.monotonic()
timer.cancel()
result = {
    "start": start,
    "ended": ended,
    "code": os.waitstatus_to_exitcode(status),
    "maxrss": usage.ru_maxrss,
    "stopped": stopped.is_set(),
}
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
"""
"""Runs the command (its arguments after the result file's path and the time limit, 0
for none), waits for it, killing it at the limit, and writes its times, exit code,
``ru_maxrss`` and whether it was stopped to the result file as JSON."""


def run(
    command: list[str], env: Mapping[str, str] | None = None, limit: float | None = None
) -> Process:
    """Run `command` to its end (or kill it after `limit` seconds), through
    :data:`LAUNCHER`; its output goes to temporary files (read back for :data:`MARK`,
    and for the error when it fails)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder, "result.json")
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with out.open("wb") as stdout, err.open("wb") as stderr:
            launcher = [sys.executable, "-S", "-c", LAUNCHER, str(result), str(limit or 0)]
            subprocess.run([*launcher, *command], stdout=stdout, stderr=stderr, env=env, check=True)
        found = json.loads(result.read_text())
        output = out.read_text(errors="replace")
        if found["code"] and not found["stopped"]:
            error = err.read_text(errors="replace")
            raise subprocess.CalledProcessError(found["code"], command, output, error)
    tail = None
    for line in reversed(output.splitlines()):
        if line.startswith(MARK) and not found["stopped"]:
            tail = found["ended"] - float(line.removeprefix(MARK))
            break
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    rss = found["maxrss"] * (1 if sys.platform == "darwin" else 1024)
    return Process(found["ended"] - found["start"], rss, tail, found["stopped"])


def measure(
    case: str, commands: Mapping[str, list[str]], repeat: int, env: Mapping[str, str] | None = None
) -> list[Run]:
    """Each command run `repeat` rounds, alternating, the first (the baseline) first in
    each round and the others limited to :data:`LIMIT` times its time then (at least
    :data:`FLOOR` s); a row per command, in order, with its medians compared to the
    baseline's. A command stopped at its limit is not run again: its row is that run's."""
    base, *others = commands
    found: dict[str, list[Process]] = {name: [] for name in commands}
    for _ in range(repeat):
        baseline = run(commands[base], env)
        found[base].append(baseline)
        limit = max(FLOOR, LIMIT * baseline.seconds)
        for name in others:
            if not any(p.stopped for p in found[name]):
                found[name].append(run(commands[name], env, limit))
    medians = {}
    for name, runs in found.items():
        if stopped := [p for p in runs if p.stopped]:
            medians[name] = stopped[0]
            continue
        tails = [p.tail for p in runs if p.tail is not None]
        medians[name] = Process(
            statistics.median(p.seconds for p in runs),
            round(statistics.median(p.rss for p in runs)),
            statistics.median(tails) if tails else None,
        )
    plain = medians[base]
    return [
        Run(
            case,
            name,
            m.seconds,
            m.seconds / plain.seconds,
            m.rss,
            m.rss - plain.rss,
            m.tail,
            m.stopped,
        )
        for name, m in medians.items()
    ]


def table(runs: list[Run]) -> str:
    """The runs as a markdown table; a stopped run's figures are lower bounds (>)."""
    lines = [
        "| case | contender | median | ratio | peak RSS | RSS over plain | end after last line |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        at_least = ">" if r.stopped else ""
        tail = "stopped" if r.stopped else "-" if r.tail is None else f"{r.tail * 1e3:.0f} ms"
        lines.append(
            f"| {r.case} | {r.contender} | {at_least}{r.seconds:.2f} s | {at_least}{r.ratio:.2f}x "
            f"| {at_least}{r.rss / MiB:.0f} MiB | {at_least}{r.over / MiB:+.0f} MiB | {tail} |"
        )
    return "\n".join(lines)


def verdicts(runs: list[Run], ratios: Mapping[str, float], rss_mib: float) -> str:
    """A line per contender named in `ratios` (its highest ratio, or ``inf`` for none):
    its ratio and RSS over the baseline against the targets, each met or missed (or, for
    the RSS of a stopped run still under its target, not known)."""
    lines = []
    for r in runs:
        if r.contender not in ratios:
            continue
        at_least = "more than " if r.stopped else ""
        ratio = f"{at_least}{r.ratio:.2f}x"
        if r.stopped:
            ratio += " (stopped before its end)"
        if ratios[r.contender] != float("inf"):
            met = "met" if r.ratio <= ratios[r.contender] and not r.stopped else "missed"
            ratio += f" (target {ratios[r.contender]}x: {met})"
        met = "missed" if r.over > rss_mib * MiB else "not known" if r.stopped else "met"
        rss = f"{at_least}{r.over / MiB:+.0f} MiB RSS (target +{rss_mib:.0f} MiB: {met})"
        lines.append(f"- {r.case}, {r.contender}: {ratio}, {rss}")
    return "\n".join(lines)
