"""Explaining an out-of-memory error: what was asked, what holds the memory, what to try.

:func:`explain_oom` turns an out-of-memory error (CUDA, MPS or the CPU allocator) into an
:class:`OOMReport`; :func:`oom_guard` prints that report when such an error passes
through a block or a function, and re-raises the error unchanged. A report that cannot be
made or printed never takes the error's place: :func:`print_oom_report` warns instead.
"""

from __future__ import annotations

import contextlib
import re
import reprlib
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import TextIO, cast

import psutil
import torch

from torchmem._objects import holders, models_and_optimizers
from torchmem.errors import TorchmemWarning
from torchmem.records.oom import Hint, OOMRecord
from torchmem.records.tensors import TensorRecord
from torchmem.resolve import DeviceLike, parse_device, resolve_device
from torchmem.tensors import MemReporter
from torchmem.units import parse_size

_OOM_MESSAGES = ("out of memory", "can't allocate memory")  # CUDA and MPS; the CPU allocator
_TRIED = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)?\s*[KMGTP]?i?B)")
_TRIED_BYTES = re.compile(r"tried to allocate (\d+) bytes")
_GPU = re.compile(r"GPU (\d+)")
LARGEST = 5
"""How many of the largest live tensors a report lists."""
FRAGMENTED = 0.25
"""Reserved-but-unallocated memory above this share of what the allocator reserved
counts as fragmentation worth the expandable-segments hint."""


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error: ``torch.OutOfMemoryError``, or a ``RuntimeError`` /
    ``MemoryError`` whose message says so (MPS, the CPU allocator)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and any(
        text in message for text in _OOM_MESSAGES
    )


class OOMReport(OOMRecord):
    """What :func:`explain_oom` found (see :class:`~torchmem.records.oom.OOMRecord` for the
    fields); prints as the report."""

    def __str__(self) -> str:
        from torchmem.render import oom

        return oom.text(self)


def explain_oom(
    exc: BaseException,
    device: DeviceLike | None = None,
    *,
    model: torch.nn.Module | None = None,
    objects: Callable[[], Iterable[object]] | None = None,
) -> OOMReport:
    """Explain an out-of-memory error: the size asked for, the device's total and free
    memory, the allocator's allocated and reserved bytes, the largest live tensors, and
    what to try.

    Call it while the error's traceback is still alive (in the ``except`` block): the
    tensors its frames hold are often the ones that filled the device.

    Args:
        exc: the error, as caught.
        device: the device that ran out; by default read from the message (``"GPU 1"``
            means ``"cuda:1"``, the CPU allocator's message means ``"cpu"``).
        model: names the largest tensors after its parameters, as :class:`MemReporter`;
            by default the one outermost module found among `objects`, if there is one.
        objects: where to look for live tensors, models and optimizers, as for
            :class:`MemReporter`; by default every tensor, module and optimizer.

    Optimizers found among `objects` name their state (``Adam.fc1.weight.exp_avg``).
    Tensors whose memory cannot be read (where listing every live tensor fails, e.g. sparse
    CSR tensors inside ``torch.func.grad``) are left out, and the report says so.

    Raises:
        TypeError: naming the value, if `exc` is not an exception, `model` not a module or
            `objects` not callable.
        ValueError: naming the value, if `exc` is not an out-of-memory error (see
            :func:`is_oom`) or `device` is not a device of this machine.
    """
    _check_arguments(exc, model, objects)
    message = str(exc)
    # A device read from the message is named even where it is not visible here (a
    # message from another process, or from a log); a device given must be one of ours.
    where = resolve_device(device) if device is not None else parse_device(_device_of(message))
    requested = _requested(message)
    where, (total, free, allocated, reserved) = _memory(where)
    name = str(where)
    records, notes = _live_tensors(name, model, holders if objects is None else objects)
    counted = [r for r in records if r.nbytes]  # a view's bytes are its base's
    largest = tuple(sorted(counted, key=lambda r: r.nbytes, reverse=True)[:LARGEST])
    history = sum(r.nbytes for r in records if _has_history(r))
    hints = _hints(requested, total, allocated, reserved, history)
    return OOMReport(
        name, requested, total, free, allocated, reserved, largest, history, hints, notes
    )


def _memory(
    where: torch.device,
) -> tuple[torch.device, tuple[int | None, int | None, int | None, int | None]]:
    """Device `where` (a GPU's index filled in where it is visible here), and its total and
    free memory and its allocator's allocated and reserved bytes (None: not known here)."""
    total = free = allocated = reserved = None
    if where.type == "cuda" and torch.cuda.is_available():
        try:
            where = resolve_device(where)  # index-less: the current GPU
        except ValueError:  # not visible here: no allocator numbers, and no error of ours
            pass
        else:
            free, total = torch.cuda.mem_get_info(where)
            allocated = torch.cuda.memory_allocated(where)
            reserved = torch.cuda.memory_reserved(where)
    elif where.type == "cpu":
        ram = psutil.virtual_memory()
        total, free = ram.total, ram.available
    return where, (total, free, allocated, reserved)


