"""Meters and peak windows.

A meter measures one pool of memory: :meth:`Meter.used` is the bytes in use now, and a
:class:`Window` opened with :meth:`Meter.window` reports the exact highest use since it
opened. Any number of windows may be open on one meter at once.

Most pools have a single peak counter that can only be reset as a whole (CUDA's
``max_memory_allocated``, Linux's ``VmHWM``). The meter turns that one counter into as
many windows as needed: before every reset, the counter's value is folded into each
open window, so a window's peak is the maximum of what was folded into it and what the
counter has seen since the last reset.

A meter holds its open windows weakly: a window dropped without :meth:`Window.close`
warns (``ResourceWarning``, as an unclosed file does) and gives back what it held. In a
child made by ``os.fork``, which has only the thread that forked, every meter starts with
a free lock and forgets the other threads.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from types import TracebackType

from torchmem._compat import lock_is_owned
from torchmem.errors import TorchmemError

GONE = -1
"""The :attr:`WindowRef.thread` of a window whose thread does not exist in this process
(a child made by fork): no thread ident is negative."""


_background = threading.local()


def background_thread(target: Callable[..., None], name: str, *args: object) -> threading.Thread:
    """A daemon thread of torchmem's own (named `name`, unstarted) that runs
    ``target(*args)``: readings from it are passive (see :func:`in_background`)."""

    def run() -> None:
        _background.active = True
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)


def in_background() -> bool:
    """Whether this is one of torchmem's own threads (:func:`background_thread`). A meter
    read there must not walk Python's objects: the user's threads may be half-way through
    building one (a tuple that ``tuple(generator)`` is filling), and a reference held
    from here breaks it (``SystemError: bad argument to internal function``)."""
    return getattr(_background, "active", False)


class WindowRef(weakref.ref["Window"]):
    """A meter's weak reference to one of its open windows, with the thread that opened it."""

    __slots__ = ("thread",)
    thread: int


