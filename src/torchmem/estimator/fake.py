"""A function run once on fake CPU tensors, logging every allocation and free.

Under a ``FakeTensorMode`` every tensor the function makes has its shape, dtype and
device, but no memory; operators compute only those. The tensor meter, watching the fake
CPU device, counts each new storage exactly as a real CPU run allocates it, and this log
keeps them in order, with the user's line that made each one. PyTorch's global hooks
(:class:`~torchmem.events.hooks.Watcher`) say which storages were parameters,
gradients, optimizer state, buffers and activations, and when each module ran;
:mod:`~torchmem.estimator.kernels` adds what real kernels make beyond the fake ones'
results (a Python number given for a tensor, a CPU kernel's casts).

For a CUDA target the run still happens on the fake CPU device (fake CUDA tensors cannot
run a backward pass on a machine without a GPU), and only the storages that would be on
the GPU are logged: those of calls that name a CUDA device (``device="cuda"``,
``device=x.device`` of a GPU tensor), of ``.cuda()`` and ``.to("cuda")`` copies, and of
operators on GPU tensors; a model built on the CPU costs the GPU only its copy.
``torch.autocast("cuda", ...)`` turns CPU autocast on with the same dtype (float16 where
none is given, as on CUDA) and CUDA's rules of what to cast. Optimizers that would choose
their implementation take CUDA's (``foreach``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, NoReturn

import torch

from torchmem._compat import DispatchMode, getframe, in_backward, storage_key, wraps_tensors
from torchmem._compat.fake import data_dependent_operator, fake_mode, no_dispatch_modes
from torchmem._compat.fsdp import wait_tensor
from torchmem.errors import EstimateError
from torchmem.estimator import patches
from torchmem.estimator.kernels import Kernels
from torchmem.estimator.loaders import loaders_in_process
from torchmem.estimator.placement import OnFakeCpu, any_on, mark, real_tensor
from torchmem.estimator.values import Values, user_line, values_read
from torchmem.events.hooks import Watcher
from torchmem.events.notes import Notes
from torchmem.events.sources import NO_SITE, Log
from torchmem.meters.tensor import TensorMeter
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
LT_MATMULS = frozenset((aten.addmm, aten._addmm_activation))
"""Operators PyTorch runs in cuBLASLt on a GPU (a bias fused in), whose own workspace is
allocated at the first one, after cuBLAS's."""
_SCALAR = aten._local_scalar_dense.default
_WAIT = wait_tensor()  # returns its input; its fake kernel, a new tensor
CPU_OUTPUTS = {
    aten._scaled_dot_product_efficient_attention.default: frozenset((2, 3)),
    aten._scaled_dot_product_flash_attention.default: frozenset((6, 7)),
}
"""Operators on GPU tensors whose results at these positions are CPU tensors (the fused
attention kernels' random seed and offset)."""
FAKE_LOG = "torch._subclasses.fake_tensor"
"""The logger of PyTorch's fake tensors."""


