"""The process RAM meter: resident memory (RSS) of this process."""

from __future__ import annotations

import sys

import psutil

from torchmem.meters.base import SampledMeter, WindowRef

CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"


class RamMeter(SampledMeter):
    """Resident memory of this process, in bytes (``"ram"``).

    On Linux the peak is exact: the kernel keeps the process's high-water mark
    (``VmHWM``), and writing ``5`` to ``/proc/self/clear_refs`` restarts it. That catches
    a spike no sampling thread can see, such as a buffer allocated and freed inside one
    call that holds the GIL. Where that write is refused (some containers) or the OS is
    not Linux, a thread samples RSS instead and :attr:`exact` is False.

    Resetting the high-water mark also resets what ``resource.getrusage`` reports as
    ``ru_maxrss`` for this process.
    """

    stats = ("rss",)

    def __init__(self) -> None:
        super().__init__()
        self.device = "ram"
        self._process = psutil.Process()
        self.exact = sys.platform == "linux" and _clear_refs()

    def used(self) -> int:
        return int(self._process.memory_info().rss)

    def _peaks(self) -> dict[str, int]:
        if not self.exact:
            return super()._peaks()
        return {"rss": max(_high_water_mark(), self.used())}

    def _reset_peaks(self) -> None:
        if self.exact:
            _clear_refs()
        else:
            super()._reset_peaks()

    def _on_open(self, ref: WindowRef) -> None:
        if not self.exact:
            super()._on_open(ref)

    def _on_close(self, ref: WindowRef, dropped: bool = False) -> None:
        if not self.exact:
            super()._on_close(ref, dropped)


def _clear_refs() -> bool:
    """Restart the kernel's high-water mark of this process's RSS; False if refused."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _high_water_mark() -> int:
    """The kernel's peak RSS of this process since the last reset, in bytes."""
    with open(STATUS) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmHWM line in {STATUS}")
