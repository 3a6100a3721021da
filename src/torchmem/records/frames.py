"""The one rule for "the user's own line": which frame of a stack names an allocation.

A site is the innermost frame of the user's own code. Frames of PyTorch, torchmem,
Python's standard library, generated code (``torch.compile``'s inductor files, wherever
``TORCHINDUCTOR_CACHE_DIR`` puts them, FX's ``<eval_with_key>.N``, ``<string>``, frozen
modules) and installed packages (``site-packages``, ``dist-packages``, this interpreter's
``purelib``/``platlib``) are passed over while a frame of the user's code is further
out. Where the stack holds none, the innermost installed package's frame names it, else
the innermost Python frame of any kind. C++ frames never do. An allocation made by
autograd's engine (inside its entry point before any user frame, or with only C++ frames
on the engine's thread) is named :data:`BACKWARD`; a recording that knows which module's
backward ran names it further.

Every place that names sites uses this rule: the CPU allocator's log (its C++ side, which
reads a thread's stack without the GIL, has the rule written out in C++, given
:func:`rule_paths`; tests and the library's load check it against :func:`pattern`), the CUDA
allocator history, memory snapshots and the estimator. The rule reads file
paths only (a snapshot may come from another machine), plus this interpreter's own
installation paths and this process's ``TORCHINDUCTOR_CACHE_DIR``.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import TypeVar

Frame = tuple[str, int, str]
"""``(file, line, function)``."""
Stack = tuple[Frame, ...]
"""Python frames, innermost first."""

USER, ENGINE, OTHER, LIBRARY = range(4)
"""What a Python frame is: the user's code, autograd engine's entry point, code that is
never a site while a user frame is in the stack (PyTorch, torchmem, the standard library,
generated code), an installed package. The three last are the group numbers
(``Match.lastindex``) of :func:`pattern`; no match is the user's code."""

BACKWARD = "backward"
"""The site of an allocation autograd's engine made, where no module is known."""
NO_PYTHON = "<no Python frame>"
"""The site of an allocation made with no Python frame at hand: by a thread Python does not
run, or one that had released the interpreter (PyTorch's intra-op workers)."""

_ENGINE_ENTRY = "_engine_run_backward"
"""The function of ``torch/autograd/graph.py`` that runs autograd's engine."""
_ENGINE_THREAD = "torch::autograd::Engine::"
"""A C++ frame's name on autograd engine's threads."""
_PYTHON_FILES = (".py", ".pyx", ".pyw")
_SEP = r"[/\\]"
_LINE = r"[^\n]*"


def prefixes(names: Iterable[str]) -> list[str]:
    """This interpreter's installation paths of `names` (``sysconfig``'s), each ending in
    a separator: ``("stdlib", "platstdlib")`` for the standard library,
    ``("purelib", "platlib")`` for installed packages."""
    paths = sysconfig.get_paths()
    return sorted({os.path.join(paths[n], "") for n in names if paths.get(n)})


STDLIB = ("stdlib", "platstdlib")
INSTALLED = ("purelib", "platlib")


def other_prefixes() -> list[str]:
    """The paths whose code is never a site while the user's is in the stack: the standard
    library's (:data:`STDLIB`), and the folder of torch.compile's generated code where
    ``TORCHINDUCTOR_CACHE_DIR`` moves it (its default, ``torchinductor_<user>``, is known by
    its name)."""
    return sorted({*prefixes(STDLIB), *_inductor_cache()})


@functools.cache
def _inductor_cache() -> tuple[str, ...]:
    moved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return (os.path.join(os.path.abspath(moved), ""),) if moved else ()


def rule_paths() -> tuple[bytes, bytes]:
    """:func:`other_prefixes` and :func:`prefixes` of :data:`INSTALLED`, a path a line: what
    the CPU allocator's copy of the rule reads."""
    other, installed = (
        "\n".join(paths).encode() for paths in (other_prefixes(), prefixes(INSTALLED))
    )
    return other, installed


def python_stack(frame: FrameType | None) -> list[tuple[str, int, str, int]]:
    """`frame` and the frames it was called from, as ``(file, line, function, kind)``."""
    found = []
    while frame is not None:
        code = frame.f_code
        found.append(
            (
                code.co_filename,
                frame.f_lineno,
                code_name(code),
                kind(code.co_filename, code.co_name),
            )
        )
        frame = frame.f_back
    return found


@functools.cache
def pattern() -> re.Pattern[str]:
    """The rule as one regular expression, matched (``match``) against
    ``f"{file}\\n{function}"``: group 1 is autograd engine's entry point, group 2 code that
    is never a site while the user's is in the stack, group 3 an installed package. The
    first alternative that matches decides; none is the user's code."""
    other = [
        *(re.escape(p) + r"(?!site-|dist-)" for p in other_prefixes()),
        _LINE + _SEP + r"(?:torch|torchmem|torchinductor_[^/\\\n]*)" + _SEP,
        _LINE + _SEP + r"lib" + _SEP + r"(?:python|pypy)3\.\d+" + _SEP + r"(?!site-|dist-)",
        _LINE + r"\\Lib\\(?!site-)",
        r"<(?:frozen |eval_with_key>|string>)",
    ]
    library = [
        *map(re.escape, prefixes(INSTALLED)),
        _LINE + _SEP + r"(?:site|dist)-packages" + _SEP,
    ]
    engine = _LINE + _SEP + r"torch" + _SEP + r"autograd" + _SEP + _LINE + r"\n" + _ENGINE_ENTRY
    return re.compile(f"({engine}$)|({'|'.join(other)})|({'|'.join(library)})")