class Meter:
    """One pool of memory: bytes in use now, and peak windows over it.

    Subclasses provide :meth:`used` and a resettable peak counter (:meth:`_peaks`,
    :meth:`_reset_peaks`); they may react to the first window opening and the last one
    closing (:meth:`_on_open`, :meth:`_on_close`).
    """

    device: str
    """What this meter measures, as a device string: ``"cpu"``, ``"cuda:0"``, ``"ram"``, ..."""
    exact: bool = True
    """True when peaks are exact; False when they come from a sampling thread and can miss
    short spikes."""
    stats: tuple[str, ...] = ("used",)
    """The quantities a window can report a peak of; the first is the default."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._windows: dict[int, WindowRef] = {}
        """The open windows, by the id of their reference."""
        self._dropped: list[WindowRef] = []
        # A window that dies appends its reference here from C, where no KeyboardInterrupt
        # can land; see _collect.
        self._on_dropped = self._dropped.append
        _remember(self)

    def used(self) -> int:
        """Bytes in use in this pool now."""
        raise NotImplementedError

    def window(self) -> Window:
        """Open a peak window here. Close it (or use it as a context manager) when done."""
        with self._lock:
            self._collect()
            self._fold()
            window = Window(self)
            ref = WindowRef(window, self._on_dropped)
            ref.thread = threading.get_ident()
            self._on_open(ref)
            try:
                self._reset_peaks()
                window._begin(self.used())
                self._windows[id(ref)] = ref
            except BaseException:  # an error or an interrupt: give back what it took
                self._on_close(ref)
                raise
            window._ref = ref
        return window

    # The peak counter, for subclasses -------------------------------------------------

    def _peaks(self) -> dict[str, int]:
        """The highest value of each stat since the last :meth:`_reset_peaks`, in bytes."""
        raise NotImplementedError

    def _reset_peaks(self) -> None:
        """Restart the peak counter at the current values."""
        raise NotImplementedError

    def _on_open(self, ref: WindowRef) -> None:
        """Called, under the meter's lock, before each window starts."""

    def _closing(self, ref: WindowRef) -> None:
        """Called, under the meter's lock, before a window closes (not one dropped open)."""

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        """Called after each window closes, or is `dropped` open, in any thread, with or
        without the meter's lock held. A dropped window is released by a finalizer, which
        a garbage collection can run anywhere, inside PyTorch's dispatcher too: leave this
        thread's dispatch-mode stack alone then."""

    def _after_fork(self) -> None:
        """In a child made by fork: only the thread that forked exists. A lock another
        thread held at the fork stays held in the child: make a new one."""
        if not lock_is_owned(self._lock):  # held by the forking thread, which releases it
            self._lock = threading.RLock()
        me = threading.get_ident()
        for ref in self._windows.values():
            if ref.thread != me:
                ref.thread = GONE

    # The registry -------------------------------------------------------------------

    def _fold(self) -> None:
        if self._windows:
            peaks = self._peaks()
            for ref in self._windows.values():
                window = ref()
                if window is not None:
                    window._fold(peaks)

    def _collect(self) -> None:
        """Release what the windows dropped open held, where :meth:`Window.__del__` could
        not (another step of the meter was running); with the lock held."""
        dropped = self._dropped
        while dropped:
            ref = dropped.pop()
            if self._windows.pop(id(ref), None) is ref:
                self._on_close(ref, dropped=True)

    def _drop(self, ref: WindowRef) -> bool:
        """Release what a window dropped open held, unless a step of the meter is running
        (this thread's, which a garbage collection interrupted, or another's): False then,
        and :meth:`_collect` does it at the next step."""
        if lock_is_owned(self._lock) or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._windows.pop(id(ref), None) is ref:
                self._on_close(ref, dropped=True)
        finally:
            self._lock.release()
        return True

    def _restart(self, window: Window) -> None:
        with self._lock:
            self._collect()
            self._fold()
            self._reset_peaks()
            window._begin(self.used())

    def _close(self, window: Window) -> None:
        with self._lock:
            self._collect()
            ref = window._ref
            if window._final is not None or ref is None:
                return
            key = id(ref)
            self._closing(ref)
            window._fold(self._peaks())
            window._final = window._folded
            del self._windows[key]
            window._ref = None  # so that its death reports nothing
        self._on_close(ref)

    def counters(self) -> dict[str, int]:
        """This pool's current values (``"<stat>.current"``) and, where the pool keeps them,
        running totals since the meter was made (``"<stat>.allocated"``, ``"<stat>.freed"``),
        keyed the way ``torch.cuda.memory_stats()`` names them; bytes, or counts for stats
        whose name has no ``bytes``. The difference of two readings is what happened in
        between."""
        return {f"{self.stats[0]}.current": self.used()}

    def _lap(self, window: Window) -> tuple[dict[str, int], dict[str, int]]:
        """Restart `window`; return its peaks until now and :meth:`counters` at the restart."""
        with self._lock:
            self._collect()
            self._fold()
            peaks = window._folded
            self._reset_peaks()
            counters = self.counters()
            window._begin(counters[f"{self.stats[0]}.current"])
        return peaks, counters

    def _window_peaks(self, window: Window) -> dict[str, int]:
        with self._lock:
            self._collect()
            if window._final is not None:
                return window._final
            peaks = dict(window._folded)
            for stat, value in self._peaks().items():
                peaks[stat] = max(peaks.get(stat, value), value)
            return peaks

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device!r})"


