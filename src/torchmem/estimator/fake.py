"""A function run once on fake CPU tensors, logging every allocation and free.

Under a ``FakeTensorMode`` every tensor the function makes has its shape, dtype and
device, but no memory; operators compute only those. The tensor meter, watching the fake
CPU device, counts each new storage exactly as a real CPU run allocates it, and this log
keeps them in order, with the user's line that made each one. PyTorch's global hooks
(:class:`~torchmem.recorder.hooks.Watcher`) say which storages were parameters,
gradients, optimizer state and activations, and when each module ran.

For a CUDA target the run still happens on the fake CPU device (fake CUDA tensors cannot
run a backward pass on a machine without a GPU): ``device="cuda"`` arguments,
``.cuda()`` and ``.to("cuda")`` are read as the CPU, and ``torch.autocast("cuda", ...)``
turns CPU autocast on with the same dtype (float16 where none is given, as on CUDA).
Optimizers that would choose their implementation take CUDA's (``foreach``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode

from torchmem._compat import (
    DispatchMode,
    data_dependent_operator,
    fake_mode,
    forget_converted,
    getframe,
    in_backward,
    storage_key,
)
from torchmem.meters.tensor import TensorMeter
from torchmem.recorder.hooks import Watcher
from torchmem.recorder.sources import NO_SITE, Log
from torchmem.records.frames import (
    BACKWARD,
    ENGINE,
    SiteKey,
    Stack,
    choose,
    code_name,
    kind,
    own_file,
)


aten = torch.ops.aten
MATMULS = frozenset((aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv))
"""Operators that run in cuBLAS on a GPU (its workspace is allocated at the first one)."""
_SCALAR = aten._local_scalar_dense.default


@dataclass
class FakeRun:
    """What one fake run logged."""

    log: Log
    """Every allocation and free on the fake CPU device, in order."""
    watcher: Watcher
    """The marks and module intervals of PyTorch's global hooks."""
    matmuls: list[tuple[int, bool]]
    """``(number of events logged before it, in a backward pass)`` of the first matrix
    product outside backward passes and of the first inside one."""
    reads: int
    """Values read from tensors (``.item()``, ``bool(t)``) that fake tensors did not know:
    each read gave 1 (False for a boolean)."""
    stop: int
    """``time.monotonic_ns()`` when the run ended."""


class _LoggedMeter(TensorMeter):
    """The tensor meter, also logging each allocation and free, in order, with the line
    of the user's code that made it. A storage that grows (``resize_``) is logged as a
    free of its old size and an allocation of its new one."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.rows: list[list[int]] = []
        self.sites: dict[SiteKey, int] = {}
        """Each site (:mod:`torchmem.records.frames`) -> its index, in order of first use."""
        self._open: dict[int, int] = {}
        self._kinds: dict[CodeType, int] = {}  # -1: torchmem's own
        self._picked: dict[tuple[CodeType, int], int] = {}
        self._on_freed = self._freed

    def _count(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = storage_key(storage)
        ref = self._live.get(key)
        if ref is not None and ref() is not None:
            self._log_free(key, ref.nbytes)
            self._log_alloc(key, ref.nbytes + nbytes)
        else:
            self._log_alloc(key, nbytes)
        super()._count(storage, nbytes)

    def _freed(self, ref: Any) -> None:
        self._log.append(ref)
        self._log_free(ref.key, ref.nbytes)

    def _log_alloc(self, key: int, nbytes: int) -> None:
        self._open[key] = len(self.rows)
        self.rows.append([time.monotonic_ns(), key, nbytes, self._site(), -1])

    def _log_free(self, key: int, nbytes: int) -> None:
        allocated = self._open.pop(key, -1)
        if allocated >= 0:
            self.rows[allocated][4] = len(self.rows)
        self.rows.append([time.monotonic_ns(), key, -nbytes, NO_SITE, allocated])

    def _site(self) -> int:
        """The index of the site of the allocation being logged (its stack kept the first
        time), by the rule of :mod:`torchmem.records.frames`."""
        kinds = self._kinds

        def frames(frame: FrameType | None) -> Iterator[tuple[int, FrameType]]:
            while frame is not None:
                code = frame.f_code
                found = kinds.get(code)
                if found is None:
                    own = own_file(code.co_filename)  # the meter's frames: never a site
                    found = kinds[code] = -1 if own else kind(code.co_filename, code.co_name)
                if found >= 0:
                    yield found, frame
                frame = frame.f_back

        chosen = choose(frames(getframe(2)))
        if chosen is None:
            return NO_SITE
        found, frame = chosen
        where = (frame.f_code, frame.f_lineno or 0)
        index = self._picked.get(where)
        if index is None:
            stack = _stack(getframe(2))
            if found == ENGINE:
                key = SiteKey((BACKWARD, 0, ""), stack)
            else:
                key = SiteKey((where[0].co_filename, where[1], code_name(where[0])), stack)
            index = self._picked[where] = self.sites.setdefault(key, len(self.sites))
        return index


def _stack(frame: FrameType | None) -> Stack:
    """The Python stack from `frame` out, innermost first, without torchmem's frames."""
    found = []
    while frame is not None:
        code = frame.f_code
        if not own_file(code.co_filename):
            found.append((code.co_filename, frame.f_lineno or 0, code_name(code)))
        frame = frame.f_back
    return tuple(found)


