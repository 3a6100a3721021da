"""The door to PyTorch's and CPython's private symbols: each is there in the PyTorch the
project pins, and each has a fallback, or a clear error naming the versions, where a
release lacks it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Callable

import pytest
import torch

from torchmem import _compat
from torchmem.errors import TorchmemError


@pytest.fixture
def fresh_missing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fresh list of missing symbols, so looking up absent ones here leaves no trace."""
    missing: list[str] = []
    monkeypatch.setattr(_compat, "_missing", missing)
    return missing


def test_this_pytorch_has_every_symbol() -> None:
    assert _compat.missing() == []


def test_lookup_finds_modules_then_attributes(fresh_missing: list[str]) -> None:
    assert _compat.lookup("torch.utils._python_dispatch._push_mode") is not None
    assert _compat.lookup("torch.UntypedStorage._cdata") is not None
    assert _compat.lookup("sys._getframe") is sys._getframe
    assert fresh_missing == []
    assert _compat.lookup("torch.utils._python_dispatch._no_such_thing") is None
    assert _compat.lookup("torch._no_such_module.thing") is None
    assert fresh_missing == [
        "torch.utils._python_dispatch._no_such_thing",
        "torch._no_such_module.thing",
    ]


def test_an_unsupported_symbol_names_itself_and_the_versions() -> None:
    fail = _compat.unsupported("torch._C._gone", "The CPU tensor meter")
    with pytest.raises(TorchmemError) as info:
        fail(1, key=2)
    message = str(info.value)
    assert message.startswith("The CPU tensor meter needs torch._C._gone, which this PyTorch")
    assert torch.__version__ in message
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in message