class Window:
    """A peak window: the exact highest memory use of one meter since it opened.

    Obtained from :meth:`Meter.window`. Use it as a context manager, or call
    :meth:`close` (from any thread); after closing, :meth:`peak` keeps returning the final
    value. One garbage-collected while open warns with ``ResourceWarning``, as an unclosed
    file does, and gives back what it held: a sampling thread stops, a tensor meter stops
    counting at once and its dispatch mode leaves the thread's stack the next time that
    thread uses the meter.
    """

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        """The meter this window watches."""
        self.start = 0
        """Bytes in use (the meter's default stat) when the window opened or last restarted."""
        self.missed_reset = False
        """True once the meter found that other code reset the pool's peak counter while
        this window was open, in a way it could not intercept (from C++): :meth:`peak` then
        counts only from that reset, and may be too low. It stays True after
        :meth:`restart`. Only the allocator meters (CUDA, XPU) set it."""
        self._folded: dict[str, int] = {}
        self._final: dict[str, int] | None = None
        self._ref: WindowRef | None = None

    def _begin(self, used: int) -> None:
        self.start = used
        self._folded = {}

    def _fold(self, peaks: dict[str, int]) -> None:
        folded = self._folded
        for stat, value in peaks.items():
            if stat not in folded or value > folded[stat]:
                folded[stat] = value

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._final is not None

    def peak(self, stat: str | None = None) -> int:
        """Highest use, in bytes, since the window opened (or last restarted).

        Args:
            stat: which of the meter's :attr:`Meter.stats` to report; the default is the
                first (allocated bytes for tensor and CUDA meters, resident bytes for
                ``"ram"``). CUDA meters also accept any key of
                ``torch.cuda.memory_stats()`` that has a ``.peak``, without that suffix
                (``"reserved_bytes.all"``, ``"active_bytes.large_pool"``, ...).

        This is an absolute value of the pool, not a difference; the rise above the
        start is ``window.peak() - window.start``.
        """
        peaks = self.meter._window_peaks(self)
        key = self.meter.stats[0] if stat is None else stat
        if key not in peaks:
            raise ValueError(
                f"unknown stat {stat!r} for {self.meter!r}; known: {', '.join(sorted(peaks))}"
            )
        return peaks[key]

    def restart(self) -> None:
        """Start over from here: the peak and :attr:`start` restart at the current use."""
        if self.closed:
            raise TorchmemError(f"cannot restart a closed window on {self.meter!r}")
        self.meter._restart(self)

    def lap(self) -> dict[str, int]:
        """Restart, and return the peak of every stat over the period that just ended.

        The same as reading :meth:`peak` for each of the meter's stats and then calling
        :meth:`restart`, in one step: nothing that happens in between is lost.
        """
        return self.lap_with_counters()[0]

    def lap_with_counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """:meth:`lap`, and the meter's :meth:`Meter.counters` at the restart, in one step:
        what happened during the period is the difference of two such readings."""
        if self._final is not None:  # closed; the line profiler calls this on every line
            raise TorchmemError(f"cannot restart a closed window on {self.meter!r}")
        return self.meter._lap(self)

    def close(self) -> None:
        """Stop watching and freeze :meth:`peak`. Closing twice is harmless."""
        self.meter._close(self)

    def __enter__(self) -> Window:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Window on {self.meter!r}, {state}, start={self.start}>"

    def __del__(
        self,
        _warn: Callable[..., None] = warnings.warn,
        _finalizing: Callable[[], bool] = sys.is_finalizing,
    ) -> None:
        # Defaults bind what is needed: at interpreter exit, module globals may be gone.
        ref = getattr(self, "_ref", None)
        if ref is None or self._final is not None or _finalizing():
            return
        try:
            if ref.thread != GONE:  # not another thread's, left behind by a fork
                _warn(
                    f"Window on {self.meter!r} was never closed: close() it, or open it in"
                    " a with statement",
                    ResourceWarning,
                    source=self,
                )
        finally:
            if self.meter._drop(ref):
                self._ref = None  # released: its death reports nothing


class SampledMeter(Meter):
    """A meter whose pool has no peak counter: a thread samples :meth:`used` while any
    window is open, sleeping :attr:`interval` seconds between samples.

    Peaks are approximate (:attr:`exact` is False): a spike shorter than the interval,
    or one that happens while another thread holds the GIL, can be missed.
    """

    exact = False
    interval = 0.001
    """Seconds between two samples."""

    def __init__(self) -> None:
        super().__init__()
        self._peak = 0
        self._sampler: threading.Thread | None = None
        self._stop_sampling = threading.Event()
        self.samples = 0
        """How many samples the thread has taken, over the meter's life."""

    def _peaks(self) -> dict[str, int]:
        return {self.stats[0]: max(self._peak, self.used())}

    def _reset_peaks(self) -> None:
        self._peak = self.used()

    def _sample(self) -> None:
        value = self.used()
        with self._lock:
            self.samples += 1
            if value > self._peak:
                self._peak = value
            # A window dropped open while this thread held the lock is released here: no
            # other step of the meter may come, and this thread would sample on for good.
            self._collect()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            self._sample()

    def _after_fork(self) -> None:
        super()._after_fork()
        # The sampling thread is not in the child: the next window opened there starts one.
        self._sampler = None
        self._stop_sampling = threading.Event()

    def _on_open(self, ref: WindowRef) -> None:
        if self._sampler is None:
            self._stop_sampling = threading.Event()
            self._sampler = background_thread(
                self._run, f"torchmem-{self.device}", self._stop_sampling
            )
            self._sampler.start()

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        with self._lock:
            if self._windows or self._sampler is None:
                return
            sampler, self._sampler = self._sampler, None
            self._stop_sampling.set()
        # Under the lock (a window dropped open, released by a step) the sampler may be
        # waiting for it: it sees the event and ends by itself.
        if sampler is not threading.current_thread() and not lock_is_owned(self._lock):
            sampler.join()


_made: list[weakref.ref[Meter]] = []
"""Every meter made in this process, weakly (no callback: nothing runs when one dies)."""


def _remember(meter: Meter) -> None:
    if len(_made) >= 64 and len(_made) & (len(_made) - 1) == 0:  # at each power of two
        _made[:] = [ref for ref in _made if ref() is not None]
    _made.append(weakref.ref(meter))


def _after_fork_in_child() -> None:
    for ref in _made:
        meter = ref()
        if meter is not None:
            meter._after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