class _Operators(DispatchMode):
    """Notes the first matrix products (where cuBLAS allocates its workspace on a GPU),
    and answers a read of a value fake tensors do not know with 1 (False for a boolean)."""

    def __init__(self, meter: _LoggedMeter) -> None:
        super().__init__()
        self.meter = meter
        self.matmuls: list[tuple[int, bool]] = []
        self.reads = 0
        self._seen: set[bool] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as exc:
            if func is not _SCALAR or data_dependent_operator(exc) is None:
                raise
            # A value fake tensors do not know (they know a constant's: torch.tensor(0.)).
            self.reads += 1
            dtype = args[0].dtype
            return False if dtype is torch.bool else 1.0 if dtype.is_floating_point else 1
        if func.overloadpacket in MATMULS:
            backward = in_backward()
            if backward not in self._seen:
                self._seen.add(backward)
                self.matmuls.append((len(self.meter.rows), backward))
        return out


def _is_cuda(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


class _OnFakeCpu(TorchFunctionMode):
    """With `cuda`, reads every CUDA device the function names as the CPU."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.cuda:
            if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            if _is_cuda(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
            if func is torch.Tensor.to:
                args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cuda_autocast_on_cpu() -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` turns on CPU autocast with `dtype` (float16 where
    none is given, CUDA's default) until the block ends."""
    original = torch.autocast.__init__

    def init(
        self: torch.autocast,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
        original(self, device_type, dtype, enabled, cache_enabled)

    torch.autocast.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autocast.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _swaps_forgetting(mode: Any) -> Iterator[None]:
    """``module.to()`` and ``module.half()`` swap each fake parameter with its converted
    self (``torch.utils.swap_tensors``), which fails while `mode` holds a weak reference
    to either: it drops them first, until the block ends."""
    original = torch.utils.swap_tensors

    def swap(first: torch.Tensor, second: torch.Tensor) -> None:
        forget_converted(mode)
        original(first, second)  # type: ignore[no-untyped-call]

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _foreach_optimizers() -> Iterator[None]:
    """Optimizers left to choose their implementation take the one they take on CUDA
    (``foreach``: whole lists of tensors per operator, with their temporaries), not the
    CPU's one tensor at a time, until the block ends."""
    chosen: list[dict[str, Any]] = []

    def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
                chosen.append(group)

    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        while chosen:
            chosen.pop()["foreach"] = None

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _address(tensor: torch.Tensor) -> int:
    return storage_key(tensor.untyped_storage())


def run_fake(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, cuda: bool
) -> FakeRun:
    """Run ``fn(*args, **kwargs)`` once on fake CPU tensors (tensor arguments are faked;
    their bytes are there from the start), logging every allocation and free.
    With `cuda`, CUDA devices and CUDA autocast are read as the CPU's."""
    meter = _LoggedMeter()
    operators = _Operators(meter)
    watcher = Watcher(address=_address)
    base = 0
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(_cuda_autocast_on_cpu())
            stack.enter_context(_foreach_optimizers())
        mode = fake_mode()
        stack.enter_context(_swaps_forgetting(mode))
        stack.enter_context(_OnFakeCpu(cuda))
        stack.enter_context(mode)
        seen: set[int] = set()

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal base
            storage = tensor.untyped_storage()
            if storage_key(storage) not in seen:
                seen.add(storage_key(storage))
                base += storage.nbytes()
            return mode.from_tensor(tensor)  # type: ignore[no-any-return]

        args = tuple(fake(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        stack.enter_context(operators)
        start = time.monotonic_ns()
        window = meter.window()
        stack.callback(window.close)
        watcher.start()
        try:
            fn(*args, **kwargs)
        finally:
            watcher.stop()
    stop = time.monotonic_ns()
    events = torch.tensor(meter.rows, dtype=torch.int64).reshape(-1, 5)
    sites = {index: site for site, index in meter.sites.items()}
    log = Log("cpu", base, start, events, sites)
    return FakeRun(log, watcher, operators.matmuls, operators.reads, stop)
