"""Progress while ``torchmem run`` runs: the ``--live`` view, and the plain progress line.

Both show what :class:`Gauges` reads, from a thread of torchmem's own
(:func:`~torchmem.meters.base.background_thread`) about four times a second: per device
the bytes in use now and the peak so far (peak windows on the meters the recording runs,
opened once it has started, so the peaks are exact), the ``optimizer.step()`` calls so far
(a global step post hook of the view's own) and the CPU allocations alive by site, as the
CPU log's drain thread last tallied them. Every reading is passive: no walk of Python
objects, no lock the script's threads wait on for more than a counter's read.

The ``--live`` view is drawn by ``rich`` (the ``live`` extra) on stderr, and removed when
the run ends, however it ends. The progress line is one line on stderr rewritten with a
carriage return, only where stderr is a terminal, after :data:`DELAY` seconds; it yields to
the script's own output (see :class:`ProgressLine`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, NamedTuple

from torchmem.errors import require
from torchmem.units import readable_size

if TYPE_CHECKING:
    import numpy as np
    from rich.console import Console, RenderableType
    from rich.file_proxy import FileProxy
    from torch.utils.hooks import RemovableHandle

    from torchmem.events.tally import Tally
    from torchmem.meters import Window
    from torchmem.recording import Recording
    from torchmem.records.frames import SiteKey

INTERVAL = 0.25
"""Seconds between two refreshes."""
DELAY = 3.0
"""Seconds of a run before the progress line first shows, and of silence from the
script's own output before it shows again."""
SITES = 5
"""How many sites the ``--live`` view lists."""
IO_COUNTERS = "/proc/self/io"
"""Linux's count of the bytes this process wrote (``wchar``): how the progress line sees
the script write, to a terminal or anywhere else."""


class DeviceNow(NamedTuple):
    """One device's bytes, as read now."""

    device: str
    used: int
    """Bytes in use now."""
    peak: int
    """The highest bytes in use since the run started."""


class SiteNow(NamedTuple):
    """A line of the script and the bytes of the CPU allocations it made that are alive."""

    site: str
    """``file:line  function``."""
    bytes: int


class Reading(NamedTuple):
    """What the gauges read at one moment."""

    elapsed: float
    """Seconds since the run started."""
    steps: int
    """``optimizer.step()`` calls so far (of any optimizer)."""
    devices: tuple[DeviceNow, ...]
    sites: tuple[SiteNow, ...]
    """The CPU sites with the most bytes alive, most first."""
    sites_at: float | None
    """Seconds since the start that :attr:`sites` were tallied to (the drain thread tallies
    the CPU log in chunks); None where CPU allocations have no event log."""


