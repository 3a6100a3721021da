"""The counting CPU allocator's library: built from ``cpu_allocator.cpp`` with this
machine's C++ compiler against the installed torch, cached, and loaded with ``ctypes``.

The library is built once per torch version, Python version, platform, source, C++
compiler (command and version), C++ ABI and presence of Python's headers, into
``$TORCHMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/torchmem``, else ``~/.cache/torchmem``.
It includes only c10's headers and links only ``libc10``, so a build takes about a
second. ``torchmem build`` builds it ahead of time (for container images).

Loading a library runs its code, so only a library that this user built is loaded: the
cache directory is created readable by this user only, a directory or library that is
another user's or writable by group or others is refused, and a library that does not end
with the digest its build appended (truncated, replaced) is built anew. A refusal, like a
failed build, is a :class:`BuildError`: the CPU meter falls back to its dispatch mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from torchmem._compat import cxx11_abi, getframe
from torchmem.errors import BuildError
from torchmem.records import frames

SOURCE = Path(__file__).with_name("cpu_allocator.cpp")
COUNTERS = ("current", "peak", "allocated", "freed", "allocations", "frees", "adopted")
"""The library's int64 counters, in the order it lays them out."""
NO_PYTHON_SITE = -2
"""The site index of an allocation made by a thread Python does not know (PyTorch's
intra-op workers, autograd's threads for GPUs)."""
NO_FRAME_SITE = -3
"""The site index of an allocation made with no Python frame on the thread's stack."""
_SELF_TEST_BYTES = 4096
_INSTALL_ERRORS = {1: "another CPU allocator than PyTorch's default is installed"}


