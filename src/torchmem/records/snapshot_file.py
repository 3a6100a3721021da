"""A memory snapshot's file (a pickle) read as plain data, in time and memory bounded by
its size, without running anything from it.

A pickle can run any code when loaded. :class:`SnapshotUnpickler` builds plain data only
(dicts, lists, strings, numbers, bytes, tuples, sets, booleans, None) and refuses every
global, persistent id and extension code. Before CPython's unpickler sees a byte,
:func:`check` reads the whole opcode stream: it refuses an extension code (the unpickler
would take one from copyreg's cache without asking ``find_class``), a memo index larger
than the objects that can have been made before it (the unpickler would allocate an array
of that many entries: 1 GiB from a 9-byte file), a length that runs past the end of the
file, and tuples nested deeper than :data:`MAX_TUPLE_DEPTH` (hashing one, as a dict's key,
would overflow CPython's C stack: a crash). :func:`open_regular` opens regular files only:
a FIFO would wait for a writer.
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

MAX_TUPLE_DEPTH = 100
"""How deep the tuples of a snapshot's file may nest (a tuple of numbers is 1 deep; PyTorch's
snapshots hold no deeper). Hashing a tuple (a dict's key, a set's member) recurses into the
tuples in it with no limit: some tens of thousands deep, CPython's C stack overflows and the
process crashes. Lists, dicts and sets may nest deeper: hashing stops at them, CPython frees
them without recursing, and its repr and json stop at their recursion limit."""

_PUT, _LONG_BINPUT, _FRAME, _STOP = ord("p"), ord("r"), 0x95, ord(".")
_EXT1, _EXT2, _EXT4, _MARK, _LONG_BINGET = 0x82, 0x83, 0x84, ord("("), ord("j")
_TUPLES = b"t\x85\x86\x87"
"""TUPLE (of the objects since the MARK), TUPLE1, TUPLE2 and TUPLE3."""
_NUMBERS = b"N\x88\x89KMJG"
"""NONE, NEWTRUE, NEWFALSE, BININT1, BININT2, BININT and BINFLOAT (and LONG1): a tuple of
these holds no tuple."""
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
    with_tuples: re.Pattern[bytes]
    """The same, and tuples not of numbers: once MAX_TUPLE_DEPTH of them are counted."""
    fixed: dict[int, int]
    """Every other opcode with an argument of fixed bytes (or none: 0), and those bytes."""
    lines: dict[int, int]
    """Opcodes whose argument is lines (INT, PUT, GLOBAL...), and how many."""
    counted: dict[int, int]
    """Opcodes whose argument is a length then that many bytes, and the length's bytes."""
    sizes: dict[int, int]
    """Every opcode with an argument of fixed bytes (or none), and those bytes."""


def _opcodes() -> _Opcodes:
    found = _Opcodes(re.compile(b""), re.compile(b""), {}, {}, {}, {})
    alone: list[bytes] = []
    plain: list[bytes] = []
    for op in pickletools.opcodes:
        code, size = ord(op.code), 0 if op.arg is None else op.arg.n
        if size == pickletools.UP_TO_NEWLINE:
            found.lines[code] = 2 if op.arg and op.arg.name == "stringnl_noescape_pair" else 1
        elif size < 0:
            found.counted[code] = _COUNTED[size]
        else:
            found.sizes[code] = size
            if code in (_LONG_BINPUT, _FRAME, _STOP, _EXT1, _EXT2, _EXT4, *_TUPLES):
                found.fixed[code] = size
            elif code not in _NUMBERS and code != _MARK:  # those: _numbers()
                argument = b"." * size
                (plain if size else alone).append(re.escape(op.code.encode("latin-1")) + argument)
    # Possessive (Python 3.11 on) keeps no state to backtrack to: a fifth faster.
    possessive = b"+" if sys.version_info >= (3, 11) else b""
    # The most frequent first: a snapshot is mostly LONG_BINGET and BINGET (its dicts' keys),
    # then opcodes of no argument, then numbers.
    plain.sort(key=lambda p: p[:1] not in b"jh")
    plain[2:2] = [b"[" + b"".join(alone) + b"]", *_numbers(found.sizes, possessive)]
    repeat = b"{0,4096}" + possessive
    pattern = re.compile(b"(?:" + b"|".join(plain) + b")" + repeat, re.DOTALL)
    plain.append(b"[" + re.escape(_TUPLES) + b"]")
    with_tuples = re.compile(b"(?:" + b"|".join(plain) + b")" + repeat, re.DOTALL)
    return found._replace(plain=pattern, with_tuples=with_tuples)