def test_the_dispatch_mode_stack_round_trip() -> None:
    class Mode(_compat.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    mode = Mode()
    _compat.push_mode(mode)
    try:
        assert _compat.dispatch_mode_stack() == [mode]
    finally:
        assert _compat.pop_mode() is mode
    assert _compat.dispatch_mode_stack() == []
    # PyTorch did not wrap it: keep_dynamo_out (or disable_dynamo) is the subclass's job
    assert "__torch_dispatch__" in Mode.__dict__
    assert Mode.__dict__["__torch_dispatch__"].__code__.co_name == "__torch_dispatch__"


def test_wrapper_subclasses_are_recognised_with_or_without_pytorch_s_function() -> None:
    jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    for check in (_compat.is_traceable_wrapper_subclass, _compat._has_wrapper_protocol):
        assert check(jagged)
        assert not check(torch.ones(2))
        assert not check(torch.nn.Parameter(torch.ones(2)))
        assert not check("not a tensor")


def test_op_callable_takes_an_overload_s_own_call() -> None:
    add = torch.ops.aten.add.Tensor
    call = _compat.op_callable(add)
    assert call is not add
    assert torch.equal(call(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    assert _compat.op_callable(torch.add) is torch.add  # not an OpOverload: itself


def test_keep_dynamo_out_marks_code_and_falls_back_to_a_wrapper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def function() -> int:
        return 1

    assert _compat.keep_dynamo_out(function)
    monkeypatch.setattr(_compat, "_SET_CODE_EXEC_STRATEGY", None)
    assert not _compat.keep_dynamo_out(function)
    wrapped = _compat.disable_dynamo(function)
    assert wrapped is not function and wrapped() == 1
    monkeypatch.setattr(_compat, "_DISABLE_DYNAMO", None)
    assert _compat.disable_dynamo(function) is function  # no Dynamo: nothing to keep out


def test_storage_key_is_one_per_storage() -> None:
    base = torch.zeros(4)
    assert _compat.storage_key(base.untyped_storage()) == _compat.storage_key(
        base[1:].untyped_storage()
    )
    assert _compat.storage_key(base.untyped_storage()) != _compat.storage_key(
        torch.zeros(4).untyped_storage()
    )
    empty_meta = (torch.empty(0, device="meta"), torch.empty(0, device="meta"))
    keys = {_compat.storage_key(t.untyped_storage()) for t in empty_meta}
    assert len(keys) == 2  # data_ptr() would be 0 for both
    with pytest.raises(TorchmemError, match=r"torch\.UntypedStorage\._cdata"):
        _compat._no_storage_key(base.untyped_storage())


def test_lock_is_owned(monkeypatch: pytest.MonkeyPatch) -> None:
    lock = threading.RLock()
    assert not _compat.lock_is_owned(lock)
    with lock:
        assert _compat.lock_is_owned(lock)
        seen: list[bool] = []
        other = threading.Thread(target=lambda: seen.append(_compat.lock_is_owned(lock)))
        other.start()
        other.join()
        assert seen == [False]
    monkeypatch.setattr(_compat, "_RLOCK_IS_OWNED", None)
    with pytest.raises(TorchmemError, match=r"_thread\.RLock\._is_owned"):
        _compat.lock_is_owned(lock)


def test_getframe_with_and_without_sys_getframe() -> None:
    def caller() -> tuple[types.FrameType, types.FrameType, types.FrameType]:
        return callee()

    def callee() -> tuple[types.FrameType, types.FrameType, types.FrameType]:
        return _compat.getframe(0), _compat.getframe(1), _compat._walk_frames(1)

    here, above, walked = caller()
    assert here.f_code.co_name == "callee"
    assert above is walked and above.f_code.co_name == "caller"
    with pytest.raises(ValueError, match="not deep enough"):
        _compat._walk_frames(10_000)


WITHOUT = """
import torch, torch.utils._python_dispatch as dispatch, torch._C._dynamo.eval_frame as frames
gone = [
    (dispatch, "TorchDispatchMode"),
    (dispatch, "_get_current_dispatch_mode_stack"),
    (dispatch, "_push_mode"),
    (dispatch, "_pop_mode"),
    (dispatch, "is_traceable_wrapper_subclass"),
    (torch, "_disable_dynamo"),
    (frames, "set_code_exec_strategy"),
]
saved = [(module, name, getattr(module, name)) for module, name in gone]
for module, name in gone:
    delattr(module, name)
import torchmem.meters  # torchmem looks its symbols up here, once
for module, name, value in saved:  # PyTorch itself needs them back
    setattr(module, name, value)

import torchmem
from torchmem import _compat
from torchmem.errors import TorchmemError
print(sorted(_compat.missing()))
try:
    torchmem.TensorMeter("cpu").window()
except TorchmemError as exc:
    print(exc)
with torchmem.MemTrace(device="ram", on_exit_report=False) as trace:
    pass
jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
print([r.nbytes for r in torchmem.MemReporter(objects=lambda: [jagged]).snapshot()])
"""


@pytest.mark.slow
def test_a_pytorch_without_the_private_symbols() -> None:
    """Where a release lacks them, torchmem still imports, says which feature needs what,
    and every other feature works: the RAM meter, the reporter (through the public
    fallback for wrapper subclasses)."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    missing, error, sizes = result.stdout.splitlines()
    assert missing == repr(
        sorted(
            [
                "torch.utils._python_dispatch.TorchDispatchMode",
                "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
                "torch.utils._python_dispatch._push_mode",
                "torch.utils._python_dispatch._pop_mode",
                "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
                "torch._disable_dynamo",
                "torch._C._dynamo.eval_frame.set_code_exec_strategy",
            ]
        )
    )
    assert error == textwrap.dedent(f"""\
        The CPU tensor meter needs torch.utils._python_dispatch.TorchDispatchMode, which this \
PyTorch {torch.__version__} (Python {sys.version.split()[0]}) does not have""")
    assert sizes == "[44]"  # its inner tensors: five float32 values, three int64 offsets


# Intercepting resets of the allocator's peaks ---------------------------------------------


@pytest.fixture
def pytorch_reset(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Stand-in for ``torch._C._<backend>_resetPeakMemoryStats`` of a backend named
    ``"standin"``, recording ``("reset", device)``; no interceptor installed before."""
    calls: list[tuple[str, object]] = []

    def standin_reset(device: object) -> str:
        calls.append(("reset", device))
        return "done"

    monkeypatch.setattr(torch._C, "_standin_resetPeakMemoryStats", standin_reset, raising=False)
    monkeypatch.setattr(_compat, "_interceptors", {})
    return calls


def recording_hook(calls: list[tuple[str, object]]) -> _compat.PeakResetHook:
    def hook(device: object, reset: Callable[[object], object]) -> object:
        calls.append(("hook", device))
        return reset(device)

    return hook


def test_peak_resets_are_intercepted_until_given_back(
    pytorch_reset: list[tuple[str, object]],
) -> None:
    pytorch_s = torch._C._standin_resetPeakMemoryStats
    assert _compat.peak_reset("standin") is pytorch_s
    assert _compat.intercept_peak_resets("standin", recording_hook(pytorch_reset))
    interceptor = torch._C._standin_resetPeakMemoryStats
    assert interceptor is not pytorch_s
    assert _compat.intercept_peak_resets("standin", recording_hook(pytorch_reset))
    assert torch._C._standin_resetPeakMemoryStats is interceptor  # already in place
    assert interceptor(3) == "done"
    assert pytorch_reset == [("hook", 3), ("reset", 3)]
    assert _compat.peak_reset("standin") is pytorch_s  # passing by the hook
    assert _compat.stop_intercepting_peak_resets("standin")
    assert torch._C._standin_resetPeakMemoryStats is pytorch_s
    assert not _compat.stop_intercepting_peak_resets("standin")


def test_a_function_put_over_the_interceptor_stays(
    pytorch_reset: list[tuple[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _compat.intercept_peak_resets("standin", recording_hook(pytorch_reset))
    interceptor = torch._C._standin_resetPeakMemoryStats

    def theirs(device: object) -> object:
        pytorch_reset.append(("theirs", device))
        return interceptor(device)

    monkeypatch.setattr(torch._C, "_standin_resetPeakMemoryStats", theirs)
    assert _compat.peak_reset("standin") is theirs  # they may want to see every reset
    assert not _compat.stop_intercepting_peak_resets("standin")
    assert torch._C._standin_resetPeakMemoryStats is theirs
    theirs(0)
    assert pytorch_reset == [("theirs", 0), ("hook", 0), ("reset", 0)]


def test_a_backend_without_a_peak_reset_is_not_intercepted(fresh_missing: list[str]) -> None:
    assert not _compat.intercept_peak_resets("nosuchbackend", recording_hook([]))
    assert _compat.peak_reset("nosuchbackend") is None
    assert not _compat.stop_intercepting_peak_resets("nosuchbackend")
    assert fresh_missing == []  # CPU builds lack torch._C._cuda_resetPeakMemoryStats
