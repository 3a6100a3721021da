"""Getting memory back after an out-of-memory error in IPython and Jupyter.

IPython keeps the last traceback, and through its frames every local variable of every
function the error passed through, tensors included, so after a "CUDA out of memory"
the memory stays taken until the next error. These helpers clear those frames' locals
and collect garbage before the error reaches IPython, so the memory comes back. The
error itself is re-raised unchanged: same object, type, message and traceback lines
(only the locals shown by ``%debug`` are gone).

``TORCHMEM_TB_CLEAR_FRAMES`` (or fastai's ``FASTAI_TB_CLEAR_FRAMES``) decides when:
``"0"`` never (``%debug`` keeps working, memory stays held), ``"1"`` on every error;
unset or empty, on out-of-memory errors, ``device-side assert triggered`` and Ctrl-C.
Spaces around the value do not count, and ``false``/``no``/``off`` and
``true``/``yes``/``on`` (in any case) mean ``"0"`` and ``"1"``; any other value is a
ValueError, raised as the block starts (or the decorated function is called), before it
runs. An empty ``TORCHMEM_TB_CLEAR_FRAMES`` counts as unset, so fastai's is read.

The frames of generators and coroutines that can still be resumed are left as they are
(clearing one would finalize it: its ``finally`` would run, and it could not go on).

An out-of-memory error also gets its explanation (:func:`torchmem.explain_oom`) printed
to stderr, before the frames are cleared; a report that fails only warns.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from torchmem.oom import is_oom, print_oom_report

F = TypeVar("F", bound=Callable[..., Any])

_DEVICE_ASSERT = "device-side assert triggered"
_DEVICE_ASSERT_WARNING = (
    "When 'device-side assert triggered' error happens, it's not possible to recover and "
    "you must restart the kernel to continue. Use os.environ['CUDA_LAUNCH_BLOCKING']=\"1\" "
    "before restarting to debug"
)
_SETTINGS = ("TORCHMEM_TB_CLEAR_FRAMES", "FASTAI_TB_CLEAR_FRAMES")  # ours first: it wins
_NEVER = frozenset({"0", "false", "no", "off"})
_ALWAYS = frozenset({"1", "true", "yes", "on"})
_RESUMABLE = (
    inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ITERABLE_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
)


def get_ref_free_exc_info() -> tuple[Any, Any, Any]:
    """``sys.exc_info()`` of the error being handled, with the locals of its traceback's
    frames cleared, so that they no longer keep memory alive."""
    exc_type, exc, tb = sys.exc_info()
    _clear_frames(tb)
    return exc_type, exc, tb


def gpu_mem_restore(func: F) -> F:
    """Decorator: when `func` fails inside IPython or Jupyter, free the memory its
    traceback holds (see the module's doc for when), then re-raise the same error.

    Outside IPython it only calls `func`.
    """

    @functools.wraps(func)
    def restoring(*args: Any, **kwargs: Any) -> Any:
        if not _in_ipython():
            return func(*args, **kwargs)
        with _restoring(every_error=False):
            return func(*args, **kwargs)

    return restoring  # type: ignore[return-value]


@contextlib.contextmanager
def gpu_mem_restore_ctx() -> Iterator[None]:
    """Context manager: when the block fails, free the memory its traceback holds, then
    re-raise the same error. Unlike the decorator it acts on every error and anywhere,
    not only in IPython; ``TORCHMEM_TB_CLEAR_FRAMES="0"`` turns it off."""
    with _restoring(every_error=True):
        yield


@contextlib.contextmanager
def _restoring(every_error: bool) -> Iterator[None]:
    setting = _clear_setting()  # before the block runs: a bad value must not hide its error
    try:
        yield
    except BaseException as exc:
        if is_oom(exc):
            print_oom_report(exc)
        if _should_clear(exc, every_error, setting):
            _clear(exc.__traceback__)
        raise


def _clear_setting() -> bool | None:
    """The frame-clearing switch from the environment: True for always, False for never,
    None where neither variable is set (or both are empty).

    Raises:
        ValueError: naming the variable and its value, for a value it does not know.
    """
    for name in _SETTINGS:
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        if value.lower() in _NEVER:
            return False
        if value.lower() in _ALWAYS:
            return True
        raise ValueError(
            f"{name}={os.environ[name]!r} is not a valid setting: use '0' (never clear the"
            " traceback's frames), '1' (clear them on every error), or leave it unset or"
            " empty (clear them after out-of-memory errors and Ctrl-C)"
        )
    return None


def _should_clear(exc: BaseException, every_error: bool, setting: bool | None) -> bool:
    if setting is False:
        return False
    message = str(exc)
    if _DEVICE_ASSERT in message:
        warnings.warn(_DEVICE_ASSERT_WARNING, stacklevel=4)
        return True
    if setting or every_error:
        return True
    return isinstance(exc, KeyboardInterrupt) or is_oom(exc)


def _clear(tb: TracebackType | None) -> None:
    _clear_frames(tb)
    gc.collect()


def _clear_frames(tb: TracebackType | None) -> None:
    """Clear the locals of `tb`'s frames, except those still running (ours, the
    caller's: they cannot be cleared) and those of suspended generators and coroutines,
    which clearing would finalize (``traceback.clear_frames`` does, before Python 3.13)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    # A running frame has a caller (f_back); only a paused or finished one may be asked.
    alive = _resumable(f for f in frames if f.f_code.co_flags & _RESUMABLE and f.f_back is None)
    for frame in frames:
        if id(frame) in alive:
            continue
        with contextlib.suppress(RuntimeError):  # a frame still running
            frame.clear()


def _resumable(frames: Iterable[types.FrameType]) -> set[int]:
    """The ids of those of `frames` that a generator, coroutine or async generator still
    owns (suspended, or running). A finished one no longer refers to its frame."""
    wanted = {id(f): f for f in frames}
    if not wanted:
        return set()
    alive = set()
    for owner in gc.get_referrers(*wanted.values()):  # one pass over what gc tracks
        if isinstance(owner, types.GeneratorType):
            frame = owner.gi_frame
        elif isinstance(owner, types.CoroutineType):
            frame = owner.cr_frame
        elif isinstance(owner, types.AsyncGeneratorType):
            frame = owner.ag_frame
        else:
            continue
        if frame is not None and id(frame) in wanted:
            alive.add(id(frame))
    return alive


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    return ipython is not None and ipython.get_ipython() is not None
