"""The out-of-memory explainer's records: what ran out, what holds memory, what to try."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchmem.records.tensors import TensorRecord

HintKind = Literal["request_too_large", "fragmentation", "smaller_batch", "autograd_history"]


@dataclass(frozen=True)
class Hint:
    """One thing to try after an out-of-memory error, and the figure it rests on."""

    kind: HintKind
    """``"request_too_large"``: the request alone exceeds the device; ``"fragmentation"``:
    much of what the caching allocator reserved is unallocated; ``"smaller_batch"``;
    ``"autograd_history"``: tensors with autograd history keep memory for backward."""
    nbytes: int | None = None
    """The bytes behind it: the request, the reserved-but-unallocated bytes, or the bytes
    in tensors with autograd history; None for ``"smaller_batch"``."""


@dataclass(frozen=True)
class OOMRecord:
    """What :func:`torchmem.explain_oom` found. Sizes in bytes; ``None`` where not known."""

    device: str
    """The device that ran out: ``"cuda:0"``, ``"mps"``, ``"cpu"``."""
    requested: int | None
    """The bytes the failed allocation asked for, as the error message says."""
    total: int | None
    """The device's memory (for ``"cpu"``, the machine's RAM)."""
    free: int | None
    """What the device has free now, for all processes (for ``"cpu"``, available RAM)."""
    allocated: int | None
    """Bytes in tensors, by PyTorch's caching allocator (GPUs only)."""
    reserved: int | None
    """Bytes the caching allocator holds, in tensors or cached (GPUs only)."""
    largest: tuple[TensorRecord, ...]
    """The largest live tensors on the device, biggest first, named as
    :class:`torchmem.MemReporter` names them; each storage once."""
    history: int
    """Bytes of live tensors on the device that carry autograd history (a ``grad_fn``):
    they keep what backward needs alive."""
    hints: tuple[Hint, ...]
    """What to try, following from the numbers above, most specific first."""
    notes: tuple[str, ...] = ()
    """What the report could not find out, one sentence each: tensors whose memory could
    not be read, for instance."""
