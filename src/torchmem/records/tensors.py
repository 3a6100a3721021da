"""The memory reporter's record: one live tensor as one report saw it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorRecord:
    """One live tensor, as one report saw it."""

    name: str
    """Parameter or buffer name(s) joined with ``+``, ``<name>.grad``,
    ``<Optimizer>.<param>.<state key>``, or ``Tensor<n>`` / ``Parameter<n>``: numbered
    afresh in each report from 0, with no gaps, in the order the report prints them,
    tensors that share a storage listed before them (shown with ``verbose``) last."""
    device: str
    """``str(tensor.device)``: ``"cpu"``, ``"cuda:0"``, ``"meta"``."""
    shape: tuple[int | str, ...] | None
    """``tuple(tensor.size())``, ``()`` for a 0-d tensor (a symbolic size as text, e.g. a
    jagged ``"j1"``); None where the tensor has no single size (a strided nested
    tensor)."""
    dtype: str
    """``str(tensor.dtype)``, e.g. ``"torch.float32"``."""
    layout: str
    """``str(tensor.layout)``, e.g. ``"torch.strided"``, ``"torch.sparse_csr"``."""
    kind: str
    """The tensor's class name: ``"Tensor"``, ``"Parameter"``, a subclass's name."""
    numel: int
    """Elements held: ``numel()``; for a sparse tensor, the elements of its index and
    value tensors."""
    nbytes: int
    """Bytes counted for this tensor, in bytes: its storages that no tensor listed
    before it holds (rounded up to 512 each on CUDA); 0 when it shares them all, or on
    ``meta``."""
    owner: str | None = None
    """Name of the tensor counted for this tensor's storage, when it shares it."""
    note: str | None = None
    """Why the tensor could not be sized (its ``nbytes`` is then 0); None when it was."""
    tensor: Callable[[], torch.Tensor | None] | None = field(
        default=None, repr=False, compare=False
    )
    """A weak reference to the tensor itself (None if it takes none), for
    :func:`torchmem.diff`."""
