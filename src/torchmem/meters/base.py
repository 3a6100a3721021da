"""Meters and peak windows.

A meter measures one pool of memory: :meth:`Meter.used` is the bytes in use now, and a
:class:`Window` opened with :meth:`Meter.window` reports the exact highest use since it
opened. Any number of windows may be open on one meter at once.

Most pools have a single peak counter that can only be reset as a whole (CUDA's
``max_memory_allocated``, Linux's ``VmHWM``). The meter turns that one counter into as
many windows as needed: before every reset, the counter's value is folded into each
open window, so a window's peak is the maximum of what was folded into it and what the
counter has seen since the last reset.
"""

from __future__ import annotations

import threading
from types import TracebackType

from torchmem.errors import TorchmemError


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
        self._windows: list[Window] = []

    def used(self) -> int:
        """Bytes in use in this pool now."""
        raise NotImplementedError

    def window(self) -> Window:
        """Open a peak window here. Close it (or use it as a context manager) when done."""
        with self._lock:
            self._fold()
            window = Window(self)
            self._on_open(window)
            self._reset_peaks()
            window._begin(self.used())
            self._windows.append(window)
        return window

    # The peak counter, for subclasses -------------------------------------------------

    def _peaks(self) -> dict[str, int]:
        """The highest value of each stat since the last :meth:`_reset_peaks`, in bytes."""
        raise NotImplementedError

    def _reset_peaks(self) -> None:
        """Restart the peak counter at the current values."""
        raise NotImplementedError

    def _on_open(self, window: Window) -> None:
        """Called, under the meter's lock, before each window starts."""

    def _on_close(self, window: Window) -> None:
        """Called after each window closes, outside the meter's lock."""

    # The registry -------------------------------------------------------------------

    def _fold(self) -> None:
        if self._windows:
            peaks = self._peaks()
            for window in self._windows:
                window._fold(peaks)

    def _restart(self, window: Window) -> None:
        with self._lock:
            self._fold()
            self._reset_peaks()
            window._begin(self.used())

    def _close(self, window: Window) -> None:
        with self._lock:
            if window._final is not None:
                return
            window._fold(self._peaks())
            window._final = window._folded
            self._windows.remove(window)
        self._on_close(window)

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
            self._fold()
            peaks = window._folded
            self._reset_peaks()
            counters = self.counters()
            window._begin(counters[f"{self.stats[0]}.current"])
        return peaks, counters

    def _window_peaks(self, window: Window) -> dict[str, int]:
        with self._lock:
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
    :meth:`close`; after closing, :meth:`peak` keeps returning the final value.
    """

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        """The meter this window watches."""
        self.start = 0
        """Bytes in use (the meter's default stat) when the window opened or last restarted."""
        self._folded: dict[str, int] = {}
        self._final: dict[str, int] | None = None

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

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            self._sample()

    def _on_open(self, window: Window) -> None:
        if self._sampler is None:
            self._stop_sampling = threading.Event()
            self._sampler = threading.Thread(
                target=self._run,
                args=(self._stop_sampling,),
                name=f"torchmem-{self.device}",
                daemon=True,
            )
            self._sampler.start()

    def _on_close(self, window: Window) -> None:
        with self._lock:
            if self._windows or self._sampler is None:
                return
            sampler, self._sampler = self._sampler, None
            self._stop_sampling.set()
        if sampler is not threading.current_thread():
            sampler.join()
