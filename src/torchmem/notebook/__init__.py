"""The IPython extension: ``%load_ext torchmem`` registers ``%mlrun`` / ``%%mlrun`` and
the per-cell memory logger's ``%memlog``; ``%unload_ext torchmem`` removes them.

IPython is imported only when the extension loads, never at ``import torchmem``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchmem.notebook.magics import MagicHandle

_loaded: weakref.WeakKeyDictionary[Any, tuple[MagicHandle, ...]] = weakref.WeakKeyDictionary()
"""Shell -> the handles of what the extension registered there."""


def load_ipython_extension(ipython: Any) -> None:
    """Register torchmem's magics in `ipython` (what ``%load_ext torchmem`` calls):
    ``%mlrun`` / ``%%mlrun`` and ``%memlog on|off|compact|steps``."""
    from torchmem.notebook import magics, memlog

    if ipython not in _loaded:
        _loaded[ipython] = (magics.register(ipython), memlog.register(ipython))


def unload_ipython_extension(ipython: Any) -> None:
    """Remove what :func:`load_ipython_extension` registered (what ``%unload_ext
    torchmem`` calls): the magics go, and a running cell logger stops."""
    for handle in _loaded.pop(ipython, ()):
        handle.remove()
