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

from torchmem._compat import FakeTensor, getframe, no_dispatch_modes
from torchmem.records.frames import choose, kind, own_file

VALUES_NUMEL = 1 << 16
"""Most elements of an integer or boolean tensor whose real values the estimator keeps,
computed on the CPU beside its fake run (batch offsets drawn with ``torch.randint``, and
what is computed from them)."""


class UnknownIndex(Exception):
    """A value fake tensors do not know is used as an index or a size: guessing it would
    give a wrong shape (an empty slice) in silence."""


def _small_integers(tensor: Any) -> bool:
    if not isinstance(tensor, torch.Tensor) or not isinstance(tensor, FakeTensor):
        return False
    dtype = tensor.dtype
    return not (dtype.is_floating_point or dtype.is_complex) and tensor.numel() <= VALUES_NUMEL


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
        if func._schema.is_mutable:  # an in-place change: known values no longer are
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, FakeTensor):
                    self.known.pop(id(arg), None)
            return
        real: list[Any] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                arg = self.value(arg)
                if arg is None:
                    return
            elif isinstance(arg, (list, tuple)) and any(isinstance(a, torch.Tensor) for a in arg):
                known = [self.value(a) if isinstance(a, torch.Tensor) else a for a in arg]
                if any(a is None for a in known):
                    return
                arg = type(arg)(known)
            real.append(arg)
        options = dict(kwargs)
        if "device" in options:
            options["device"] = torch.device("cpu")
        if any(isinstance(v, torch.Tensor) for v in options.values()):
            return
        try:
            with no_dispatch_modes():
                computed = func(*real, **options)
        except Exception:  # an operator the CPU does not run as asked: values stay unknown
            return
        values = computed if isinstance(computed, (tuple, list)) else (computed,)
        for fake, value in zip(outs, values, strict=False):
            if isinstance(value, torch.Tensor) and value.shape == fake.shape:
                self.keep(fake, value)

    def index(self, tensor: torch.Tensor) -> int:
        """``tensor.__index__()`` on a fake tensor: its real value, or :class:`UnknownIndex`
        naming the user's line."""
        value = self.value(tensor)
        if value is not None and value.numel() == 1:
            with no_dispatch_modes():
                return int(value.item())
        raise UnknownIndex(
            f"{_user_line()}: a tensor's value is used here as an index or a size, and the"
            " estimate does not know it (a guess of 1 would make a wrong shape, an empty"
            " slice say). The estimate knows the values of small integer tensors made by"
            " torch.randint, torch.arange, torch.tensor and what is computed from them"
            " alone; use one of those, or a Python number."
        )


def _user_line() -> str:
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
