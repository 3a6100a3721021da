"""Every private PyTorch or CPython symbol torchmem uses, behind one door.

Each symbol is looked up once, here, when torchmem first needs PyTorch (the allocator's
peak reset at each use: see :func:`intercept_peak_resets`). Where a release lacks it,
torchmem falls back to a public way of doing the same thing, or, where there
is none, the feature that needs it raises :class:`~torchmem.errors.TorchmemError` naming
the symbol and the PyTorch (or Python) version, and every other feature keeps working.
:func:`missing` lists what this installation lacks; the test suite checks it is empty
for the PyTorch it pins.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import operator
import platform
import types
from collections.abc import Callable, Collection
from typing import Any, NoReturn, TypeVar

import torch

from torchmem.errors import TorchmemError

F = TypeVar("F", bound=Callable[..., Any])

_missing: list[str] = []


def missing() -> list[str]:
    """The private symbols torchmem looked for and this installation lacks, by path."""
    return list(_missing)


def lookup(path: str) -> Any:
    """The object at dotted `path` (a module, then attributes: ``"torch.UntypedStorage._cdata"``),
    or None, recorded in :func:`missing`, where this installation lacks it."""
    parts = path.split(".")
    found: Any = None
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            found = getattr(found, name, None)
        break
    if found is None:
        _missing.append(path)
    return found


def unsupported(path: str, feature: str) -> Callable[..., NoReturn]:
    """A stand-in for the missing `path` that raises, naming it and the versions, when
    `feature` is used."""

    def fail(*args: object, **kwargs: object) -> NoReturn:
        raise TorchmemError(
            f"{feature} needs {path}, which this PyTorch {torch.__version__} (Python"
            f" {platform.python_version()}) does not have"
        )

    return fail


# Dispatch modes (the tensor meter) -------------------------------------------------------

_DISPATCH = "torch.utils._python_dispatch"
_TENSOR_METER = "The CPU tensor meter"


class _NoDispatchMode:
    """What the tensor meter's mode derives from where PyTorch has no TorchDispatchMode."""

    def __init__(self) -> None:
        unsupported(f"{_DISPATCH}.TorchDispatchMode", _TENSOR_METER)()


TorchDispatchMode: type = lookup(f"{_DISPATCH}.TorchDispatchMode") or _NoDispatchMode
"""PyTorch's ``TorchDispatchMode`` (documented, but in a private module)."""


class DispatchMode(TorchDispatchMode):  # type: ignore[misc]
    """A ``TorchDispatchMode`` that PyTorch does not wrap in ``torch._disable_dynamo``
    (a wrapper that costs microseconds per operator): its subclass keeps Dynamo out with
    :func:`keep_dynamo_out` instead, or with :func:`disable_dynamo` where that fails."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # a TorchDispatchMode hook, private in PyTorch
        return False


dispatch_mode_stack: Callable[[], list[Any]] = lookup(
    f"{_DISPATCH}._get_current_dispatch_mode_stack"
) or unsupported(f"{_DISPATCH}._get_current_dispatch_mode_stack", _TENSOR_METER)
"""This thread's dispatch modes, innermost last."""

push_mode: Callable[[Any], None] = lookup(f"{_DISPATCH}._push_mode") or unsupported(
    f"{_DISPATCH}._push_mode", _TENSOR_METER
)
"""Put a mode on this thread's dispatch-mode stack."""

pop_mode: Callable[[], Any] = lookup(f"{_DISPATCH}._pop_mode") or unsupported(
    f"{_DISPATCH}._pop_mode", _TENSOR_METER
)
"""Take the innermost mode off this thread's dispatch-mode stack and return it."""