class CpuAllocatorLibrary:
    """The loaded library, installed as PyTorch's CPU allocator and self-tested."""

    def __init__(self, path: Path) -> None:
        self.path = path
        """The shared library's file."""
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise BuildError(f"cannot load {path}: {exc}") from None
        self._lib = lib
        # The recording's functions touch Python objects: called with the GIL held.
        self._py = ctypes.PyDLL(str(path))
        _declare(lib, self._py)
        # Adoption reads and swaps a storage's DataPtr: with the GIL held, no Python thread
        # can start what would change it meanwhile (see torchmem_adopt).
        self._adopt = self._py.torchmem_adopt
        # Called from the hooks, many times a step: Python functions where the library has
        # Python's headers, else plain ctypes functions (ten times the cost of a call).
        self.mark: Callable[[int, int], int] = self._py.torchmem_record_mark
        """``mark(ptr, category)``: the sequence number of the allocation at `ptr` where
        this lowers its category (then :meth:`note` the mark), -1 where it does not, -2
        for a storage the log has not seen (made before it started: :attr:`adopt_row`)."""
        self.note: Callable[[int, int, int, int, int], None] = self._py.torchmem_record_note
        """``note(kind, ptr, bytes, site, ref)``: append a row (a mark, a probe) to the log."""
        self.adopt_row = self._py.torchmem_record_adopt
        """``adopt_row(ptr, bytes)``: a storage made before the log started, alive still."""
        self.reset_peak: Callable[[], None] = self._py.torchmem_reset_peak
        """Restart the peak counter at the current bytes (a Python function where the
        library has Python's headers, for the line profiler's every line)."""
        self._recordings = 0
        """How many recordings share the log now."""
        self._recordings_lock = threading.Lock()
        # A child made by fork does not record (the library stops there): nor do its own.
        os.register_at_fork(after_in_child=self._forget_recordings)
        self.records_sites = bool(lib.torchmem_record_has_sites())
        """Whether the recording can name each allocation's site (the library was built
        with Python's headers)."""
        if self.records_sites:
            self._py.torchmem_record_site.restype = ctypes.py_object
            self._py.torchmem_record_site.argtypes = [ctypes.c_int64]
            self._py.torchmem_record_functions.restype = ctypes.py_object
            self.mark, self.note, self.reset_peak = self._py.torchmem_record_functions()
            self._py.torchmem_check_walk.restype = ctypes.py_object
            self._py.torchmem_check_walk.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            self.records_sites = self._walk_reads_the_stack()
        self.counters = (ctypes.c_int64 * len(COUNTERS)).from_address(lib.torchmem_counters())
        """The live counters, indexed as :data:`COUNTERS` names them (bytes, or counts)."""
        self._dropped_rows = ctypes.c_int64.from_address(lib.torchmem_dropped_rows())
        self._install()

    def adopt(self, storage_key: int) -> int:
        """Count a storage made before the allocator was installed (by its
        ``UntypedStorage._cdata``), until it dies; return the bytes adopted (0 for one
        counted already, or not made by PyTorch's CPU allocator)."""
        return int(self._adopt(storage_key))

    def dropped_rows(self) -> int:
        """Rows the log had no memory for since the library was installed (allocations,
        frees, and the rows :meth:`note` and :attr:`adopt_row` add): each is left out of
        the log, and the counters stay exact. A recording that lost some (the difference
        of two readings) cannot be exact, and should say so."""
        return int(self._dropped_rows.value)

    def record_start(self, sites: bool) -> int:
        """Start logging every allocation and free (see :meth:`take`), with the
        allocation's stack where `sites` is true: the allocating thread's Python stack and
        the frame of it that the rule of :mod:`torchmem.records.frames` picks (the library
        follows that rule on each new code object), as the index of that stack in a table
        that keeps each distinct one once (:meth:`record_site`). A thread Python does not
        know has no site (:data:`NO_PYTHON_SITE`).

        Recordings may nest and overlap (a ``torchmem.record()`` inside ``torchmem run``,
        or inside a test the pytest plugin records): they share one log, which starts
        with the first and ends with the last. Returns the sequence number of this one's
        first row.
        """
        with self._recordings_lock:
            if self._recordings:
                first = int(self._py.torchmem_record_nest())
                if sites:
                    self._py.torchmem_record_sites()
            else:
                if self._py.torchmem_record_start(int(sites), *frames.rule_paths()):
                    raise MemoryError("no memory to start the CPU allocator's log")
                first = 0
            self._recordings += 1
        return first

    def record_stop(self) -> bool:
        """End a recording; True where it was the last one (the log stopped)."""
        with self._recordings_lock:
            # Never below 0: in a child made by fork, recordings started before it end.
            self._recordings = max(self._recordings - 1, 0)
            if self._recordings:
                return False
            self._py.torchmem_record_stop()
            return True

    def count(self) -> int:
        """The sequence number of the next row the log will hold."""
        return int(self._py.torchmem_record_count())

    def take(self, rows: int) -> np.ndarray:
        """Move up to `rows` of the log's oldest rows out of it, as an int64 array of
        shape (n, 6): the columns of :mod:`torchmem.events.tally` (time on
        ``time.monotonic_ns()``'s clock, data pointer, bytes (negative for a free), stack
        index (:data:`NO_PYTHON_SITE`, :data:`NO_FRAME_SITE`, or -1: none), the sequence
        number a free names (-1: allocated before the log started), kind)."""
        out = np.empty((rows, 6), np.int64)
        return out[: int(self._py.torchmem_record_take(out.ctypes.data, rows))]

    def record_site(self, index: int) -> tuple[int, frames.Frame, frames.Stack] | None:
        """Stack `index` of the last recording: the kind (:mod:`torchmem.records.frames`)
        and frame of the frame that names its site, and the whole Python stack, innermost
        first; None where there is no such stack."""
        if not self.records_sites:
            return None
        found = self._py.torchmem_record_site(index)
        return None if found is None else (found[0], found[1], found[2])

    def _walk_reads_the_stack(self) -> bool:
        """Whether the library's frame walk, which reads a thread's frames without the
        GIL, reads the stack that ``sys._getframe`` shows here, and tells what each frame
        is as :func:`torchmem.records.frames.kind` does: the proof, at load, of its
        assumptions on the interpreter's frames. Where it fails, no site is recorded."""
        walked, shown = self.check_walk()[1:], frames.python_stack(getframe(0))
        if not walked or len(walked) != len(shown):
            return False
        # The walk read this frame's line at its call, Python reads it here: all else agrees.
        (file, _, name, kind), here = walked[0], shown[0]
        return (file, name, kind) == (here[0], here[2], here[3]) and walked[1:] == shown[1:]

    def check_walk(self) -> list[tuple[str, int, str, int]]:
        """The calling thread's Python stack as the library's frame walk reads it, as
        ``(file, line, function, kind)`` innermost first."""
        return self._py.torchmem_check_walk(*frames.rule_paths())  # type: ignore[no-any-return]

    def record_clear(self) -> None:
        """Free the log and the sites, once no recording shares them."""
        with self._recordings_lock:
            if not self._recordings:
                self._py.torchmem_record_clear()

    def _forget_recordings(self) -> None:
        self._recordings = 0
        self._recordings_lock = threading.Lock()

    def _install(self) -> None:
        """Install the library as PyTorch's CPU allocator, and self-test it: allocations and
        frees in C++, then through a tensor, must be counted (else it is uninstalled)."""
        code = self._lib.torchmem_install()
        if code:
            # 2, 3: c10's default allocator is not the class, or does not allocate as,
            # cpu_allocator.cpp relies on (a build of PyTorch it does not know).
            reason = f"PyTorch's default CPU allocator is not as torchmem expects ({code})"
            raise BuildError(_INSTALL_ERRORS.get(code, reason))
        try:
            code = self._lib.torchmem_self_test(_SELF_TEST_BYTES)
            if code:
                raise BuildError(f"self-test failed ({code}): allocations are not counted")
            for make in (torch.empty, torch.UntypedStorage):
                allocated, freed = self.counters[2], self.counters[3]
                make(_SELF_TEST_BYTES)
                if self.counters[2] - allocated < _SELF_TEST_BYTES or self.counters[3] == freed:
                    raise BuildError(f"self-test failed: torch.{make.__name__} is not counted")
        except BuildError:
            self._lib.torchmem_uninstall()
            raise


