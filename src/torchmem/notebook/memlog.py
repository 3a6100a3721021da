"""``%memlog on|off|compact|steps``: the per-cell memory logger as a line magic."""

from __future__ import annotations

from typing import Any

from torchmem.cells import CellLogger
from torchmem.notebook.magics import MagicHandle


class MemlogHandle(MagicHandle):
    """What :func:`register` returns: the logger ``%memlog`` drives, and a way to stop it
    and remove the magic (harmless to repeat)."""

    def __init__(self, ipython: Any, logger: CellLogger) -> None:
        super().__init__(ipython, {"line": ("memlog",)})
        self.logger = logger
        """The shell's cell logger."""

    def remove(self) -> None:
        """Stop the logger, and unregister ``%memlog`` if it is still there."""
        self.logger.stop()
        super().remove()


def register(ipython: Any) -> MemlogHandle:
    """Define the line magic ``%memlog on|off|compact|steps`` on `ipython` and return its
    handle (one per shell: calling this again returns the same one).

    ``%memlog on`` starts the three-line report after every cell, ``%memlog compact`` the
    one-line report, ``%memlog steps`` the three lines and, for a cell whose memory grows
    at each training step, the growth in words (each cell recorded: see
    :class:`~torchmem.CellLogger`'s ``steps``), ``%memlog off`` stops; ``%memlog`` alone
    says which is in force.
    """
    from IPython.core.error import UsageError

    existing = ipython.magics_manager.magics["line"].get("memlog")
    handle = getattr(existing, "handle", None)
    if isinstance(handle, MemlogHandle):
        return handle
    logger = CellLogger(shell=ipython)

    def memlog(line: str) -> None:
        """Log memory per cell: ``%memlog on``, ``compact``, ``steps``, ``off``."""
        word = line.strip().lower()
        if word in ("on", "compact", "steps"):
            logger.compact, logger.steps = word == "compact", word == "steps"
            logger.start()
        elif word == "off":
            logger.stop()
        elif word == "":
            mode = "compact" if logger.compact else "steps" if logger.steps else "on"
            print(f"memlog: {mode if logger.running else 'off'}")
        else:
            raise UsageError(f"%memlog {line.strip()!r}: expected on, off, compact or steps")

    handle = MemlogHandle(ipython, logger)
    memlog.handle = handle  # type: ignore[attr-defined]
    ipython.register_magic_function(memlog, "line", "memlog")
    return handle
