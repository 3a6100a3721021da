"""Real values beside the estimator's fake run: small integer and boolean tensors made by
``torch.randint``, ``torch.arange``, ``torch.tensor`` and what is computed from them alone
are computed for real on the CPU too, so that a value that decides a shape (a batch
sliced at random offsets) is the real one, and one that is not known stops the run
instead of being guessed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from torchmem._compat import getframe
from torchmem._compat.fake import FakeTensor, no_dispatch_modes, op_schema
from torchmem.errors import UnknownValue
from torchmem.records.frames import choose, kind, own_file

VALUES_NUMEL = 1 << 16
"""Most elements of an integer or boolean tensor whose real values the estimator keeps,
computed on the CPU beside its fake run (batch offsets drawn with ``torch.randint``, and
what is computed from them)."""


def _small_integers(tensor: Any) -> bool:
    if not isinstance(tensor, torch.Tensor) or not isinstance(tensor, FakeTensor):
        return False
    dtype = tensor.dtype
    return not (dtype.is_floating_point or dtype.is_complex) and tensor.numel() <= VALUES_NUMEL


def _masks(values: Values, func: Any, args: tuple[Any, ...]) -> list[tuple[int, int]]:
    """Of each boolean mask that ``tensor[indices]`` (`func`, `args`) indexes with: how
    many positions it selects, and its dimensions."""
    if func is not torch.ops.aten.index.Tensor:
        return []
    found = [values.value(i) for i in args[1] if i is not None]
    with no_dispatch_modes():
        return [
            (int(v.count_nonzero()), v.dim())
            for v in found
            if v is not None and v.dtype in (torch.bool, torch.uint8)
        ]


class Values:
    """The real values known of a fake run's tensors."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        """``id()`` of fake integer and boolean tensors of at most :data:`VALUES_NUMEL`
        elements -> their values, a real CPU tensor: made by a factory (``randint``,
        ``arange``) or an operator on such tensors, numbers and real tensors, run for real
        beside the fake run (random ones on the real generator, whose state the estimate
        restores)."""

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real values of `tensor` where they are known: a real tensor's own, a fake
        one's kept (or the constant fake tensors keep themselves); else None."""
        if not isinstance(tensor, FakeTensor):
            return tensor
        found = self.known.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        return getattr(tensor, "constant", None)

    def keep(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        key = id(tensor)
        # Forgotten when the fake tensor goes (a weak key: a tensor's == is elementwise).
        self.known[key] = (weakref.ref(tensor, lambda _: self.known.pop(key, None)), value)

    def compute(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Keep the real values of `out` where it is small, of integers or booleans, and
        every tensor `func` reads has known values."""
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not outs or not all(_small_integers(t) for t in outs):
            return
        if op_schema(func).is_mutable:  # an in-place change: known values no longer are
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, FakeTensor):
                    self.known.pop(id(arg), None)
            return
        computed = self.run(func, args, kwargs)
        values = computed if isinstance(computed, (tuple, list)) else (computed,)
        for fake, value in zip(outs, values, strict=False):
            if isinstance(value, torch.Tensor) and value.shape == fake.shape:
                self.keep(fake, value)

    def spread(self, func: Any, args: tuple[Any, ...], out: Any) -> bool:
        """Whether `out`, the ``(values, indices)`` of ``topk`` on values not known (a
        mixture of experts' router), had its indices taken as spread evenly: row r picks
        candidates ``r * k``, ..., ``r * k + k - 1`` (modulo their number), so that each
        candidate is picked as often as the others."""
        if func is not torch.ops.aten.topk.default or self.value(args[0]) is not None:
            return False
        indices = out[1]
        if indices.numel() > VALUES_NUMEL or not indices.dim():
            return False
        dim = (args[2] if len(args) > 2 else -1) % indices.dim()
        k, candidates = indices.shape[dim], args[0].shape[dim]
        shape = [*indices.shape[:dim], *indices.shape[dim + 1 :], k]
        with no_dispatch_modes():
            rows = torch.arange(indices.numel() // max(k, 1))[:, None] * k
            chosen = (rows + torch.arange(k)) % max(candidates, 1)
            self.keep(indices, chosen.reshape(shape).movedim(-1, dim).contiguous())
        return True

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`func` run for real, on the CPU, on the values of its tensors; None where one
        is not known (or the CPU refuses the call)."""
        real: list[Any] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                arg = self.value(arg)
                if arg is None:
                    return None
            elif isinstance(arg, (list, tuple)) and any(isinstance(a, torch.Tensor) for a in arg):
                known = [self.value(a) if isinstance(a, torch.Tensor) else a for a in arg]
                if any(a is None for a in known):
                    return None
                arg = type(arg)(known)
            real.append(arg)
        options = dict(kwargs)
        if "device" in options:
            options["device"] = torch.device("cpu")
        if any(isinstance(v, torch.Tensor) for v in options.values()):
            return None
        try:
            with no_dispatch_modes():
                return func(*real, **options)
        except Exception:  # an operator the CPU does not run as asked: values stay unknown
            return None

    def shaped(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The result of `func`, whose shape depends on values (``nonzero``, a boolean
        mask), made as a fake tensor (an allocation the run counts) from the real result
        on known values; else :class:`UnknownValue` naming the user's line."""
        real = self.run(func, args, kwargs)
        if real is None and func is torch.ops.aten.index.Tensor:
            real = self._index(*args)
        if not isinstance(real, torch.Tensor):
            raise UnknownValue(
                f"{user_line()}: {func} cannot run on fake tensors: its output's shape"
                " depends on the values of a tensor, which the estimate does not know"
                " (it knows small integer tensors made by torch.randint, torch.arange,"
                " torch.tensor and what is computed from them alone). Give the shape a"
                " fixed size (e.g. a mask multiplied in instead of indexed with)."
            )
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        # Indexing with a mask first lists the positions it selects, as nonzero does.
        positions = [
            torch.empty(count, dims, dtype=torch.long, device=device)
            for count, dims in _masks(self, func, args)
        ]
        out = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        del positions
        if _small_integers(out) and not real.is_meta:
            self.keep(out, real)
        return out

    def _index(self, tensor: torch.Tensor, indices: list[torch.Tensor | None]) -> Any:
        """``tensor[indices]`` as a meta tensor, of the real shape, where the indices'
        values are known (the indexed tensor's never decide the shape); else None."""
        known: list[torch.Tensor | None] = []
        for index in indices:
            value = None if index is None else self.value(index)
            if index is not None and value is None:
                return None
            known.append(value)
        with no_dispatch_modes():
            meta = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
            )
            spread: list[torch.Tensor | None] = []
            for value in known:  # a mask becomes the positions it selects, one per dim
                if value is not None and value.dtype in (torch.bool, torch.uint8):
                    spread.extend(value.nonzero().unbind(1))
                else:
                    spread.append(value)
            return torch.ops.aten.index.Tensor(meta, spread)

    def index(self, tensor: torch.Tensor) -> int:
        """``tensor.__index__()`` on a fake tensor: its real value, or :class:`UnknownValue`
        naming the user's line."""
        value = self.value(tensor)
        if value is not None and value.numel() == 1:
            with no_dispatch_modes():
                return int(value.item())
        raise UnknownValue(
            f"{user_line()}: a tensor's value is used here as an index or a size, and the"
            " estimate does not know it (a guess of 1 would make a wrong shape, an empty"
            " slice say). The estimate knows the values of small integer tensors made by"
            " torch.randint, torch.arange, torch.tensor and what is computed from them"
            " alone; use one of those, or a Python number."
        )


def user_line() -> str:
    """``file:line`` of the innermost frame of the user's code (or the innermost one)."""
    chosen = choose(
        (kind(f.f_code.co_filename, f.f_code.co_name), f)
        for f in _frames(getframe(1))
        if not own_file(f.f_code.co_filename)
    )
    if chosen is None:
        return "<unknown line>"
    return f"{chosen[1].f_code.co_filename}:{chosen[1].f_lineno}"


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


@contextlib.contextmanager
def values_read(values: Values) -> Iterator[None]:
    """Fake tensors used as an index (``data[i : i + n]``) give their real values or stop
    the run (:meth:`Values.index`); a 0-d one formats as its value
    (``f"{loss:.4f}"``), known or taken as 1. Undone at the end."""
    saved = FakeTensor.__dict__.get("__index__"), FakeTensor.__dict__.get("__format__")

    def format_(tensor: torch.Tensor, spec: str) -> str:
        if tensor.dim() == 0:
            return format(tensor.detach().item(), spec)
        return object.__format__(tensor, spec)

    def index(tensor: torch.Tensor) -> int:
        return values.index(tensor)

    setattr(FakeTensor, "__index__", index)  # noqa: B010 (a class of PyTorch's, typed `type`)
    setattr(FakeTensor, "__format__", format_)  # noqa: B010
    try:
        yield
    finally:
        for name, method in zip(("__index__", "__format__"), saved, strict=True):
            if method is None:
                delattr(FakeTensor, name)
            else:
                setattr(FakeTensor, name, method)