def _declare(lib: ctypes.CDLL, py: ctypes.PyDLL) -> None:
    """Give the library's functions their C types (ctypes' default: int arguments and
    result); those only a library with Python's headers has get theirs where it has."""
    lib.torchmem_counters.restype = ctypes.c_void_p
    lib.torchmem_dropped_rows.restype = ctypes.c_void_p
    lib.torchmem_self_test.argtypes = [ctypes.c_int64]
    py.torchmem_adopt.restype = ctypes.c_int64
    py.torchmem_adopt.argtypes = [ctypes.c_void_p]
    py.torchmem_record_start.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
    py.torchmem_record_start.restype = ctypes.c_int
    py.torchmem_record_stop.restype = ctypes.c_int64
    py.torchmem_record_count.restype = ctypes.c_int64
    py.torchmem_record_nest.restype = ctypes.c_int64
    py.torchmem_record_take.restype = ctypes.c_int64
    py.torchmem_record_take.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    py.torchmem_record_mark.restype = ctypes.c_int64
    py.torchmem_record_mark.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    py.torchmem_record_note.restype = None
    py.torchmem_record_note.argtypes = [ctypes.c_int64] * 5
    py.torchmem_record_adopt.restype = None
    py.torchmem_record_adopt.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    py.torchmem_reset_peak.restype = None


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TORCHMEM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/torchmem``, else ``~/.cache/torchmem``."""
    if os.environ.get("TORCHMEM_CACHE_DIR"):
        return Path(os.environ["TORCHMEM_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "torchmem"
    return Path.home() / ".cache" / "torchmem"


def library_path() -> Path:
    """The cached library's file for this torch, Python, platform and source, C++ ABI, and
    whether Python's headers are found: a change to any of them builds the library anew.
    The compiler that built it is written in the file (:func:`build` builds anew where
    another compiler is found, and uses the cached library where none is: an image that
    ran ``torchmem build`` and then dropped its compiler)."""
    tag = f"torch{torch.__version__}-{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
    key = [tag, f"abi{_abi()}", f"python-headers{bool(_python_flags())}"]
    digest = hashlib.sha256(SOURCE.read_bytes() + "\0".join(key).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in tag)
    return cache_dir() / f"cpu_allocator-{safe}-{digest}.so"


def compiler() -> list[str]:
    """The C++ compiler's command: ``$CXX``, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise BuildError("no C++ compiler found ($CXX is unset; no c++, g++ or clang++ on PATH)")