def _numbers(sizes: dict[int, int], possessive: bytes) -> list[bytes]:
    """Steps of the run (regular expressions) for the numbers, MARK, and a tuple of numbers,
    which holds no tuple: TUPLE1 to TUPLE3 after as many numbers, or TUPLE after a MARK and
    numbers. Only a number that a number or TUPLE1 follows, or a MARK that a number or TUPLE
    follows, is tried as the start of a tuple. The others are a step with the BINGET or
    LONG_BINGET that mostly follows them (a dict's next key), if it does: fewer steps."""
    long1 = b"\\x8a(?:" + b"|".join(re.escape(bytes([n])) + b"." * n for n in range(9)) + b")"
    numbers = [long1]  # of up to 8 bytes: an address, a size or a time in a snapshot
    numbers += [re.escape(bytes([c])) + b"." * sizes[c] for c in _NUMBERS if sizes[c]]
    numbers.append(b"[" + b"".join(re.escape(bytes([c])) for c in _NUMBERS if not sizes[c]) + b"]")
    one = b"(?:" + b"|".join(numbers) + b")"
    starts = b"".join(re.escape(bytes([c])) for c in _NUMBERS) + b"\\x8a"
    then = b"(?:h.|j....|(?![\x85" + starts + b"]))"
    return [
        *(number + then for number in numbers),
        one + b"(?:\x85|" + one + b"(?:\x86|" + one + b"\x87))?" + possessive,
        b"\\((?:h.|j....|(?![t" + starts + b"]))",
        b"\\(" + one + b"{0,4096}" + possessive + b"t",
        b"\\(",
    ]


_OPCODES = _opcodes()


def check(data: bytes, name: str, at: int = 0, tuples: int = 0) -> int:
    """Read the opcodes of the pickle that starts at byte `at` of `data` up to its STOP, and
    refuse (SnapshotError) an extension code, a memo index larger than its byte offset (no
    more objects can have been made before it), an argument or frame that runs past the
    end, an unknown opcode, or tuples nested deeper than MAX_TUPLE_DEPTH. A stream that
    ends early is left for the unpickler to refuse.

    `tuples` is the count, in the pickles before this one (from byte 0 of `data`, each
    loaded to its STOP by the unpickler that loads this one: its memo holds what they
    made), of the opcodes that may make a tuple holding a tuple; returns it with this
    pickle's. Each such tuple is at most one deeper than those it holds: with fewer than
    MAX_TUPLE_DEPTH of them, none nests deeper. From there, the pickles are read again,
    opcode by opcode (:func:`_nest`)."""
    end, ops = len(data), _OPCODES
    plain = ops.plain if tuples < MAX_TUPLE_DEPTH else ops.with_tuples
    while at < end:
        run = plain.match(data, at)
        if run and run.end() > at:
            at = run.end()
            continue
        code, start = data[at], at + 1
        if code == _STOP:
            break
        if code in ops.lines:
            after = _lines_end(data, at, ops.lines[code])
            if after < 0:
                break
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
                _memo_past(name, at, index)
        if code in _TUPLES:  # not of numbers: it may hold a tuple
            tuples += 1
            if tuples == MAX_TUPLE_DEPTH:  # _nest() reads them all: no more counting
                plain = ops.with_tuples
        at = start + 8 if code == _FRAME else after
    if tuples >= MAX_TUPLE_DEPTH:
        _nest(data, name, at)
    return tuples


