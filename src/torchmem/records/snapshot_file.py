"""A memory snapshot's file (a pickle) read as plain data, in time and memory bounded by
its size, without running anything from it.

A pickle can run any code when loaded. :class:`SnapshotUnpickler` builds plain data only
(dicts, lists, strings, numbers, bytes, tuples, sets, booleans, None) and refuses every
global, persistent id and extension code. Before CPython's unpickler sees a byte,
:func:`check` reads the whole opcode stream: it refuses an extension code (the unpickler
would take one from copyreg's cache without asking ``find_class``), a memo index larger
than the objects that can have been made before it (the unpickler would allocate an array
of that many entries: 1 GiB from a 9-byte file), and a length that runs past the end of
the file. :func:`open_regular` opens regular files only: a FIFO would wait for a writer.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import pickle
import pickletools
import re
import reprlib
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO, NamedTuple, NoReturn

from torchmem.errors import SnapshotError

_PUT, _LONG_BINPUT, _FRAME, _STOP = ord("p"), ord("r"), 0x95, ord(".")
_EXT1, _EXT2, _EXT4 = 0x82, 0x83, 0x84
_COUNTED = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}
"""The bytes of the length that starts an argument, by ``ArgumentDescriptor.n``."""


class _Opcodes(NamedTuple):
    plain: re.Pattern[bytes]
    """A run of up to 4,096 opcodes that need no look, with their arguments."""
    fixed: dict[int, int]
    """Every other opcode with an argument of fixed bytes (or none: 0), and those bytes."""
    lines: dict[int, int]
    """Opcodes whose argument is lines (INT, PUT, GLOBAL...), and how many."""
    counted: dict[int, int]
    """Opcodes whose argument is a length then that many bytes, and the length's bytes."""


def _opcodes() -> _Opcodes:
    found = _Opcodes(re.compile(b""), {}, {}, {})
    alone, plain = [], []
    for op in pickletools.opcodes:
        code, size = ord(op.code), 0 if op.arg is None else op.arg.n
        if size == pickletools.UP_TO_NEWLINE:
            found.lines[code] = 2 if op.arg and op.arg.name == "stringnl_noescape_pair" else 1
        elif size < 0:
            found.counted[code] = _COUNTED[size]
        elif code in (_LONG_BINPUT, _FRAME, _STOP, _EXT1, _EXT2, _EXT4):
            found.fixed[code] = size
        elif size:
            plain.append(re.escape(op.code.encode("latin-1")) + b"." * size)
        else:
            alone.append(re.escape(op.code.encode("latin-1")))
    # The most frequent first: a snapshot is mostly LONG_BINGET and BINGET (its dicts' keys),
    # then LONG1 of up to 8 bytes (an address or a size in each entry of its trace).
    plain.sort(key=lambda p: p[:1] not in b"jh")
    plain.insert(2, b"[" + b"".join(alone) + b"]")
    plain += [b"\\x8a" + re.escape(bytes([n])) + b"." * n for n in range(9)]
    # Possessive (Python 3.11 on) keeps no state to backtrack to: a fifth faster.
    repeat = b"{0,4096}+" if sys.version_info >= (3, 11) else b"{0,4096}"
    pattern = re.compile(b"(?:" + b"|".join(plain) + b")" + repeat, re.DOTALL)
    return found._replace(plain=pattern)


_OPCODES = _opcodes()


def check(data: bytes, name: str, at: int = 0) -> None:
    """Read the opcodes of the pickle that starts at byte `at` of `data` up to its STOP, and
    refuse (SnapshotError) an extension code, a memo index larger than its byte offset (no
    more objects can have been made before it), an argument or frame that runs past the
    end, or an unknown opcode. A stream that ends early is left for the unpickler to
    refuse."""
    end, ops = len(data), _OPCODES
    while at < end:
        run = ops.plain.match(data, at)
        if run and run.end() > at:
            at = run.end()
            continue
        code, start = data[at], at + 1
        if code == _STOP:
            return
        if code in ops.lines:
            after = at
            for _ in range(ops.lines[code]):
                after = data.find(b"\n", after + 1)
                if after < 0:
                    return
            argument, after = data[start:after], after + 1
        elif code in ops.counted:
            width = ops.counted[code]
            argument = data[start : start + width]
            after = start + width + int.from_bytes(argument, "little")
        elif code in ops.fixed:
            argument = data[start : start + ops.fixed[code]]
            after = start + len(argument)
            if code == _FRAME:  # its opcodes come next, and must be there
                after += int.from_bytes(argument, "little")
        else:
            _fail(name, f"unknown opcode 0x{code:02x} at byte {at}")
        if after > end:
            _fail(name, f"the opcode at byte {at} runs past its end")
        if code in (_EXT1, _EXT2, _EXT4):
            signed = int.from_bytes(argument, "little", signed=code == _EXT4)
            refuse(name, f"extension code {signed}")
        if code in (_PUT, _LONG_BINPUT):
            index = (
                _memo_index(name, at, argument)
                if code == _PUT
                else int.from_bytes(argument, "little")
            )
            if index > at:
                _fail(
                    name,
                    f"at byte {at} it stores memo entry {index}, more than the objects it"
                    " can have made by then",
                )
        at = start + 8 if code == _FRAME else after


def _memo_index(name: str, at: int, line: bytes) -> int:
    """The memo index of the PUT at byte `at`, a decimal line."""
    try:
        return int(line)
    except ValueError:
        _fail(name, f"at byte {at} it stores memo entry {line[:20]!r}, not a number")


def _fail(name: str, why: str) -> NoReturn:
    raise SnapshotError(f"{name} is not a pickle: {why}")


def refuse(name: str, what: str) -> NoReturn:
    """Refuse to load `name`, which asks for `what` (a global, a persistent id...)."""
    raise SnapshotError(
        f"refused to load {name}: it asks for {what}, and a snapshot holds plain"
        " data only; nothing from it was run"
    )


class SnapshotUnpickler(pickle.Unpickler):
    """Builds plain data only, from the whole of `file`, read first and :func:`check`-ed
    when loaded: every global, persistent id and extension code is refused."""

    def __init__(self, file: IO[bytes], name: str) -> None:
        self.data = file.read()
        self.stream = io.BufferedReader(io.BytesIO(self.data))
        super().__init__(self.stream)
        self.name = name

    def load(self) -> Any:
        check(self.data, self.name, self.stream.tell())  # the next pickle, on a second load
        return super().load()

    def find_class(self, module: str, name: str) -> NoReturn:
        refuse(self.name, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> NoReturn:
        refuse(self.name, f"a persistent object {reprlib.repr(pid)}")


_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened to read, a regular file: anything else (a FIFO that would wait for a
    writer, a device that never ends, a directory) is refused before it is opened.

    Raises:
        SnapshotError: not a regular file.
        OSError: it cannot be opened.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        what = next((kind for test, kind in _KINDS if test(mode)), "special file")
        raise SnapshotError(f"{path} is not a memory snapshot: it is a {what}, not a regular file")
    # Not blocking, should a FIFO have taken its place since.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SnapshotError(f"{path} is not a memory snapshot: it is not a regular file")
    return open(fd, "rb")


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as it was before, after): a snapshot is
    millions of small containers without cycles, and while they are made (unpickled, then
    read) the collector would walk them all again and again, which more than doubles the
    time of a large one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