def build(force: bool = False) -> Path:
    """Build the library unless a whole one is cached (or `force`); return its path.

    The cache directory is made readable and writable by this user only; an existing one,
    or a cached library, that is another user's or writable by group or others is refused.
    A cached file that is not whole as it was built (truncated, replaced) is built anew.

    Raises:
        BuildError: naming the compiler and its last words if the build fails, or why the
            cache cannot be used.
    """
    if sys.platform == "win32":
        raise BuildError("not supported on Windows")
    path = library_path()
    _private_directory(path.parent)
    built_by, compiler_now = _verified(path), _compiler_fingerprint()
    if not force and built_by is not None and compiler_now in (None, built_by):
        return path
    try:
        _remove_stale_builds(path.parent)
        # Built beside its final name and renamed: processes building at once (torchrun's
        # ranks) each rename a whole library into place.
        fd, partial = tempfile.mkstemp(prefix="tmp", suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            _compile(partial)
            _seal(partial, _compiler_fingerprint() or bytes(32))
            os.replace(partial, path)
        except BaseException:  # Ctrl-C too (what a killed build leaves, a later one removes)
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as exc:
        raise BuildError(f"cannot write the library into {path.parent}: {exc}") from None
    return path


_loaded: CpuAllocatorLibrary | None = None
_load_lock = threading.Lock()


def load() -> CpuAllocatorLibrary:
    """Build (if needed), load and install the counting CPU allocator, once per process
    (threads calling at once share one load).

    Raises:
        BuildError: saying why it cannot be used here.
    """
    global _loaded
    with _load_lock:
        if _loaded is None:
            path = build()
            # Checked again just before loading: loading runs the file's code, and a file
            # cut short kills the process (SIGBUS).
            if _verified(path) is None:
                raise BuildError(f"{path} changed since it was built; not loaded")
            try:
                _loaded = CpuAllocatorLibrary(path)
            except AttributeError as exc:  # ctypes' word for a missing symbol
                raise BuildError(f"{path} is not torchmem's library: {exc}") from None
        return _loaded


_TRAILER = b"\0torchmem-sha256\0"
"""What :func:`build` appends to the library it built, followed by the SHA-256 digest of
the compiler that built it (:func:`_compiler_fingerprint`) and that of everything before
this digest: the dynamic loader reads only what the library's headers name, and
:func:`load` loads no file that does not end so (truncated, half-written, put there by
something else). One file, renamed into place whole, so no second file can disagree."""
_STALE_SECONDS = 3600
"""A temporary file older than this is left by a build that was killed (builds time out
after 300 seconds): the next build removes it."""


def _compiler_fingerprint() -> bytes | None:
    """The SHA-256 digest of the compiler's command and what its ``--version`` says; None
    where there is no compiler, or it cannot say."""
    try:
        cxx = compiler()
        said = _compiler_version(tuple(cxx))
    except BuildError:
        return None
    return hashlib.sha256(f"{shlex.join(cxx)}\n{said}".encode()).digest()


@functools.cache
def _compiler_version(cxx: tuple[str, ...]) -> str:
    """What ``cxx --version`` says, asked once per process."""
    try:
        done = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{shlex.join(cxx)} --version failed: {exc}") from None
    return f"{done.returncode}\n{done.stdout}{done.stderr}"


def _abi() -> int:
    """The C++ ABI (``_GLIBCXX_USE_CXX11_ABI``) that torch was built with."""
    return int(cxx11_abi())


def _python_flags() -> list[str]:
    """The flags that compile in the recording of sites, where Python's headers are found;
    without them the allocator still counts, and records no sites."""
    python = Path(sysconfig.get_paths()["include"])
    return [f"-I{python}", "-DTORCHMEM_PYTHON"] if (python / "Python.h").exists() else []


def _compile(output: str) -> None:
    cxx = compiler()
    root = Path(torch.__file__).parent
    # PyTorch's headers need C++20 from 2.14 on, C++17 before.
    release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    standard = "-std=c++20" if release >= (2, 14) else "-std=c++17"
    command = [
        *cxx,
        *_python_flags(),
        "-O2",
        standard,
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={_abi()}",
        f"-I{root / 'include'}",
        str(SOURCE),
        "-o",
        output,
        f"-L{root / 'lib'}",
        "-lc10",
        f"-Wl,-rpath,{root / 'lib'}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{command[0]} failed: {exc}") from None
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{command[0]} exited with {done.returncode}: {' | '.join(last)}")


def _seal(path: str, compiler: bytes) -> None:
    """Append :data:`_TRAILER`, the `compiler`'s fingerprint and the digest to the built
    library; make it this user's only (the linker's mode follows the umask)."""
    with open(path, "r+b") as f:
        sealed = f.read() + _TRAILER + compiler
        f.write(_TRAILER + compiler + hashlib.sha256(sealed).digest())
    os.chmod(path, 0o700)


def _verified(path: Path) -> bytes | None:
    """The fingerprint of the compiler that built `path`, where it is a library :func:`build`
    wrote, whole; None where it is not, or there is none.

    Raises:
        BuildError: if it is another user's, writable by group or others, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BuildError(f"cannot read {path}: {exc}") from None
    with open(fd, "rb") as f:
        _check_private(os.fstat(fd), f"the library {path}")
        try:
            data = f.read()
        except OSError as exc:
            raise BuildError(f"cannot read {path}: {exc}") from None
    digest = hashlib.sha256().digest_size
    sealed, end = data[:-digest], data[-digest:]
    trailer = sealed[-len(_TRAILER) - digest :]
    if len(data) <= len(_TRAILER) + 2 * digest or not trailer.startswith(_TRAILER):
        return None
    return trailer[len(_TRAILER) :] if hashlib.sha256(sealed).digest() == end else None


def _private_directory(directory: Path) -> None:
    """Make `directory`, and any parent missing, readable and writable by this user only;
    an existing one is left as it is, and must be private already.

    Raises:
        BuildError: if it cannot be made, is another user's, or is writable by group or
            others.
    """
    missing = []
    parent = directory
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    try:
        for made in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by another process meanwhile
                made.mkdir(mode=0o700)
                os.chmod(made, 0o700)  # mkdir's mode is reduced by the umask
        info = os.stat(directory)
    except OSError as exc:
        raise BuildError(f"cannot create the cache directory {directory}: {exc}") from None
    _check_private(info, f"the cache directory {directory}")


def _check_private(info: os.stat_result, what: str) -> None:
    """Refuse a file or directory that someone else could have written: loading the
    library runs its code."""
    if info.st_uid != os.geteuid():
        raise BuildError(f"{what} is owned by uid {info.st_uid}, not by this user")
    if info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        raise BuildError(f"{what} is writable by group or others (mode {mode:o}): chmod go-w it")


def _remove_stale_builds(directory: Path) -> None:
    """Remove the temporary files that killed builds left (older than :data:`_STALE_SECONDS`;
    a younger one may be another process's build, running now)."""
    stale = time.time() - _STALE_SECONDS
    for leftover in directory.glob("tmp*.so"):
        with contextlib.suppress(OSError):  # removed by another build meanwhile
            if leftover.lstat().st_mtime < stale:
                leftover.unlink()
