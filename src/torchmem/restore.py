"""Getting memory back after an out-of-memory error in IPython and Jupyter.

IPython keeps the last traceback, and through its frames every local variable of every
function the error passed through, tensors included, so after a "CUDA out of memory"
the memory stays taken until the next error. These helpers clear those frames' locals
and collect garbage before the error reaches IPython, so the memory comes back. The
error itself is re-raised unchanged: same object, type, message and traceback lines
(only the locals shown by ``%debug`` are gone).

``TORCHMEM_TB_CLEAR_FRAMES`` (or fastai's ``FASTAI_TB_CLEAR_FRAMES``) decides when:
``"0"`` never (``%debug`` keeps working, memory stays held), ``"1"`` on every error;
unset, on out-of-memory errors, ``device-side assert triggered`` and Ctrl-C.

An out-of-memory error also gets its explanation (:func:`torchmem.explain_oom`) printed
to stderr, before the frames are cleared.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from torchmem.oom import explain_oom, is_oom

F = TypeVar("F", bound=Callable[..., Any])

_DEVICE_ASSERT = "device-side assert triggered"
_DEVICE_ASSERT_WARNING = (
    "When 'device-side assert triggered' error happens, it's not possible to recover and "
    "you must restart the kernel to continue. Use os.environ['CUDA_LAUNCH_BLOCKING']=\"1\" "
    "before restarting to debug"
)


def get_ref_free_exc_info() -> tuple[Any, Any, Any]:
    """``sys.exc_info()`` of the error being handled, with the locals of its traceback's
    frames cleared, so that they no longer keep memory alive."""
    exc_type, exc, tb = sys.exc_info()
    traceback.clear_frames(tb)
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
    try:
        yield
    except BaseException as exc:
        if is_oom(exc):
            print(explain_oom(exc), file=sys.stderr)
        if _should_clear(exc, every_error):
            _clear(exc.__traceback__)
        raise


def _should_clear(exc: BaseException, every_error: bool) -> bool:
    setting = os.environ.get("TORCHMEM_TB_CLEAR_FRAMES", os.environ.get("FASTAI_TB_CLEAR_FRAMES"))
    if setting == "0":
        return False
    message = str(exc)
    if _DEVICE_ASSERT in message:
        warnings.warn(_DEVICE_ASSERT_WARNING, stacklevel=4)
        return True
    if setting == "1" or every_error:
        return True
    return isinstance(exc, KeyboardInterrupt) or is_oom(exc)


def _clear(tb: TracebackType | None) -> None:
    # Frames still running (ours, the caller's) cannot be cleared and are skipped.
    traceback.clear_frames(tb)
    gc.collect()


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    return ipython is not None and ipython.get_ipython() is not None
