"""The process RAM meter: resident memory (RSS) of this process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import psutil

from torchmem.meters.base import SampledMeter, WindowRef

CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"
STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LINUX = sys.platform == "linux"


class RamMeter(SampledMeter):
    """Resident memory of this process, in bytes (``"ram"``).

    On Linux the peak is exact: the kernel keeps the process's high-water mark
    (``VmHWM``), and writing ``5`` to ``/proc/self/clear_refs`` restarts it. That catches
    a spike no sampling thread can see, such as a buffer allocated and freed inside one
    call that holds the GIL. Where that write is refused (some containers) or the OS is
    not Linux, a thread samples RSS instead and :attr:`exact` is False.

    Restarting the high-water mark also restarts what the program itself reads as its
    peak (``VmHWM``, ``resource.getrusage``'s ``ru_maxrss``, ``/usr/bin/time``). A
    recording (:meth:`keep_high_water_mark`) never restarts it.
    """

    stats = ("rss",)

    def __init__(self) -> None:
        super().__init__()
        self.device = "ram"
        self._process = psutil.Process()
        self._exact: bool | None = None
        self._keeping = 0
        self._mark = 0  # the kernel's high-water mark at the last reset, while kept

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """Whether peaks are the kernel's, restarted for each window (Linux, where
        ``/proc/self/clear_refs`` can be written: found out, by writing it, on first use),
        and not sampled because a recording keeps the mark now."""
        if self._keeping:  # first: the probe below writes clear_refs
            return False
        if self._exact is None:
            self._exact = sys.platform == "linux" and _clear_refs()
        return self._exact

    def used(self) -> int:
        if _LINUX:  # what psutil reads, without its objects: a sample every millisecond
            return _resident()
        return int(self._process.memory_info().rss)

    def keep_high_water_mark(self) -> Callable[[], bool]:
        """Until the returned function is called, never restart the kernel's high-water
        mark (the program's own ``ru_maxrss`` stays its own): a thread samples RSS, and a
        peak that is the process's highest yet is the kernel's, exact. The function says
        whether the span's peak was such a one (exact); call it once."""
        start = _high_water_mark() if _LINUX else 0
        with self._lock:
            self._keeping += 1
            self._mark, self._peak = start, self.used()
            if self._windows:
                SampledMeter._on_open(self, None)  # type: ignore[arg-type]

        def release() -> bool:
            with self._lock:
                self._keeping -= 1
            return _LINUX and _high_water_mark() > start

        return release

    def _passive(self) -> bool:
        return not self.exact

    def _peaks(self) -> dict[str, int]:
        if not self._passive():
            return {"rss": max(_high_water_mark(), self.used())}
        sampled = super()._peaks()["rss"]
        if self._keeping and _LINUX and (mark := _high_water_mark()) > self._mark:
            return {"rss": max(mark, sampled)}  # a new high for the process: exact
        return {"rss": sampled}

    def _reset_peaks(self) -> None:
        if not self._passive():
            _clear_refs()
            return
        super()._reset_peaks()
        if self._keeping and _LINUX:
            self._mark = _high_water_mark()

    def _on_open(self, ref: WindowRef) -> None:
        if self._passive():
            super()._on_open(ref)

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        super()._on_close(ref, dropped)  # stops the sampler, where one runs


def _clear_refs() -> bool:
    """Restart the kernel's high-water mark of this process's RSS; False if refused."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _resident() -> int:
    """This process's RSS in bytes, from ``/proc/self/statm``."""
    global _statm
    pid = os.getpid()
    if _statm[0] != pid:  # first use, or a child made by fork: the descriptor names its parent
        _statm = (pid, os.open(STATM, os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE


_statm = (-1, -1)
"""(the process id that opened it, a descriptor of ``/proc/self/statm``)"""


def _high_water_mark() -> int:
    """The kernel's peak RSS of this process since the last reset, in bytes."""
    with open(STATUS) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmHWM line in {STATUS}")