@dataclass
class FakeRun:
    """What one fake run logged."""

    log: Log
    """Every allocation and free on the fake CPU device, in order."""
    watcher: Watcher
    """The marks and module intervals of PyTorch's global hooks."""
    matmuls: list[tuple[int, bool, bool]]
    """``(number of events logged before it, in a backward pass, cuBLASLt)`` of the first
    matrix product outside backward passes and of the first inside one (cuBLAS's
    workspace), then of the first of :data:`LT_MATMULS` in each (cuBLASLt's)."""
    reads: int
    """Values read from tensors (``.item()``, ``bool(t)``) that fake tensors did not know:
    each read gave 1 (False for a boolean)."""
    spread: int
    """``topk`` calls on values fake tensors did not know (a router's): their choices
    were taken as spread evenly over the candidates."""
    compiled: bool
    """Whether the function called ``torch.compile``."""
    loaders: int
    """Iterations over a DataLoader with workers, which made their batches in this
    process (see :mod:`torchmem.estimator.loaders`)."""
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
        self.gpu_only = False
        """Log only the storages that stand for GPU memory (a CUDA target)."""
        self.on_gpu: set[int] = set()
        """Keys of the live storages that stand for GPU memory."""
        self.to_gpu = False
        """Whether the operator running now makes its new storages on the GPU."""
        self.forced: bool | None = None
        """While a call names its device: whether that device is the GPU."""
        self._unstored = 0
        """The last key :meth:`made` gave (negative: no storage's)."""
        self.paused = 0
        """Above 0 while new storages are not counted (DTensor's shape propagation)."""

    def _count(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if self.paused:
            return
        key = storage_key(storage)
        ref = self._live.get(key)
        live = ref is not None and ref() is not None
        if self.gpu_only:
            if not live and self.to_gpu:
                self.on_gpu.add(key)
            if key not in self.on_gpu:  # CPU memory: counted, not logged
                super()._count(storage, nbytes)
                return
        if ref is not None and live:
            self._log_free(key, ref.nbytes)
            if ref.nbytes + nbytes:
                self._log_alloc(key, ref.nbytes + nbytes)
        else:
            self._log_alloc(key, nbytes)
        super()._count(storage, nbytes)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """`storage`, which held `nbytes`, was resized in place (``UntypedStorage.resize_``,
        which no operator sees): log the change, if the storage is counted."""
        now = storage.nbytes()
        if now != nbytes and self._counted(storage_key(storage)) is not None:
            self._count(storage, now - nbytes)

    def made(self, nbytes: int) -> int:
        """Log `nbytes` made now by no operator (:mod:`~torchmem.estimator.kernels`); the
        key to free them by, one no storage has."""
        self._unstored -= 1
        self._log_alloc(self._unstored, nbytes)
        return self._unstored

    def freed(self, key: int, nbytes: int) -> None:
        """Log the `nbytes` made under `key` (:meth:`made`) freed now."""
        self._log_free(key, nbytes)

    def placed(self, out: Any, cpu: frozenset[int]) -> None:
        """Log the storages of `out`, an operator's results made as CPU ones, as made on
        the GPU now, but those at the positions `cpu`."""
        for i, value in enumerate(out):
            if i in cpu or not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            key = storage_key(storage)
            if storage.nbytes() and key not in self.on_gpu:
                self.on_gpu.add(key)
                self._log_alloc(key, storage.nbytes())

    def _freed(self, ref: Any) -> None:
        self._log.append(ref)
        if self.gpu_only:
            if ref.key not in self.on_gpu:
                return
            self.on_gpu.discard(ref.key)
        if ref.nbytes:  # else resized to nothing, and logged freed then
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
    """Says whether each operator makes GPU or CPU storages (for a CUDA target: on the GPU
    when the call names the GPU, or when it names no device and one of its tensors is on
    the GPU), notes the first matrix products on the GPU (where cuBLAS allocates its
    workspace), and answers a read of a value fake tensors do not know with 1 (False for a
    boolean)."""

    def __init__(self, meter: _LoggedMeter) -> None:
        super().__init__()
        self.meter = meter
        self.matmuls: list[tuple[int, bool, bool]] = []
        self.reads = 0
        self.spread = 0
        self._seen: set[tuple[bool, bool]] = set()
        self.values = Values()
        self.kernels = Kernels(meter)
        self.wrapped: Callable[[], None] = lambda: None
        """Called at each operator on a wrapper subclass (a DTensor)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if types and wraps_tensors(types):
            self.wrapped()
            return NotImplemented  # seen again as the operators on its inner tensors
        if func is _WAIT:
            return args[0]
        meter = self.meter
        kwargs = kwargs or {}
        real = real_tensor(func, (*args, *kwargs.values()))
        if real is not None:  # before any kernel can change it
            _refuse_real(func, real)
        gpu = self._on_gpu(args, kwargs)
        if func is _SCALAR and (value := self.values.value(args[0])) is not None:
            with no_dispatch_modes():
                return value.item()
        if func.namespace != "prim":  # prim.device: autograd asks, before the call returns
            self.kernels.settle()
        swapped = self.kernels.in_place(func, args, kwargs)
        if swapped is not None:
            func, args, kwargs = swapped
        apart = CPU_OUTPUTS.get(func) if gpu and meter.gpu_only else None
        outer, meter.to_gpu = meter.to_gpu, gpu and apart is None
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if data_dependent_operator(exc) is None:
                refused = _refused_by_meta(func, args, kwargs)
                if refused is not None:
                    out = refused
                    self.values.compute(func, args, kwargs, out)
                    return out
                _note_fake_kernel(exc, func)
                raise
            if func is not _SCALAR:
                out = self.values.shaped(func, args, kwargs)
            else:
                # A value fake tensors do not know (they know a constant's: torch.tensor(0.)).
                self.reads += 1
                dtype = args[0].dtype
                return False if dtype is torch.bool else 1.0 if dtype.is_floating_point else 1
        finally:
            meter.to_gpu = outer
        if self.values.spread(func, args, out):
            self.spread += 1
        else:
            self.values.compute(func, args, kwargs, out)
        self.kernels.made_by(out)
        if not meter.gpu_only:
            self.kernels.after(func, args, kwargs, out)
        if gpu:
            self._on_the_gpu(func, out, apart)
        return out

    def _on_gpu(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the operator running now makes its storages on the GPU (always, for a
        CPU target, whose storages are all logged)."""
        meter = self.meter
        if not meter.gpu_only:
            return True
        if meter.forced is not None:
            return meter.forced
        return any_on(meter.on_gpu, args) or any_on(meter.on_gpu, kwargs.values())

    def _on_the_gpu(self, func: Any, out: Any, apart: frozenset[int] | None) -> None:
        """After `func` made `out` on the GPU (but those at the positions `apart`): give
        them the GPU's device, and note the first matrix products."""
        meter = self.meter
        if apart is not None:
            meter.placed(out, apart)
        if meter.gpu_only:
            mark(out if apart is None else [o for i, o in enumerate(out) if i not in apart])
        if func.overloadpacket in MATMULS:
            backward = in_backward()
            for lt in (False, True) if func.overloadpacket in LT_MATMULS else (False,):
                if (backward, lt) not in self._seen:
                    self._seen.add((backward, lt))
                    self.matmuls.append((len(meter.rows), backward, lt))


def _refuse_real(func: Any, real: torch.Tensor) -> NoReturn:
    """Refuse the tensor `real`, given to `func`: only what the estimate makes is fake."""
    raise EstimateError(
        f"{func} at {user_line()} was given a real tensor ({real.dtype}"
        f" {tuple(real.shape)} on {real.device}), made before the estimate began (a"
        " global, a closure's, a module's built outside): an estimate fakes only what"
        " it makes. Build it inside the function; the real one was left unchanged."
    )


def _note_fake_kernel(exc: Exception, func: Any) -> None:
    """Add to `exc`, a RuntimeError that `func` raised on fake tensors, where it was
    called and why (Python 3.11 on: none before)."""
    note = getattr(exc, "add_note", None)
    if isinstance(exc, RuntimeError) and note is not None:
        note(
            f"torchmem estimate: raised by {func} on fake tensors (its meta"
            f" kernel), called at {user_line()}; where the same code runs on"
            " real tensors, the fake kernel refuses what the real one accepts."
        )


_GROUPED_MM: Any = getattr(getattr(aten, "_grouped_mm", None), "default", None)


def _refused_by_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The result of an operator whose fake (meta) kernel refuses dtypes its CPU kernel
    takes, made on the fake device; None for any other. ``_grouped_mm`` (a mixture of
    experts' matrix products): its meta kernel takes bfloat16 only, as CUDA's does; the
    shape is the same whatever the dtype."""
    if _GROUPED_MM is None or func is not _GROUPED_MM:
        return None

    def as_meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=dtype, device="meta")  # the shape needs no strides

    options = {k: as_meta(v) for k, v in kwargs.items() if k != "out_dtype"}
    with no_dispatch_modes():
        shaped = _GROUPED_MM(*(as_meta(a) for a in args), **options)
    dtype = kwargs.get("out_dtype") or args[0].dtype
    return torch.empty(shaped.shape, dtype=dtype, device=args[0].device)


class _QuietRefusals(logging.Filter):
    """Drops the fake tensors' log of a meta kernel's refusal that
    :func:`_refused_by_meta` answers (an error logged, with its traceback, per call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        refused = str(record.msg).startswith("failed while attempting to run meta")
        return not (refused and record.args and record.args[0] is _GROUPED_MM)  # type: ignore[index]


@contextlib.contextmanager
def _quiet_refusals() -> Iterator[None]:
    log, quiet = logging.getLogger(FAKE_LOG), _QuietRefusals()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _address(tensor: torch.Tensor) -> int:
    return storage_key(tensor.untyped_storage())


def run_fake(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, cuda: bool
) -> FakeRun:
    """Run ``fn(*args, **kwargs)`` once on fake CPU tensors (tensor arguments are faked;
    their bytes are there from the start), logging every allocation and free.
    With `cuda`, only storages on the GPU are logged (see
    :class:`~torchmem.estimator.placement.OnFakeCpu`; tensor arguments are on the GPU),
    and CUDA autocast runs on the fake CPU with CUDA's rules."""
    meter = _LoggedMeter()
    meter.gpu_only = cuda
    operators = _Operators(meter)
    watcher = Watcher(address=_address)
    watcher.use(notes=Notes())
    compiled: list[bool] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(patches.compiles_seen(compiled))
        in_process = stack.enter_context(loaders_in_process())
        if cuda:
            stack.enter_context(patches.cuda_autocast_on_cpu())
            stack.enter_context(patches.foreach_optimizers())
        mode = fake_mode()
        stack.enter_context(patches.swaps_forgetting(mode))
        stack.enter_context(OnFakeCpu(meter if cuda else None))
        stack.enter_context(mode)
        args, kwargs, base = _faked(mode, meter, args, kwargs)
        start = time.monotonic_ns()
        window = meter.window()
        stack.callback(window.close)
        # Outside the meter's mode: says where an operator's storages go before the meter
        # counts them, and sees a matrix product's result counted.
        stack.enter_context(operators)
        stack.enter_context(values_read(operators.values))
        stack.enter_context(_quiet_refusals())
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(patches.rng_states_counted())  # after fork_rng's own
        stack.enter_context(patches.storage_resizes_counted(meter))
        stack.enter_context(patches.ddp_refused())
        operators.wrapped = stack.enter_context(patches.global_shapes_unlogged(meter))
        watcher.start()
        try:
            fn(*args, **kwargs)
        finally:
            operators.kernels.settle()  # the last operator's numbers
            watcher.stop()
    stop = time.monotonic_ns()
    events = torch.tensor(meter.rows, dtype=torch.int64).reshape(-1, 5)
    sites = {index: site for site, index in meter.sites.items()}
    log = Log("cpu", base, start, events, sites)
    return FakeRun(
        log,
        watcher,
        operators.matmuls,
        operators.reads,
        operators.spread,
        bool(compiled),
        in_process.loaders,
        stop,
    )


def _faked(
    mode: Any, meter: _LoggedMeter, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """`args` and `kwargs` with each tensor faked in `mode` (as on the GPU, for a CUDA
    target), and the bytes of the real tensors' storages, each counted once."""
    seen: set[int] = set()
    base = 0

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal base
        storage = tensor.untyped_storage()
        if storage_key(storage) not in seen:
            seen.add(storage_key(storage))
            base += storage.nbytes()
        faked = mode.from_tensor(tensor)
        meter.on_gpu.add(storage_key(faked.untyped_storage()))
        return faked  # type: ignore[no-any-return]

    args = tuple(fake(a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return args, kwargs, base