# What an opcode does to the stack of tuple depths that _nest() keeps, and the bytes of
# an argument of lines, or of a length then that many bytes.
_PUSH, _GET, _MEMOIZE, _STORE, _MARKS, _TO_MARK = range(6)
_TUPLE_OF, _DROP, _POP, _DUP, _NEXT, _SAME, _FAILS = range(6, 13)
_LINES, _LENGTH_THEN = -1, -2


def _steps() -> list[tuple[int, int, int]]:
    """Each opcode's (effect, number, argument's bytes), by its byte. The number is the
    objects a TUPLE1 to TUPLE3 (or EMPTY_TUPLE) takes or an APPEND, SETITEM or BUILD drops,
    or what one that takes the objects since the MARK makes of them: a tuple (1), a list,
    dict or frozenset (0), nothing (-1). The unpickler fails on plain data at any other
    opcode (a global, a call, a persistent id, an extension code)."""
    effects = {}
    for op in pickletools.opcodes:
        made = [s.name for s in op.stack_after]
        if not op.stack_before and len(made) == 1 and made[0] not in ("any", "tuple", "mark"):
            effects[ord(op.code)] = (_PUSH, 0)  # a number, string, bytes, list, dict or set
    effects |= {code: (_TUPLE_OF, n) for n, code in enumerate(b")\x85\x86\x87")}
    effects |= dict.fromkeys(b"ghj", (_GET, 0)) | dict.fromkeys(b"pqr", (_STORE, 0))
    effects |= {0x94: (_MEMOIZE, 0), _MARK: (_MARKS, 0), ord("t"): (_TO_MARK, 1)}
    effects |= dict.fromkeys(b"ld\x91", (_TO_MARK, 0)) | dict.fromkeys(b"eu\x901", (_TO_MARK, -1))
    effects |= dict.fromkeys(b"ab", (_DROP, 1)) | {ord("s"): (_DROP, 2)}  # BUILD of None
    effects |= {ord("0"): (_POP, 0), ord("2"): (_DUP, 0), _STOP: (_NEXT, 0)}
    effects |= dict.fromkeys(b"\x80\x95\x98", (_SAME, 0))  # PROTO, FRAME, READONLY_BUFFER
    ops, steps = _OPCODES, [(_FAILS, 0, 0)] * 256
    sizes = ops.sizes | dict.fromkeys(ops.lines, _LINES) | dict.fromkeys(ops.counted, _LENGTH_THEN)
    for code, size in sizes.items():
        steps[code] = (*effects.get(code, (_FAILS, 0)), size)
    return steps


_STEPS = _steps()


def _nest(data: bytes, name: str, stop: int) -> None:
    """Refuse (SnapshotError) a tuple nested deeper than MAX_TUPLE_DEPTH in the pickles of
    `data` before byte `stop` (which check() read), each loaded after the one before with
    the same memo. The unpickler's stack and memo are kept as the tuple depth of each object
    (0: not a tuple), opcode by opcode; the walk ends where the unpickler would fail."""
    steps = _STEPS
    index: int | None = None
    stack: list[int] = []
    marks: list[int] = []  # the stack's length at each MARK
    memo: dict[int, int] = {}
    at = 0
    while at < stop:
        code = data[at]
        effect, n, size = steps[code]
        after = at + 1 + size if size >= 0 else _after(data, at, size)
        if effect == _GET:  # LONG_BINGET, the most frequent, without a call
            argument = data[at + 1 : after]
            index = (
                int.from_bytes(argument, "little")
                if code == _LONG_BINGET
                else _index(code, argument)
            )
            if index not in memo:
                return
            stack.append(memo[index])
        elif effect == _PUSH:
            stack.append(0)
        elif effect in (_MEMOIZE, _STORE):
            index = len(memo) if effect == _MEMOIZE else _index(code, data[at + 1 : after])
            if index is None or len(stack) <= (marks[-1] if marks else 0):
                return
            memo[index] = stack[-1]
        elif effect == _MARKS:
            marks.append(len(stack))
        elif effect == _TO_MARK:
            if not marks:
                return
            items = stack[marks[-1] :]
            del stack[marks.pop() :]
            if n >= 0:
                stack.append(_deeper(items, name, at) if n else 0)
        elif effect == _NEXT:  # the next pickle: a new stack, the same memo
            stack.clear()
            marks.clear()
        elif effect != _SAME and not _step(stack, marks, effect, n, name, at):
            return
        at = after  # a FRAME's argument is its length: its opcodes come next