def _check_arguments(exc: object, model: object, objects: object) -> None:
    if not isinstance(exc, BaseException):
        raise TypeError(f"explain_oom: exc must be the exception caught, not {_describe(exc)}")
    if not is_oom(exc):
        raise ValueError(
            f"explain_oom: {_describe(exc)} is not an out-of-memory error: expected"
            " torch.OutOfMemoryError, or a RuntimeError or MemoryError whose message says"
            " 'out of memory' or 'can't allocate memory'"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain_oom: model must be a torch.nn.Module, not {_describe(model)}")
    if objects is not None and not callable(objects):
        raise TypeError(
            "explain_oom: objects must be a function returning the objects to scan,"
            f" not {_describe(objects)}"
        )


def _describe(value: object) -> str:
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def _live_tensors(
    device: str, model: torch.nn.Module | None, objects: Callable[[], Iterable[object]]
) -> tuple[list[TensorRecord], tuple[str, ...]]:
    """The records of the live tensors on `device`, and notes on what could not be read.

    The report must come out whatever the process holds, so a walk that fails is tried
    again without the tensors most likely to fail (any but plain strided ones), and
    otherwise given up with a note.
    """
    try:
        return _snapshot(device, model, objects), ()
    except Exception as exc:
        failure = _first_line(exc)
    try:
        records = _snapshot(device, model, lambda: [o for o in objects() if _readable(o)])
    except Exception as exc:
        return [], (f"The live tensors could not be listed ({_first_line(exc)}).",)
    return records, (f"Tensors that could not be read are not listed ({failure}).",)


def _snapshot(
    device: str, model: torch.nn.Module | None, objects: Callable[[], Iterable[object]]
) -> list[TensorRecord]:
    roots, optimizers = models_and_optimizers(objects())
    if model is None and len(roots) == 1:
        model = roots[0]
    reporter = MemReporter(model, objects=objects)
    for optimizer in optimizers:
        reporter.add_optimizer(optimizer)
    return reporter.snapshot(device)


def _readable(obj: object) -> bool:
    """False for a tensor other than a dense one of PyTorch's own classes."""
    if not issubclass(type(obj), torch.Tensor):  # type(): as tensors_in, for weak proxies
        return True
    try:
        plain = cast(torch.Tensor, obj)
        return (
            type(plain) in (torch.Tensor, torch.nn.Parameter)
            and plain.layout is torch.strided
            and not plain.is_nested
        )
    except Exception:
        return False


def _first_line(exc: BaseException) -> str:
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__


def _has_history(record: TensorRecord) -> bool:
    try:
        tensor = record.tensor() if record.tensor is not None else None
        return tensor is not None and tensor.grad_fn is not None
    except Exception:  # a tensor that cannot say: counted as without
        return False


def _device_of(message: str) -> str:
    if "CUDA" in message:
        found = _GPU.search(message)
        return f"cuda:{found.group(1) if found else 0}"
    if "MPS" in message:
        return "mps"
    return "cpu"


def _requested(message: str) -> int | None:
    found = _TRIED_BYTES.search(message)
    if found:
        return int(found.group(1))
    found = _TRIED.search(message)
    return parse_size(found.group(1)) if found else None


def _hints(
    requested: int | None,
    total: int | None,
    allocated: int | None,
    reserved: int | None,
    history: int,
) -> tuple[Hint, ...]:
    hints = []
    if requested is not None and total is not None and requested > total:
        hints.append(Hint("request_too_large", requested))
    if allocated is not None and reserved is not None and reserved > 0:
        idle = reserved - allocated
        if idle > FRAGMENTED * reserved:
            hints.append(Hint("fragmentation", idle))
    hints.append(Hint("smaller_batch"))
    if history:
        hints.append(Hint("autograd_history", history))
    return tuple(hints)


def print_oom_report(
    exc: BaseException,
    stream: TextIO | None = None,
    *,
    model: torch.nn.Module | None = None,
    stacklevel: int = 1,
) -> bool:
    """Print :func:`explain_oom`'s report of `exc` to `stream` (default: stderr now).

    Meant for the moment an out-of-memory error passes through, where nothing must take
    the error's place: a report that cannot be made or printed (a closed stream, an error
    inside :func:`explain_oom`) only warns (:class:`~torchmem.errors.TorchmemWarning`,
    `stacklevel` above the caller), and never raises an ``Exception``.

    Returns:
        Whether the report was printed.
    """
    try:
        text = str(explain_oom(exc, model=model))
        print(text, file=stream if stream is not None else sys.stderr)
    except Exception as failure:
        # With warnings turned into errors the warning itself raises: it must not escape.
        with contextlib.suppress(Exception):
            warnings.warn(
                f"torchmem could not report the out-of-memory error: {_first_line(failure)}",
                TorchmemWarning,
                stacklevel=stacklevel + 1,
            )
        return False
    return True


class oom_guard(contextlib.ContextDecorator):
    """Print an :class:`OOMReport` (to `stream`, default stderr) when an out-of-memory
    error passes through, then re-raise it unchanged. A context manager and a decorator:
    ``with oom_guard(): ...`` or ``@oom_guard()``; `model` names the largest tensors
    after its parameters.

    The error always passes through as it came (the same object, with its traceback): a
    report that fails then (the stream closed meanwhile, a tensor that cannot be read)
    only warns, with :class:`~torchmem.errors.TorchmemWarning`.

    Raises:
        TypeError: naming the value, if `stream` has no ``write`` method or `model` is
            not a module.
        ValueError: if `stream` is closed already.
    """

    def __init__(self, stream: TextIO | None = None, *, model: torch.nn.Module | None = None):
        if stream is not None:
            if not callable(getattr(stream, "write", None)):
                raise TypeError(
                    "oom_guard: stream must be a text stream (with write) or None,"
                    f" not {_describe(stream)}"
                )
            if getattr(stream, "closed", False) is True:
                raise ValueError(f"oom_guard: stream {_describe(stream)} is closed")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"oom_guard: model must be a torch.nn.Module or None, not {_describe(model)}"
            )
        self.stream = stream
        self.model = model

    def __enter__(self) -> oom_guard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        if exc is not None and is_oom(exc):
            print_oom_report(exc, self.stream, model=self.model, stacklevel=2)
