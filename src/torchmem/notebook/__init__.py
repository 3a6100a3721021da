"""The IPython extension: ``%load_ext torchmem`` registers ``%mlrun`` / ``%%mlrun`` and
the per-cell memory logger's ``%memlog``.

IPython is imported only when the extension loads, never at ``import torchmem``.
"""

from __future__ import annotations

from typing import Any


def load_ipython_extension(ipython: Any) -> None:
    """Register torchmem's magics in `ipython` (what ``%load_ext torchmem`` calls):
    ``%mlrun`` / ``%%mlrun`` and ``%memlog on|off|compact``."""
    from torchmem.notebook import cells, magics

    magics.register(ipython)
    cells.register(ipython)
