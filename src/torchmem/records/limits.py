"""The pytest plugin's records: what a test's memory did, and its limits' verdicts.

Made by :mod:`torchmem.limits`; read by :mod:`torchmem.render.limits`. Sizes are int bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchmem.records.run import DeviceRun, Growth, ModulePeak
from torchmem.records.tensors import TensorRecord

MARKERS = ("limit_memory", "limit_leaks")
"""The plugin's markers, which are also the kinds of :class:`Limit`."""
PREFIX = "torchmem_"
"""Before a marker's name, the name that is torchmem's wherever pytest-memray is loaded
too (``torchmem_limit_memory``)."""


@dataclass(frozen=True)
class Limit:
    """One limit a test carries (``@pytest.mark.limit_memory("24 MB")``)."""

    kind: str
    """One of :data:`MARKERS`: ``"limit_memory"`` limits the peak, ``"limit_leaks"`` what
    stays in use after the test."""
    limit_bytes: int
    """The most bytes allowed above what was in use when the test started."""
    device: str
    """The device measured: ``"cuda:0"``, ``"cpu"`` (CPU tensors), ``"ram"`` (the process's
    resident memory), ..."""
    setup: bool = False
    """Whether the test's fixtures are charged too: measured from before their setup (and,
    for ``limit_leaks``, until after their teardown) instead of around the test body."""
    current_thread_only: bool = False
    """Whether only the test's own thread is counted (the storages it, and the autograd
    threads it starts, made), as pytest-memray's keyword of that name; else every thread
    of the process."""


@dataclass(frozen=True)
class Usage:
    """What one device's memory did while one test ran."""

    device: str
    """The device measured, as :attr:`Limit.device`."""
    start_bytes: int
    """Bytes in use when the measurement started."""
    peak_bytes: int
    """The highest bytes in use during it (absolute, not a rise)."""
    end_bytes: int
    """Bytes in use when it ended (after ``gc.collect()`` for a ``limit_leaks`` test)."""
    exact: bool = True
    """False where the peak comes from sampling (process RAM off Linux)."""

    @property
    def rise(self) -> int:
        """How far the peak rose above the start, in bytes (0 if it never did)."""
        return max(self.peak_bytes - self.start_bytes, 0)

    @property
    def kept(self) -> int:
        """How many more bytes were in use at the end than at the start (0 if fewer)."""
        return max(self.end_bytes - self.start_bytes, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "start_bytes": self.start_bytes,
            "peak_bytes": self.peak_bytes,
            "end_bytes": self.end_bytes,
            "exact": self.exact,
        }


@dataclass(frozen=True)
class Elsewhere:
    """Bytes alive at a test's peak that another thread than the test's allocated."""

    threads: tuple[str, ...]
    """The names of the live threads that run the code that allocated them (several where
    threads run the same function); empty where none does any longer."""
    bytes: int
    """The bytes, in bytes."""


@dataclass(frozen=True)
class Origin:
    """A source line that allocated tensors that stayed after a test."""

    file: str
    line: int
    function: str
    """The function's qualified name, ``<module>`` for a module's top level."""
    code: str
    """The line's source text, stripped (empty where the source cannot be read)."""
    bytes: int
    """Bytes of the tensors allocated there that stayed."""


@dataclass(frozen=True)
class Verdict:
    """A limit held against what a test did."""

    limit: Limit
    usage: Usage
    """The measurement the limit was judged by."""
    peak: DeviceRun | None = None
    """For a ``limit_memory`` test over its limit: the recording of the device (lines,
    largest allocations and categories at the peak); None where nothing was recorded."""
    modules: tuple[ModulePeak, ...] = ()
    """The modules that ran, with their peaks, from the same recording."""
    elsewhere: tuple[Elsewhere, ...] = ()
    """For a ``limit_memory`` test over its limit that counts every thread: what other
    threads allocated and held at the peak, by the code they run, largest first."""
    stayed: tuple[TensorRecord, ...] = ()
    """For a ``limit_leaks`` test over its limit: the tensors on the device alive after the
    test that were not alive before it; one the recording saw allocated is named after
    its line (``Tensor@test_model.py:21``)."""
    origins: tuple[Origin, ...] = ()
    """The lines that allocated :attr:`stayed`, largest first, where the recording knows
    them."""
    growth: Growth | None = None
    """For a ``limit_leaks`` test over its limit whose memory rose at the end of each
    training step (:attr:`~torchmem.records.run.DeviceRun.growth`): by how much, from which
    lines, and why."""

    @property
    def measured_bytes(self) -> int:
        """What the limit is held against: the rise of the peak (``limit_memory``) or the
        bytes kept (``limit_leaks``)."""
        return self.usage.rise if self.limit.kind == "limit_memory" else self.usage.kept

    @property
    def passed(self) -> bool:
        return self.measured_bytes <= self.limit.limit_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "marker": self.limit.kind,
            "device": self.limit.device,
            "limit_bytes": self.limit.limit_bytes,
            "measured_bytes": self.measured_bytes,
            "setup": self.limit.setup,
            "current_thread_only": self.limit.current_thread_only,
            "passed": self.passed,
        }
