"""Explaining an out-of-memory error: what was asked, what holds the memory, what to try.

:func:`explain_oom` turns an out-of-memory error (CUDA, MPS or the CPU allocator) into an
:class:`OOMReport`; :func:`oom_guard` prints that report when such an error passes
through a block or a function, and re-raises the error unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
from collections.abc import Callable, Iterable
from typing import TextIO

import psutil
import torch

from torchmem.records.oom import Hint, OOMRecord
from torchmem.records.tensors import TensorRecord
from torchmem.resolve import DeviceLike, parse_device, resolve_device
from torchmem.tensors import MemReporter, discover
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
            :class:`MemReporter`; default everything the garbage collector tracks.

    Optimizers found among `objects` name their state (``Adam.fc1.weight.exp_avg``).
    """
    message = str(exc)
    where = parse_device(device if device is not None else _device_of(message))
    requested = _requested(message)
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
    name = str(where)
    roots, optimizers = discover(objects() if objects is not None else gc.get_objects())
    if model is None and len(roots) == 1:
        model = roots[0]
    reporter = MemReporter(model, objects=objects)
    for optimizer in optimizers:
        reporter.add_optimizer(optimizer)
    records = reporter.snapshot(name)
    counted = [r for r in records if r.nbytes]  # a view's bytes are its base's
    largest = tuple(sorted(counted, key=lambda r: r.nbytes, reverse=True)[:LARGEST])
    history = sum(r.nbytes for r in records if _has_history(r))
    hints = _hints(requested, total, allocated, reserved, history)
    return OOMReport(name, requested, total, free, allocated, reserved, largest, history, hints)


def _has_history(record: TensorRecord) -> bool:
    tensor = record.tensor() if record.tensor is not None else None
    return tensor is not None and tensor.grad_fn is not None


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


class oom_guard(contextlib.ContextDecorator):
    """Print an :class:`OOMReport` (to `stream`, default stderr) when an out-of-memory
    error passes through, then re-raise it unchanged. A context manager and a decorator:
    ``with oom_guard(): ...`` or ``@oom_guard()``; `model` names the largest tensors
    after its parameters."""

    def __init__(self, stream: TextIO | None = None, *, model: torch.nn.Module | None = None):
        self.stream = stream
        self.model = model

    def __enter__(self) -> oom_guard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        if exc is not None and is_oom(exc):
            print(explain_oom(exc, model=self.model), file=self.stream or sys.stderr)
