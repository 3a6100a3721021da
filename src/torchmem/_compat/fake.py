"""PyTorch's private parts the estimator needs: fake tensors and operators' schemas, each
looked up once with a stand-in that names what is missing (see :mod:`torchmem._compat`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchmem._compat import backward_node, lookup, unsupported

_FAKE = "torch._subclasses.fake_tensor"
_ESTIMATOR = "Estimating memory"
_FAKE_MODE = lookup(f"{_FAKE}.FakeTensorMode")
_DATA_DEPENDENT: tuple[type[BaseException], ...] = tuple(
    kind
    for kind in (
        lookup(f"{_FAKE}.DataDependentOutputException"),
        lookup(f"{_FAKE}.DynamicOutputShapeException"),
    )
    if kind is not None
)
"""Errors fake tensors raise for an operator whose result depends on tensor values; each
carries the operator as ``func``."""


FakeTensor: type = lookup(f"{_FAKE}.FakeTensor") or type("FakeTensor", (), {})  # or: none is
_NO_MODES = "torch.utils._python_dispatch._disable_current_modes"
no_dispatch_modes: Callable[[], Any] = lookup(_NO_MODES) or unsupported(_NO_MODES, _ESTIMATOR)
"""Every dispatch mode (fake tensors' too) set aside while entered: operators run for real."""


def fake_mode() -> Any:
    """A new ``FakeTensorMode``: tensors made inside it have shapes, dtypes and devices but
    no memory, and operators on them compute only those."""
    if _FAKE_MODE is None:
        unsupported(f"{_FAKE}.FakeTensorMode", _ESTIMATOR)()
    return _FAKE_MODE()


def data_dependent_operator(error: BaseException) -> Any:
    """The operator a fake tensor could not run because its result depends on tensor values
    (``nonzero``), or None if `error` is something else."""
    return getattr(error, "func", None) if isinstance(error, _DATA_DEPENDENT) else None


def forget_converted(mode: Any) -> None:
    """Drop `mode`'s weak references to the fake tensors it made from real ones (PyTorch's
    parameter initialisers make some): ``module.to()`` swaps a fake parameter with its
    converted self, which fails while a weak reference to it exists."""
    converter = getattr(mode, "fake_tensor_converter", None)
    memo = getattr(getattr(converter, "meta_converter", None), "tensor_memo", None)
    if memo is not None:
        memo.clear()


def mark_fake_device(tensor: Any, device: torch.device) -> None:
    """Make fake `tensor` answer ``tensor.device`` with this very `device` object (an equal
    one does not do: the estimator tells GPU storages by the object's identity)."""
    if hasattr(tensor, "fake_device"):
        tensor.fake_device = device


def op_schema(op: Any) -> Any:
    """The schema of operator `op` (a ``torch.ops`` overload): its ``arguments``, whether
    it ``is_mutable``."""
    return op._schema


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of, None where it is not a view."""
    return tensor._base


def backward_operator() -> tuple[str, int] | None:
    """The name and sequence number of the autograd node whose backward formula runs in
    this thread now (``("IndexBackward0", 12)``); None outside a backward pass."""
    node = backward_node()
    if node is None:
        return None
    return node.name(), node._sequence_nr()