def _after(data: bytes, at: int, size: int) -> int:
    """Where the opcode at byte `at` of `data` ends, its argument being lines (`size` is
    _LINES) or a length then that many bytes (_LENGTH_THEN); past the end if it does not."""
    code = data[at]
    if size == _LINES:
        after = at
        for _ in range(_OPCODES.lines[code]):
            after = data.find(b"\n", after + 1)
        return after + 1 if after >= 0 else len(data) + 1
    width = _OPCODES.counted[code]
    return at + 1 + width + int.from_bytes(data[at + 1 : at + 1 + width], "little")


def _step(stack: list[int], marks: list[int], effect: int, n: int, name: str, at: int) -> bool:
    """What the rarer opcodes do to :func:`_nest`'s stack; False where the unpickler fails
    (too few objects since the MARK, or an opcode that fails on plain data)."""
    fence = marks[-1] if marks else 0
    if effect == _TUPLE_OF and len(stack) - n >= fence:
        items = stack[len(stack) - n :]
        del stack[len(stack) - n :]
        stack.append(_deeper(items, name, at))
    elif effect == _DROP and len(stack) - n > fence:
        del stack[len(stack) - n :]
    elif effect == _POP and marks and marks[-1] == len(stack):
        marks.pop()  # the unpickler pops a MARK first
    elif effect == _POP and len(stack) > fence:
        stack.pop()
    elif effect == _DUP and len(stack) > fence:
        stack.append(stack[-1])
    else:
        return False
    return True


def _index(code: int, argument: bytes) -> int | None:
    """The memo index of a GET or PUT opcode `code` with `argument`; None if there is none."""
    if code not in b"gp":  # BINGET, BINPUT, LONG_BINGET, LONG_BINPUT: unsigned bytes
        return int.from_bytes(argument, "little")
    try:
        index = int(argument)
    except ValueError:  # not a number, or more digits than Python converts
        return None
    return index if index >= 0 else None


def _deeper(items: list[int], name: str, at: int) -> int:
    """The depth of the tuple of `items` (their tuple depths) made at byte `at` of `name`."""
    depth = 1 + max(items, default=0)
    if depth > MAX_TUPLE_DEPTH:
        raise SnapshotError(
            f"{name} is not a memory snapshot: its tuples nest deeper than {MAX_TUPLE_DEPTH}"
            f" (at byte {at})"
        )
    return depth


def _lines_end(data: bytes, at: int, lines: int) -> int:
    """The byte of the newline that ends the argument, of `lines` lines, of the opcode at
    byte `at`; -1 where the data ends before it."""
    after = at
    for _ in range(lines):
        after = data.find(b"\n", after + 1)
        if after < 0:
            break
    return after


def _memo_past(name: str, at: int, index: int) -> NoReturn:
    _fail(
        name,
        f"at byte {at} it stores memo entry {index}, more than the objects it"
        " can have made by then",
    )


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
        self.tuples = 0  # check()'s count, over the pickles loaded so far

    def load(self) -> Any:
        # The next pickle, on a second load (with the memo of the first).
        self.tuples = check(self.data, self.name, self.stream.tell(), self.tuples)
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