@functools.lru_cache(maxsize=8192)
def kind(file: str, function: str) -> int:
    """What a Python frame of `file` running `function` is: :data:`USER`, :data:`ENGINE`,
    :data:`OTHER` or :data:`LIBRARY`."""
    found = pattern().match(f"{file}\n{function}")
    return USER if found is None else found.lastindex or USER


def is_python(file: str) -> bool:
    """Whether a frame of a recorded stack (C++ frames included) is a Python frame: its
    file is a Python source or generated code (``<...>``), not ``??``, a C++ source or a
    shared library."""
    return file.endswith(_PYTHON_FILES) or file.startswith("<")


T = TypeVar("T")


def choose(frames: Iterable[tuple[int, T]]) -> tuple[int, T] | None:
    """The frame naming an allocation, of Python `frames` given as (:func:`kind`, frame),
    innermost first: the first of the user's code or autograd's entry point (an engine
    frame further in than any user frame: the engine made it), else the first of an
    installed package, else the first; None where there is none. Reads no further than
    the frame it returns where that is the user's."""
    library: tuple[int, T] | None = None
    first: tuple[int, T] | None = None
    for found in frames:
        if found[0] in (USER, ENGINE):
            return found
        if found[0] == LIBRARY and library is None:
            library = found
        if first is None:
            first = found
    return library or first


def stack_site(frames: Sequence[Frame]) -> tuple[Frame, Stack]:
    """The site of a recorded stack (``(file, line, function)`` innermost first, C++ frames
    included, as PyTorch's allocator history keeps them) and its Python frames. With no
    Python frame, the site is :data:`BACKWARD` on autograd engine's threads, else
    :data:`NO_PYTHON`."""
    stack = tuple(f for f in frames if is_python(f[0]))
    found = choose((kind(f[0], f[2]), f) for f in stack)
    if found is None:
        backward = any(_ENGINE_THREAD in f[2] for f in frames)
        return (BACKWARD if backward else NO_PYTHON, 0, ""), stack
    return ((BACKWARD, 0, "") if found[0] == ENGINE else found[1]), stack


def code_name(code: object) -> str:
    """A code object's function name, qualified where Python says it (3.11 on)."""
    return str(getattr(code, "co_qualname", None) or getattr(code, "co_name", ""))


def own_file(file: str) -> bool:
    """Whether `file` is torchmem's own (its frames are left out of a kept stack)."""
    return file.startswith(_TORCHMEM)


_TORCHMEM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")


def _working_directory() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # removed since: no file is shown relative to it
        return None


_CWD = _working_directory()
"""The working directory torchmem started in (before the user's script could change it):
what a script's path given on the command line is relative to."""


@functools.lru_cache(maxsize=8192)
def shown(file: str) -> str:
    """`file` in the one form torchmem shows a Python file in: relative to the working
    directory torchmem started in where the file is under it, else absolute (Python names a
    script by the path it was given, ``train.py``, and a module it imports by its absolute
    path). Pseudo files (``<stdin>``, ``backward of ...``, a notebook's ``In [4]``) are
    left as they are."""
    if _CWD is None or not file.endswith(_PYTHON_FILES) or file.startswith("<"):
        return file
    full = os.path.normpath(os.path.join(_CWD, file))
    try:
        inside = os.path.relpath(full, _CWD)
    except ValueError:  # on another drive (Windows)
        return full
    return full if inside.startswith(os.pardir + os.sep) else inside


class SiteKey(tuple[str, int, str]):
    """A site's ``(file, line, function)``, equal to and hashed as that plain tuple, that
    carries the stack of the allocation it was made for: a table of bytes per site keeps
    the first key it was given, a table per stack keys them by ``(key, key.stack)``. Files
    are in the form :func:`shown` gives."""

    stack: Stack
    path: str
    """The file as the code was compiled from: where its lines are read (a notebook cell's
    file is ``In [4]`` in the key, ``<ipython-input-4-...>`` or ipykernel's file here)."""

    def __new__(cls, frame: Frame, stack: Stack) -> SiteKey:
        path = frame[0]
        named = _cell_names() or shown  # in IPython, a cell's file is named after the cell
        frame = (named(frame[0]), *frame[1:])
        stack = tuple((named(f[0]), *f[1:]) for f in stack)
        key = super().__new__(cls, frame)
        key.stack = stack
        key.path = path
        return key


_CELL = re.compile(r"In \[[^\]\n]*\]")


def located(file: str, line: int) -> str:
    """Where a site is, said as a person reads it: ``file:line``, ``file`` alone for a
    pseudo file (line 0), and a notebook cell's (:class:`SiteKey` names its file ``In [4]``)
    as IPython's tracebacks say it: ``In [4], line 3``."""
    if not line:
        return file
    return f"{file}, line {line}" if _CELL.fullmatch(file) else f"{file}:{line}"


def _cell_names() -> Callable[[str], str] | None:
    """In an IPython shell or Jupyter kernel, the function that names the file of a cell's
    code after its cell (``In [4]``, where the file is ``<ipython-input-4-...>`` or
    ipykernel's ``/tmp/ipykernel_<pid>/<hash>.py``) and any other file as :func:`shown`
    does; elsewhere None. Reads IPython's own map (``format_code_name``, as its tracebacks'
    ``Cell In[4], line 3``); imports nothing."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    label = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if label is None:
        return None

    def named(file: str) -> str:
        found = label(file)
        return shown(file) if found is None else str(found[1]).replace("In[", "In [")  # "In[4]"

    return named
