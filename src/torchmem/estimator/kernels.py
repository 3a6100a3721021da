"""What real kernels allocate that the fake run's do not, and where a backward formula
takes another path on fake tensors than on real ones.

The fake run sees each operator as it reaches PyTorch's dispatcher, and a fake kernel
makes only the operator's results. A real run differs where:

- **a Python number stands for a tensor.** ``x / 2.0`` gives an operator that takes a
  tensor a number: PyTorch makes it a 0-dim CPU tensor first (a double or an int64: 8
  bytes; a bool: 1), where no dispatcher sees it, and frees it when the call returns,
  unless autograd keeps it for the backward pass (``x * 0.5`` keeps 0.5 until the
  gradient of ``x`` is computed). A ``Scalar`` overload of an elementwise operator
  (``mul.Scalar``, as backward formulas call them) makes the same tensor in its kernel.
- **a CPU kernel casts its operands.** An elementwise operator on the CPU (``+``, ``*``,
  ``/``, comparisons, ``where``, ...; :func:`elementwise`) first copies each operand whose
  dtype is not the operands' common one into that dtype, for the length of the call: the
  number above (4 bytes more for a float32 tensor, 12 in all: what Adam's step adds at
  its peak), a bool mask multiplied into a float32 tensor (4 bytes an element). ``mean``
  divides its sum by the count, a number made a tensor and cast (12 bytes for float32).
  A copy of a transposed matrix into a contiguous one (a weight's gradient into
  ``.grad``) goes through a block buffer of 60 x 60 elements. GPU kernels read numbers
  and operands of other dtypes as they are.
- **a backward formula branches on the kind of tensor.** Some of PyTorch's backward
  formulas write into a new zeroed tensor in place for real tensors, and make another
  tensor instead for tensors of a subclass or under a dispatch mode, as the fake run's are
  (``x[indices]``'s: a second tensor as large as ``x``). Those in :data:`IN_PLACE` run in
  place here, as on real tensors, on the CPU and on a GPU alike.

:class:`Kernels` logs the first two in the run's log, as made and freed where the real
ones are.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from torchmem._compat.fake import FakeTensor, backward_operator, op_schema

aten = torch.ops.aten

_NUMBER_DTYPES = ((bool, torch.bool), (int, torch.int64), (float, torch.float64))
"""The dtype of the tensor PyTorch makes of a Python number (a bool is an int: first)."""
_NUMBERS = frozenset(kind for kind, _ in _NUMBER_DTYPES)
_OPERANDS = ("self", "other", "scalar", "scalars", "exponent")
"""The arguments an elementwise operator computes with (not ``alpha``, nor ``where``'s
``condition``)."""


def _packets(*names: str) -> frozenset[Any]:
    found = (getattr(aten, name + end, None) for name in names for end in ("", "_"))
    return frozenset(packet for packet in found if packet is not None)


_ELEMENTWISE = _packets(
    *("add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod"),
    *("eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "fmax", "fmin"),
    *("atan2", "hypot", "xlogy", "copysign", "logical_and", "logical_or", "logical_xor"),
    *("bitwise_and", "bitwise_or", "bitwise_xor"),
    *("_foreach_add", "_foreach_sub", "_foreach_mul", "_foreach_div"),
)
"""Operators whose CPU kernel casts every operand to the common dtype, each overload but
``out=`` (``_foreach_`` ones: one tensor of the list at a time)."""
_ELEMENTWISE_OVERLOADS = frozenset(
    (aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.pow_.Tensor, aten.where.self)
) | {aten._foreach_pow.ScalarAndTensor}
"""The same, for operators with other overloads (``x ** 2``: the exponent stays a number)."""
_MEANS = frozenset((aten.mean.default, aten.mean.dim))
_COPIES = frozenset((aten.copy_.default, aten.clone.default, aten._to_copy.default))
_BLOCK = 60
"""The side of the square block through which the CPU copies a transposed matrix (120 for
uint8): ``copy_same_type_transpose_``, for matrices of at least 60 x 60 elements."""


@functools.cache
def elementwise(func: Any) -> bool:
    """Whether the CPU kernel of operator `func` casts its operands to their common dtype."""
    if func in _ELEMENTWISE_OVERLOADS:
        return True
    return func.overloadpacket in _ELEMENTWISE and "out" not in op_schema(func).overload_name


def number_dtype(value: object) -> torch.dtype | None:
    """The dtype of the tensor PyTorch makes of `value`, where it is a Python number."""
    for kind, dtype in _NUMBER_DTYPES:
        if isinstance(value, kind):
            return dtype
    return None


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """``(schema argument, value)`` of each argument given to `func`."""
    arguments = op_schema(func).arguments
    yield from zip(arguments, args, strict=False)
    named = {argument.name: argument for argument in arguments}
    yield from ((named[name], value) for name, value in kwargs.items() if name in named)


def promoted(operands: list[Any], out: Any) -> int:
    """Bytes an elementwise CPU kernel makes for `operands` (tensors and Python numbers)
    besides its result `out`: a tensor of each number, and a copy of each operand whose
    dtype is not the common one (`out`'s; the operands' where `out` is a comparison's)."""
    tensors = [o for o in operands if isinstance(o, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or len(operands) != 2 or not tensors:
        return 0
    common = out.dtype if out.dtype is not torch.bool else torch.result_type(*operands)
    total = 0
    for operand in operands:
        dtype = operand.dtype if isinstance(operand, torch.Tensor) else number_dtype(operand)
        if dtype is None:
            continue
        if not isinstance(operand, torch.Tensor):
            total += dtype.itemsize
        if dtype != common:
            total += (operand.numel() if isinstance(operand, torch.Tensor) else 1) * common.itemsize
    return total


def _rows(operands: list[Any], out: Any) -> Iterator[tuple[list[Any], Any]]:
    """The operands and result of each step of a ``_foreach_`` operator: a list gives its
    i-th element to step i, anything else is given to every step; an in-place one's
    results are its first list."""
    lists = [o for o in operands if isinstance(o, (list, tuple))]
    results = out if isinstance(out, (list, tuple)) and out else lists[0]
    for i, result in enumerate(results):
        yield [o[i] if isinstance(o, (list, tuple)) else o for o in operands], result


def temporaries(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes the CPU kernel of `func` makes and frees besides `out`, beyond what its fake
    kernel makes: the numbers it makes tensors and the casts of its operands (the largest
    step's, for a ``_foreach_`` operator); ``mean``'s count. A Python number given for a
    tensor is not counted: it is made before the call (:class:`Kernels`)."""
    if func in _COPIES:
        copy = func is aten.copy_.default
        return transposed_copy(args[0] if copy else out, args[1] if copy else args[0])
    if func in _MEANS:
        dtype = out.dtype if isinstance(out, torch.Tensor) else None
        mean = dtype in (torch.float32, torch.float64) and args[0].dtype == dtype
        return 8 + dtype.itemsize if mean and dtype is not None else 0
    if not elementwise(func):
        return 0
    bound = list(_bound(func, args, kwargs))
    operands = [value for argument, value in bound if argument.name in _OPERANDS]
    if any(isinstance(o, (list, tuple)) for o in operands):
        return max((promoted(row, result) for row, result in _rows(operands, out)), default=0)
    made = sum(dtype.itemsize for _, dtype in tensor_numbers(bound))
    return max(promoted(operands, out) - made, 0)


def transposed_copy(target: Any, source: Any) -> int:
    """Bytes of the block buffer a CPU copy of `source` into contiguous `target` of its
    dtype makes, where `source` is a transposed contiguous matrix (a weight's gradient
    computed as a product's transpose, copied into ``.grad``); else 0."""
    if not (isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor)):
        return 0
    transposed = source.dim() == 2 and source.stride() == (1, source.shape[0])
    alike = target.dtype == source.dtype and target.shape == source.shape
    signs = target.is_neg() == source.is_neg() and target.is_conj() == source.is_conj()
    if not (transposed and alike and signs and target.is_contiguous()):
        return 0
    if target.numel() < _BLOCK * _BLOCK:
        return 0
    side = 2 * _BLOCK if target.dtype is torch.uint8 else _BLOCK
    return side * side * target.dtype.itemsize


def tensor_numbers(bound: list[tuple[Any, Any]]) -> list[tuple[str, torch.dtype]]:
    """The name and dtype of each Python number among `bound` arguments given where the
    operator takes a tensor (``x / 2.0``'s 2.0)."""
    found = []
    for argument, value in bound:
        dtype = number_dtype(value)
        if dtype is not None and str(argument.type) == "Tensor":
            found.append((argument.name, dtype))
    return found


_Swap = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _index_put(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Swap:
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    return aten._index_put_impl_.default, (*args[:3], accumulate, True), {}


def _same(op: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], _Swap]:
    return lambda args, kwargs: (op, args, kwargs)


_SCATTER = {aten.scatter.src: _same(aten.scatter_.src)}
"""``value_selecting_reduction_backward``: ``max(dim)``, ``sort``, ``topk``, ... ."""
IN_PLACE: dict[str, dict[Any, Any]] = {
    "IndexBackward0": {aten.index_put.default: _index_put},
    "IndexSelectBackward0": {aten.index_add.default: _same(aten.index_add_.default)},
    "GatherBackward0": {aten.scatter_add.default: _same(aten.scatter_add_.default)},
    "CummaxBackward0": {aten.scatter_add.default: _same(aten.scatter_add_.default)},
    "CumminBackward0": {aten.scatter_add.default: _same(aten.scatter_add_.default)},
    **dict.fromkeys(
        ("MaxBackward0", "MinBackward0", "KthvalueBackward0", "MedianBackward1"),
        _SCATTER,
    ),
    **dict.fromkeys(
        ("NanmedianBackward1", "ModeBackward0", "SortBackward0", "SortBackward1"), _SCATTER
    ),
    "TopkBackward0": _SCATTER,
    "BinaryCrossEntropyWithLogitsBackward0": {
        aten.sub.Tensor: _same(aten.sub_.Tensor),
        aten.mul.Tensor: _same(aten.mul_.Tensor),
    },
}
"""Backward formulas (by their node's name) that run an operator in place on a tensor
they made, for real tensors, and out of place for fake ones: the operator, and what
real tensors run instead (``(operator, args, kwargs)`` of ``(args, kwargs)``). The
binary cross-entropy's runs in place only where no graph of the backward pass is made."""


class Ledger(Protocol):
    """Where :class:`Kernels` logs what it counts (the fake run's meter)."""

    def made(self, nbytes: int) -> int:
        """Log `nbytes` made now by no operator; the key to free them by."""

    def freed(self, key: int, nbytes: int) -> None:
        """Log the `nbytes` made under `key` freed now."""


class Kernels:
    """Per fake run: logs, in `ledger`, what real CPU kernels make beyond the fake ones'
    results, and runs the backward formulas of :data:`IN_PLACE` in place."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._pending: list[tuple[Any, list[tuple[str, int, int]]]] = []
        """Each operator's output (weakly) and the numbers given to it for tensors:
        ``(argument name, key, bytes)``, until the next operator."""
        self._node: tuple[str, int] | None = None
        self._fresh: dict[int, weakref.ref[torch.Tensor]] = {}
        self._listed = False
        """Whether the operator running now is one of a backward formula of IN_PLACE's."""
        self._backward = False
        """Whether the operator running now is one of a backward pass."""

    def in_place(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Swap | None:
        """``(operator, args, kwargs)`` to run instead of `func` on `args`, where a backward
        formula of :data:`IN_PLACE` would run it in place on real tensors; else None."""
        node = backward_operator()
        self._backward = node is not None
        swaps = IN_PLACE.get(node[0]) if node is not None else None
        self._listed = swaps is not None
        if node is None or swaps is None:
            return None
        if node != self._node:
            self._node, self._fresh = node, {}
        swap = swaps.get(func)
        made = self._fresh.get(id(args[0])) if args else None
        if swap is None or made is None or made() is not args[0]:
            return None
        if node[0].startswith("BinaryCrossEntropy") and torch.is_grad_enabled():
            return None
        swapped: _Swap = swap(args, kwargs)
        return swapped

    def settle(self) -> None:
        """Free the tensors made of the numbers given to the operator before, except those
        autograd keeps for the backward pass: each lives as long as autograd's own."""
        pending, self._pending = self._pending, []
        for ref, numbers in pending:
            out = ref() if ref is not None else None
            node = getattr(out, "grad_fn", None)
            for name, key, nbytes in numbers:
                saved = getattr(node, f"_saved_{name}", None) if node is not None else None
                if isinstance(saved, torch.Tensor) and not isinstance(saved, FakeTensor):
                    weakref.finalize(saved.untyped_storage(), self._ledger.freed, key, nbytes)
                else:
                    self._ledger.freed(key, nbytes)

    def after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Log what the real CPU kernel of `func` made beyond its result `out`: a tensor of
        each number given for a tensor (freed at the next operator, :meth:`settle`), and
        its temporaries, made and freed. After :meth:`in_place` for the same operator."""
        # A backward formula gives the tensors autograd kept (MulBackward0's 0.5): not new.
        given = () if self._backward else (*args, *kwargs.values())
        if any(type(value) in _NUMBERS for value in given):
            numbers = tensor_numbers(list(_bound(func, args, kwargs)))
            if numbers:
                first = next(iter(_tensors(out)), None)
                made = [
                    (name, self._ledger.made(dtype.itemsize), dtype.itemsize)
                    for name, dtype in numbers
                ]
                self._pending.append((None if first is None else weakref.ref(first), made))
        nbytes = temporaries(func, args, kwargs, out)
        if nbytes:
            self._ledger.freed(self._ledger.made(nbytes), nbytes)

    def made_by(self, out: Any) -> None:
        """Note the tensors of `out`, made by the operator running now, where it is one of
        a backward formula of :data:`IN_PLACE`'s."""
        if self._listed:
            self._fresh.update((id(t), weakref.ref(t)) for t in _tensors(out))


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors among an operator's results `out`."""
    values = out if isinstance(out, (list, tuple)) else (out,)
    return [value for value in values if isinstance(value, torch.Tensor)]