class Gauges:
    """Passive readings of a running recording: :meth:`open` in the script's thread once
    `recording` has started, :meth:`read` from any thread, :meth:`close` before the
    recording stops."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._windows: list[Window] = []
        self._steps = 0
        self._hook: RemovableHandle | None = None
        self._start = 0.0
        self._tally: Tally | None = None
        self._sites: dict[int, SiteKey] = {}
        self._seen: object = None
        self._top: tuple[SiteNow, ...] = ()

    def open(self) -> None:
        """Open a peak window on each meter the recording runs, count the optimizer steps
        and find the recording's CPU tally."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._start = time.monotonic()
        try:
            for found in self.recording.meters:
                self._windows.append(found.window())
            self._hook = register_optimizer_step_post_hook(self._count_step)
            log = self.recording.cpu_log
            if log is not None and log.stream is not None:
                self._tally, self._sites = log.tally, log.stream.sites
        except BaseException:
            self.close()
            raise

    def _count_step(self, optimizer: object, args: object, kwargs: object) -> None:
        self._steps += 1

    def read(self) -> Reading:
        """The gauges now: cheap enough for four times a second (the CPU sites are
        summed again only when the drain thread has tallied more)."""
        devices = []
        for window in self._windows:
            used = window.meter.used()
            devices.append(DeviceNow(window.meter.device, used, max(window.peak(), used)))
        sites, at = self._top_sites()
        elapsed = time.monotonic() - self._start
        return Reading(elapsed, self._steps, tuple(devices), sites, at)

    def _top_sites(self) -> tuple[tuple[SiteNow, ...], float | None]:
        """The CPU sites with the most bytes alive, as last tallied, and when that was.

        The drain thread replaces the tally's table of live allocations whole, and never
        changes the sizes or sites of one it has published: the table read here is a
        consistent one without its lock."""
        tally = self._tally
        if tally is None:
            return (), None
        at = (tally.last_time - tally.start) / 1e9
        live = tally.live
        if live is not self._seen:
            self._top = _summed(live.site, live.size, self._sites)
            self._seen = live
        return self._top, max(at, 0.0)

    def close(self) -> None:
        """Close the windows and remove the hook; harmless twice."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        windows, self._windows = self._windows, []
        for window in windows:
            window.close()
        self._tally = None


def _summed(site: np.ndarray, size: np.ndarray, names: dict[int, SiteKey]) -> tuple[SiteNow, ...]:
    """The :data:`SITES` sites with the most bytes, from allocations' `site` and `size`."""
    import numpy as np

    if not len(site):
        return ()
    order = np.argsort(site, kind="stable")
    ordered = site[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    totals = np.add.reduceat(size[order], starts)
    best = np.argsort(-totals, kind="stable")[:SITES]
    return tuple(SiteNow(_site_name(int(ordered[starts[i]]), names), int(totals[i])) for i in best)


def _site_name(index: int, names: dict[int, SiteKey]) -> str:
    from torchmem.events.analysis import BEFORE
    from torchmem.events.tally import BEFORE_SITE
    from torchmem.meters.native import NO_PYTHON_SITE
    from torchmem.records.frames import NO_PYTHON

    key = names.get(index)
    if key is not None:
        file, line, function = key
        return f"{file}:{line}  {function}" if line else f"{file} (autograd's engine)"
    return {BEFORE_SITE: BEFORE, NO_PYTHON_SITE: NO_PYTHON}.get(index, "<no site recorded>")


class Progress:
    """A thread of torchmem's own that shows the gauges' readings every :data:`INTERVAL`
    seconds after `delay`; :meth:`stop` ends it and removes what it showed."""

    delay = 0.0

    def __init__(self, gauges: Gauges, stream: IO[str]) -> None:
        self.gauges = gauges
        self.stream = stream
        """Where it draws: the terminal the run's stderr was when it started."""
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the gauges and start showing (in the script's thread, once the recording
        has started)."""
        from torchmem.meters.base import background_thread

        self.gauges.open()
        try:
            self._begin()
        except BaseException:
            self.gauges.close()
            raise
        self._thread = background_thread(self._run, "torchmem-progress")
        self._thread.start()

    def stop(self) -> None:
        """Stop showing and remove what is shown; close the gauges. Harmless twice, and a
        no-op in a child the script forked (the thread is its parent's)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._halt.set()
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join()
        try:
            self._end()
        finally:
            self.gauges.close()

    def _run(self) -> None:
        if self._halt.wait(self.delay):
            return
        try:
            while True:
                self._show(self.gauges.read())
                if self._halt.wait(INTERVAL):
                    return
        except Exception:  # never the script's problem: the view stops, the run goes on
            return

    def _begin(self) -> None:
        """Get ready to show (in the script's thread)."""

    def _show(self, reading: Reading) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError


class LiveView(Progress):
    """``torchmem run --live``: a table redrawn in place on stderr by ``rich``'s
    :class:`~rich.live.Live`, removed at the end.

    While it shows, the script's ``sys.stderr`` (and its ``sys.stdout``, where that is a
    terminal too) are proxies that print the script's lines above the table; a process the
    script forks gets its streams back. Each line is drawn and written under the lock of
    the view's refreshes, so that a refresh never lands between the two (``rich``'s own
    proxies release it in between). Output written to the file descriptors directly (C
    code, child processes) bypasses them and may tear the table until its next refresh.
    """

    def __init__(self, gauges: Gauges, stream: IO[str]) -> None:
        super().__init__(gauges, stream)
        from rich.console import Console
        from rich.live import Live

        # No markup, highlighting or emoji: the script's text is printed as it wrote it.
        console = Console(file=stream, markup=False, highlight=False, emoji=False)
        self._live = Live(
            console=console,
            auto_refresh=False,  # refreshed from our thread, whose readings are passive
            transient=True,
            redirect_stdout=False,  # by our own proxies (see the class)
            redirect_stderr=False,
        )
        self._drawing = threading.RLock()  # reentrant: a signal handler may print mid-line
        self._streams: dict[str, IO[str]] = {}
        """The script's streams the proxies stand for, by name in :mod:`sys`."""

    def _begin(self) -> None:
        with self._drawing:
            self._live.start()
            names = ("stdout", "stderr") if _isatty(sys.stdout) else ("stderr",)
            for name in names:
                self._streams[name] = getattr(sys, name)
                setattr(sys, name, _proxy(self._live.console, self._streams[name], self._drawing))
        if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
            os.register_at_fork(after_in_child=self._forget)

    def _show(self, reading: Reading) -> None:
        with self._drawing:
            self._live.update(view(reading), refresh=True)

    def _end(self) -> None:
        with self._drawing:
            try:
                self._live.stop()
            finally:
                self._give_back()

    def _forget(self) -> None:
        """In a child the script forked: its streams are its own again, not proxies that
        would draw a copy of the table."""
        if self._thread is not None:
            self._give_back()
            self._thread = None

    def _give_back(self) -> None:
        """The script's streams back, where they are still the proxies."""
        from rich.file_proxy import FileProxy

        for name, original in self._streams.items():
            if isinstance(getattr(sys, name), FileProxy):
                setattr(sys, name, original)
        self._streams = {}


def _proxy(console: Console, file: IO[str], lock: threading.RLock) -> FileProxy:
    """A proxy of `file` that prints each line above `console`'s live view, drawing and
    writing it while holding `lock`."""
    from rich.file_proxy import FileProxy

    class Drawn(FileProxy):
        def write(self, text: str) -> int:
            with lock:
                return super().write(text)

        def flush(self) -> None:
            with lock:
                super().flush()

    return Drawn(console, file)


def view(reading: Reading) -> RenderableType:
    """The ``--live`` table of `reading`: a ``rich`` renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = Text(f"torchmem run  {reading.elapsed:.1f}s  step {reading.steps}", style="bold")
    devices = Table(box=None, padding=(0, 1), pad_edge=False)
    for name in ("device", "now", "peak"):
        devices.add_column(name, justify="left" if name == "device" else "right")
    for found in _shown(reading.devices):
        devices.add_row(found.device, readable_size(found.used), readable_size(found.peak))
    if reading.sites_at is None or not reading.sites:
        return Group(title, devices)
    sites = Table(box=None, padding=(0, 1), pad_edge=False)
    sites.add_column("bytes", justify="right")
    sites.add_column("site", overflow="ellipsis", no_wrap=True)
    for site in reading.sites:
        sites.add_row(readable_size(site.bytes), site.site)
    alive = Text(f"CPU allocations alive at {reading.sites_at:.1f}s, by site", style="bold")
    return Group(title, devices, "", alive, sites)


def _shown(devices: tuple[DeviceNow, ...]) -> list[DeviceNow]:
    """The devices worth a row: not a GPU the run has not used."""
    return [d for d in devices if d.peak or not d.device.startswith("cuda")]


def line(reading: Reading) -> str:
    """The progress line of `reading`: ``torchmem: 12.3s  cuda:0 1.20G (peak 3.40G)  cpu
    37.21M (peak 40.00M)  step 45``; process RAM only where nothing else is recorded."""
    shown = _shown(reading.devices)
    tensors = [d for d in shown if d.device != "ram"]
    parts = [f"torchmem: {reading.elapsed:.1f}s"]
    for found in tensors or shown:
        used, peak = readable_size(found.used), readable_size(found.peak)
        parts.append(f"{found.device} {used} (peak {peak})")
    parts.append(f"step {reading.steps}")
    return "  ".join(parts)


class ProgressLine(Progress):
    """The progress line: drawn after :data:`DELAY` seconds, rewritten in place with a
    carriage return (no other control code), cleared at the end.

    It must not tear the script's own output, which a line on the same terminal does (the
    script's next line would start after it), and the script's streams are left as they
    are. So it yields: where Linux counts what the process writes (``/proc/self/io``), any
    byte written but its own hides the line until the script has been silent for
    :data:`DELAY` seconds (a script that prints every second shows none; a write between
    two refreshes may still land after it once). Clearing writes spaces over the terminal's
    current line: what the script left there without a newline goes with it.
    """

    delay = DELAY

    def __init__(self, gauges: Gauges, stream: IO[str]) -> None:
        super().__init__(gauges, stream)
        self._fd = stream.fileno()
        self._width = 0
        """Characters of the line on the terminal now (0: none)."""
        self._written: int | None = None
        self._quiet_since = 0.0

    def _begin(self) -> None:
        # From the script's start: what the recording's start wrote (to /proc) is not its.
        self._written = _written()
        self._quiet_since = time.monotonic()

    def _show(self, reading: Reading) -> None:
        now = time.monotonic()
        if self._foreign():
            self._quiet_since = now
            self._clear()  # not the line it was drawn on, where it went to the terminal
            return
        if now - self._quiet_since < DELAY:
            return
        columns = _columns(self._fd)
        text = line(reading)[: columns - 1]
        self._put("\r" + text.ljust(self._width))
        self._width = len(text)

    def _end(self) -> None:
        # Even after a write of the script's: one to a file (a checkpoint) leaves the line
        # where it was, and after a line to the terminal the spaces fall on an empty one.
        self._clear()

    def _foreign(self) -> bool:
        """Whether this process wrote anything since the last look but the line itself."""
        written = _written()
        foreign = written is not None and self._written is not None and written > self._written
        self._written = written
        return foreign

    def _clear(self) -> None:
        if self._width:
            self._put("\r" + " " * self._width + "\r")
            self._width = 0

    def _put(self, text: str) -> None:
        data = text.encode(getattr(self.stream, "encoding", None) or "utf-8", "replace")
        with contextlib.suppress(OSError):
            os.write(self._fd, data)
        if self._written is not None:
            self._written += len(data)


def _written() -> int | None:
    """The bytes this process has written so far (Linux's ``wchar``), or None."""
    try:
        with open(IO_COUNTERS, "rb") as counters:
            for row in counters:
                if row.startswith(b"wchar:"):
                    return int(row.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _columns(fd: int) -> int:
    try:
        return os.get_terminal_size(fd).columns
    except OSError:
        return 80


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, AttributeError):  # closed, or not a file
        return False


def progress(
    recording: Recording, live: bool, line_wanted: bool, stream: IO[str] | None
) -> Progress | None:
    """What `recording`'s run shows while it runs: the ``--live`` view where `live`, the
    progress line where `line_wanted`, on `stream` (the run's stderr), where that is a
    terminal; else None. Nothing starts here (see :meth:`Progress.start`).

    Raises:
        ImportError: `live`, but ``rich`` is not installed (the message says how).
    """
    if live:
        require("rich.live", "torchmem run --live", "live")
    if stream is None or not _isatty(stream):
        return None
    if live:
        return LiveView(Gauges(recording), stream)
    return ProgressLine(Gauges(recording), stream) if line_wanted else None
