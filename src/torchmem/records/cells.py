"""The cell logger's records: what one notebook cell used and peaked, in bytes, and the
same in ipygpulogger's units (``Data``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torchmem.records.run import Growth
from torchmem.units import b2mb


class Data(NamedTuple):
    """The last cell's figures as ipygpulogger gives them: memory in whole MB (MiB,
    truncated like ``b2mb``), ``time_delta`` in seconds. Unpacks into 7 values."""

    gen_mem_used_delta: int
    gen_mem_peaked: int
    gen_mem_used: int
    gpu_mem_used_delta: int
    gpu_mem_peaked: int
    gpu_mem_used: int
    time_delta: float


@dataclass(frozen=True)
class CellRecord:
    """What one cell used, in bytes and seconds."""

    execution_count: int | None
    """The cell's number, ``In [n]``; None for a cell IPython gave no number."""
    gen_used_delta: int
    """Process resident memory (RSS) after the cell minus before it, bytes."""
    gen_peaked: int
    """How far RSS rose during the cell above both its start and its end, bytes; never
    negative."""
    gen_used: int
    """RSS after the cell, bytes."""
    gpu_used_delta: int
    """Bytes of GPU tensors (the caching allocator's allocated bytes) after the cell minus
    before it; CPU tensor bytes where :attr:`gpu_device` is ``"cpu"``."""
    gpu_peaked: int
    """How far those bytes rose during the cell above both its start and its end."""
    gpu_used: int
    """Used memory of the whole GPU after the cell, every process included (what
    ``nvidia-smi`` shows), bytes; bytes of live CPU tensors where there is no GPU."""
    time_delta: float
    """Seconds the cell ran."""
    gpu_device: str
    """What the second row measured: ``"cuda:0"``, ... or ``"cpu"`` (CPU tensors)."""
    failed: bool = False
    """True when the cell raised (or did not compile)."""
    growth: Growth | None = None
    """Where the cell ran training steps and the memory of the second row's device rose at
    the end of each: by how much, from which lines, and why (a logger with ``steps=True``
    only); else None."""

    def data(self) -> Data:
        """These figures in ipygpulogger's units: whole MB and seconds."""
        return Data(
            b2mb(self.gen_used_delta),
            b2mb(self.gen_peaked),
            b2mb(self.gen_used),
            b2mb(self.gpu_used_delta),
            b2mb(self.gpu_peaked),
            b2mb(self.gpu_used),
            self.time_delta,
        )