def _has_wrapper_protocol(tensor: object) -> bool:
    """Public fallback of ``is_traceable_wrapper_subclass``: a tensor subclass that
    flattens into inner tensors (``__tensor_flatten__`` / ``__tensor_unflatten__``)."""
    kind = type(tensor)
    return (
        isinstance(tensor, torch.Tensor)
        and kind is not torch.Tensor
        and hasattr(kind, "__tensor_flatten__")
        and hasattr(kind, "__tensor_unflatten__")
    )


is_traceable_wrapper_subclass: Callable[[object], bool] = (
    lookup(f"{_DISPATCH}.is_traceable_wrapper_subclass") or _has_wrapper_protocol
)
"""True for a tensor subclass made of inner tensors (a jagged nested tensor, a DTensor)."""


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass keeps its bytes in, one level down (a DTensor's local
    shard, a jagged nested tensor's values and offsets); none for any other tensor."""
    if not is_traceable_wrapper_subclass(tensor):
        return []
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [value for name in names if isinstance(value := getattr(tensor, name), torch.Tensor)]


@functools.cache
def wraps_tensors(types: tuple[type, ...]) -> bool:
    """Whether an operator's tensor subclasses (the `types` a ``__torch_dispatch__`` is
    given) include one made of inner tensors (a DTensor, a jagged nested tensor). A mode
    that returns NotImplemented for it lets the subclass run the operator, on its inner
    tensors, through the mode: the mode sees the storages those hold, not the wrapper's,
    whose size is the whole (unsharded) tensor's. Fake tensors have no inner tensors."""
    return any(hasattr(kind, "__tensor_flatten__") for kind in types)


def op_callable(func: Any) -> Callable[..., Any]:
    """What runs operator `func` with one Python call less: an ``OpOverload``'s own
    ``_op``, else `func` itself."""
    if type(func) is _OP_OVERLOAD:
        return getattr(func, "_op", func)  # type: ignore[no-any-return]
    return func  # type: ignore[no-any-return]


_OP_OVERLOAD = lookup("torch._ops.OpOverload")

# Dynamo ---------------------------------------------------------------------------------


def disable_dynamo(function: F) -> F:
    """`function` wrapped so that Dynamo never compiles it nor what it calls
    (``torch._disable_dynamo(recursive=True)``); unchanged where PyTorch has no Dynamo."""
    if _DISABLE_DYNAMO is None:
        return function
    return _DISABLE_DYNAMO(function, recursive=True)  # type: ignore[no-any-return]


_DISABLE_DYNAMO = lookup("torch._disable_dynamo")

_EVAL_FRAME = "torch._C._dynamo.eval_frame"


def keep_dynamo_out(*functions: Callable[..., Any]) -> bool:
    """Mark `functions` so that Dynamo never compiles them nor anything they call, as
    :func:`disable_dynamo` does but with no wrapper to pay for on every call. False where
    this PyTorch offers no such mark (use :func:`disable_dynamo` then)."""
    if _SET_CODE_EXEC_STRATEGY is None or _FRAME_ACTION is None or _FRAME_STRATEGY is None:
        return False
    try:
        skip = _FRAME_STRATEGY(_FRAME_ACTION.SKIP, _FRAME_ACTION.SKIP)
        for function in functions:
            _SET_CODE_EXEC_STRATEGY(function.__code__, skip)
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


def skip_dynamo_frames(function: Callable[..., Any]) -> None:
    """Mark `function` so that Dynamo never compiles a frame of its own for it (a call
    from eager code that Dynamo's frame evaluation sees), while it still traces through it
    where compiled code calls it. Nothing where this PyTorch offers no such mark."""
    if _SET_CODE_EXEC_STRATEGY is None or _FRAME_ACTION is None or _FRAME_STRATEGY is None:
        return
    with contextlib.suppress(AttributeError, TypeError, RuntimeError):
        strategy = _FRAME_STRATEGY(_FRAME_ACTION.SKIP, _FRAME_ACTION.DEFAULT)
        _SET_CODE_EXEC_STRATEGY(function.__code__, strategy)


_SET_CODE_EXEC_STRATEGY = lookup(f"{_EVAL_FRAME}.set_code_exec_strategy")
_FRAME_ACTION = lookup(f"{_EVAL_FRAME}._FrameAction")
_FRAME_STRATEGY = lookup(f"{_EVAL_FRAME}._FrameExecStrategy")

# Storages --------------------------------------------------------------------------------


def _no_storage_key(storage: torch.UntypedStorage) -> NoReturn:
    unsupported("torch.UntypedStorage._cdata", "Telling storages apart")()


storage_key: Callable[[torch.UntypedStorage], int] = (
    operator.attrgetter("_cdata")
    if lookup("torch.UntypedStorage._cdata") is not None
    else _no_storage_key
)
"""A storage's identity while it is alive: the address of its C++ ``StorageImpl``, one
per storage however many Python objects stand for it (``data_ptr()`` would not do: it is
0 for every meta tensor and every empty one)."""

_SHARED_MAKERS = ("_new_shared_fd_cpu", "_new_shared_filename_cpu")
_SHARED_NEW = ("_new_using_fd_cpu", "_new_using_filename_cpu")
_SHARED_MOVERS = ("_share_fd_cpu_", "_share_filename_cpu_")


def _storage_methods(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in names if lookup(f"torch.UntypedStorage.{name}") is not None)


RECEIVED_STORAGES = _storage_methods(_SHARED_MAKERS)
"""``UntypedStorage``'s static methods that map a storage another process put in shared
memory (how ``torch.multiprocessing`` unpickles one: a DataLoader worker's batch); those
this PyTorch has. Each returns the new storage."""
SHARED_STORAGES = _storage_methods(_SHARED_NEW)
"""``UntypedStorage``'s static methods that make a new storage in shared memory
(``UntypedStorage._new_shared``); those this PyTorch has."""
STORAGE_MOVES = _storage_methods(_SHARED_MOVERS)
"""``UntypedStorage``'s methods that move a storage into shared memory in place
(``share_memory_()``, and pickling one for another process); those this PyTorch has."""

# CUDA allocator history ----------------------------------------------------------------
# PyTorch keeps one allocator history per process. Re-enabling it keeps what it holds (unless
# asked to clear it); disabling it (enabled=None) throws it away; a smaller max_entries drops
# the oldest entries. Both functions are looked up at each use: torchmem's interceptor, and
# other code, may have replaced them.

_HISTORY_FEATURE = "Recording CUDA memory"
HistoryHook = Callable[[tuple[Any, ...], dict[str, Any], Callable[..., Any]], Any]
"""What runs instead of the program's own ``_record_memory_history(*args, **kwargs)``:
``hook(args, kwargs, original)``; the hook decides what, if anything, to pass on."""

_history_interceptor: tuple[Callable[..., Any], Callable[..., Any]] | None = None
"""The interceptor :func:`intercept_cuda_history` installed, and the function it replaced."""


def _record_history() -> Callable[..., Any]:
    if _history_interceptor is not None:  # whatever wraps the interceptor since
        return _history_interceptor[1]
    current = getattr(torch.cuda.memory, "_record_memory_history", None)
    if current is None:
        unsupported("torch.cuda.memory._record_memory_history", _HISTORY_FEATURE)()
    return current  # type: ignore[no-any-return]


def cuda_history_set(enabled: str | None, **settings: Any) -> None:
    """Call PyTorch's ``_record_memory_history(enabled, **settings)`` itself, passing by
    torchmem's interceptor; settings this PyTorch does not know are left out."""
    record = _record_history()
    try:
        known: Collection[str] = inspect.signature(record).parameters
    except (TypeError, ValueError):
        known = ()
    record(enabled, **{k: v for k, v in settings.items() if k in known})


def cuda_history_snapshot() -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: every device's segments and allocator history."""
    take = getattr(torch.cuda.memory, "_snapshot", None)
    if take is None:
        unsupported("torch.cuda.memory._snapshot", _HISTORY_FEATURE)()
    return take()  # type: ignore[no-any-return]


def cuda_history_enabled() -> bool:
    """Whether PyTorch's CUDA allocator history is on (``torch._C._cuda_isHistoryEnabled``);
    where this PyTorch lacks that, whether the history holds any entry."""
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if enabled is not None:
        return bool(enabled())
    return any(cuda_history_snapshot().get("device_traces", []))


def intercept_cuda_history(hook: HistoryHook) -> None:
    """Make the program's calls of ``torch.cuda.memory._record_memory_history`` run `hook`
    instead, until :func:`stop_intercepting_cuda_history`."""
    global _history_interceptor
    original = _record_history()

    @functools.wraps(original)
    def intercept(*args: Any, **kwargs: Any) -> Any:
        if _history_interceptor is None or _history_interceptor[0] is not intercept:
            return original(*args, **kwargs)  # kept by code that wrapped it: not ours now
        return hook(args, kwargs, original)

    torch.cuda.memory._record_memory_history = intercept
    _history_interceptor = (intercept, original)


def stop_intercepting_cuda_history() -> None:
    """Put back the function :func:`intercept_cuda_history` replaced, unless other code
    replaced the interceptor since (that code keeps its own function)."""
    global _history_interceptor
    installed, _history_interceptor = _history_interceptor, None
    if installed is not None and torch.cuda.memory._record_memory_history is installed[0]:
        torch.cuda.memory._record_memory_history = installed[1]


# Peak-counter resets -------------------------------------------------------------------
# torch.cuda.reset_peak_memory_stats, and every public function that resets the caching
# allocator's peaks (reset_max_memory_allocated, reset_max_memory_cached, their
# torch.cuda.memory twins), looks up torch._C._cuda_resetPeakMemoryStats when called;
# torch.xpu likewise _xpu_resetPeakMemoryStats. Replacing that one attribute sees every
# reset made from Python. It is looked up at each use, not once at import: builds
# without the backend lack it (and record nothing in missing()), and others may replace it.

PeakResetHook = Callable[[Any, Callable[[Any], Any]], Any]
"""What runs instead of a reset of the peaks: ``hook(device, reset)``, with the device
argument the caller passed and the function that was replaced, which the hook must call
as ``reset(device)`` (returning what it returns) for the reset to happen."""

_interceptors: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
"""The interceptor installed by :func:`intercept_peak_resets` and the function it
replaced, by backend."""


def _reset_name(backend: str) -> str:
    return f"_{backend}_resetPeakMemoryStats"


def intercept_peak_resets(backend: str, hook: PeakResetHook) -> bool:
    """Make every reset of the peak counters of `backend`'s caching allocator (``"cuda"``,
    ``"xpu"``) that goes through Python run `hook` instead, by replacing
    ``torch._C._<backend>_resetPeakMemoryStats``. Nothing changes where it is in place.
    False where this PyTorch has no such function (a CPU build): resets are not seen then."""
    name = _reset_name(backend)
    current = getattr(torch._C, name, None)
    if current is None:
        return False
    installed = _interceptors.get(backend)
    if installed is not None and installed[0] is current:
        return True

    def intercept(device: Any = None) -> Any:
        return hook(device, current)

    setattr(torch._C, name, intercept)
    _interceptors[backend] = (intercept, current)
    return True


def stop_intercepting_peak_resets(backend: str) -> bool:
    """Put back the function :func:`intercept_peak_resets` replaced, unless other code
    replaced the interceptor since: that code keeps its own function (which may still call
    the interceptor, whose hook then runs as before). True if the function was put back."""
    installed = _interceptors.pop(backend, None)
    name = _reset_name(backend)
    if installed is None or getattr(torch._C, name, None) is not installed[0]:
        return False
    setattr(torch._C, name, installed[1])
    return True


def peak_reset(backend: str) -> Callable[[int], Any] | None:
    """The function that resets the peak counters of `backend`'s caching allocator on one
    device (its index), passing by the hook of :func:`intercept_peak_resets`: the function
    the interceptor replaced while it is installed, else
    ``torch._C._<backend>_resetPeakMemoryStats``. None where this PyTorch has none (use
    the public ``reset_peak_memory_stats``)."""
    current = getattr(torch._C, _reset_name(backend), None)
    installed = _interceptors.get(backend)
    if installed is not None and installed[0] is current:
        return installed[1]
    return current


_AUTOGRAD_NODE = lookup("torch._C._current_autograd_node")


def backward_node() -> Any:
    """The autograd node (a ``grad_fn``) whose backward formula this thread runs now; None
    outside a backward pass, or where this PyTorch cannot say."""
    return _AUTOGRAD_NODE() if _AUTOGRAD_NODE is not None else None


def in_backward() -> bool:
    """Whether autograd is computing gradients in this thread (a backward pass)."""
    return backward_node() is not None


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """`module`'s own parameters by attribute name (None where one is unset), the dict
    itself: ``named_parameters(recurse=False)`` builds a generator per call, and this is
    read at every module call of a recording."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """`module`'s own buffers by attribute name (None where one is unset), the dict itself,
    as :func:`own_parameters`."""
    return module._buffers


def cxx11_abi() -> bool:
    """Whether torch was built with the C++11 ABI (``_GLIBCXX_USE_CXX11_ABI``); True where
    it does not say."""
    return bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))


# CPython -------------------------------------------------------------------------------

_RLOCK_IS_OWNED = lookup("_thread.RLock._is_owned")


def lock_is_owned(lock: Any) -> bool:
    """True if this thread holds re-entrant `lock` (``threading.RLock``)."""
    if _RLOCK_IS_OWNED is None:
        unsupported("_thread.RLock._is_owned", "The tensor meter")()
    return _RLOCK_IS_OWNED(lock)  # type: ignore[no-any-return]


def _walk_frames(depth: int = 0) -> types.FrameType:
    """``sys._getframe`` from public parts, for Pythons without it."""
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        frame = frame.f_back if frame is not None else None
    if frame is None:
        raise ValueError("call stack is not deep enough")
    return frame


getframe: Callable[[int], types.FrameType] = lookup("sys._getframe") or _walk_frames
"""The frame `depth` calls above the caller (``sys._getframe``, a CPython detail)."""
thread_frames: Callable[[], dict[int, types.FrameType]] = lookup("sys._current_frames") or dict
"""Each thread's innermost frame by ident (``sys._current_frames``); none without it."""

# Reading tensors as they are ----------------------------------------------------------

_DISABLE_FUNCTORCH = lookup("torch._C._DisableFuncTorch")
_DISABLE_TORCH_FUNCTION = lookup("torch._C.DisableTorchFunctionSubclass")


class PlainTensorAccess:
    """A block (``with PlainTensorAccess(): ...``) in which reading a tensor's metadata and
    storages runs no ``torch.func`` transform and no subclass's ``__torch_function__``:
    inside ``torch.func.grad`` a sparse CSR tensor's ``crow_indices()`` raises "Sparse CSR
    tensors do not have strides", and a subclass's ``__torch_function__`` may raise or do
    anything. Where PyTorch lacks one of the two guards, that one is left out. One block
    per instance."""

    def __init__(self) -> None:
        self._entered: list[Any] = []

    def __enter__(self) -> None:
        try:
            for make in (_DISABLE_FUNCTORCH, _DISABLE_TORCH_FUNCTION):
                if make is not None:
                    guard = make()  # _DisableFuncTorch is on from here: RAII in C++
                    guard.__enter__()
                    self._entered.append(guard)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc_info: object) -> None:
        while self._entered:
            self._entered.pop().__exit__(None, None, None)
