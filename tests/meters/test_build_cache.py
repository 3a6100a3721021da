"""The counting CPU allocator's build cache: only a whole library this user built is loaded,
from a directory no one else can write; anything else is rebuilt, or the CPU meter falls back
to the dispatch meter with one warning that says why.

The real library is built once for the module. Each test then builds through a stand-in
compiler (``$CXX``, a shell script) that copies a prepared file to its ``-o`` path and logs
each call, so that a rebuild costs nothing and can be counted. Most tests run torchmem in a
fresh process, with ``$TORCHMEM_CACHE_DIR`` in the test's own directory.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from torchmem.meters import native

pytestmark = [
    pytest.mark.slow,  # builds the library, several times
    pytest.mark.skipif(sys.platform == "win32", reason="no counting allocator there"),
]
ROOT = sys.platform != "win32" and os.geteuid() == 0

METER = (
    "import warnings, torchmem\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    m = torchmem.meter('cpu')\n"
    "print(m.backend, len(caught))\n"
    "for w in caught: print(w.message)\n"
)
FOREIGN_SOURCE = """\
#include <stdio.h>
#include <stdlib.h>
/* Runs when the library is loaded: leaves a file where $PLANTED_MARKER says. */
__attribute__((constructor)) static void planted(void) {
  const char *marker = getenv("PLANTED_MARKER");
  if (marker) { FILE *f = fopen(marker, "w"); if (f) fclose(f); }
}
int not_torchmem(void) { return 0; }
"""


@pytest.fixture(scope="module")
def real_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The counting allocator's library, built once for the module with the real compiler."""
    cache = tmp_path_factory.mktemp("real") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHMEM_CACHE_DIR", str(cache))
        try:
            return native.build()
        except native.BuildError as exc:
            pytest.skip(f"the counting allocator cannot be built here: {exc}")


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory: pytest.TempPathFactory, real_library: Path) -> Path:
    """A shared library with none of torchmem's symbols, whose constructor leaves a file
    (built with the compiler that built `real_library`)."""
    folder = tmp_path_factory.mktemp("foreign")
    (folder / "foreign.c").write_text(FOREIGN_SOURCE)
    out = folder / "foreign.so"
    command = [*native.compiler(), "-x", "c", "-shared", "-fPIC", str(folder / "foreign.c")]
    subprocess.run([*command, "-o", str(out)], check=True, capture_output=True)
    return out


def stand_in_compiler(folder: Path, output: Path, version: str = "stand-in c++ 1.0") -> Path:
    """A ``$CXX`` that prints `version` for ``--version`` and "builds" by copying `output` to
    its ``-o`` path; each call appends its arguments to ``c++.log`` beside it."""
    script = folder / "c++"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo "$*" >> '{folder / "c++.log"}'
            if [ "$1" = --version ]; then echo '{version}'; exit 0; fi
            while [ $# -gt 0 ]; do
              if [ "$1" = -o ]; then cp '{output}' "$2"; exit $?; fi
              shift
            done
            exit 1
            """
        )
    )
    script.chmod(0o755)
    return script


def builds(cxx: Path) -> int:
    """How many times the stand-in compiler `cxx` was asked to build."""
    log = cxx.with_name("c++.log")
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(line != "--version" for line in lines)


def environment(cache: Path, cxx: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "TORCHMEM_CACHE_DIR": str(cache), "CXX": str(cxx), **more}


def cached_file(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Path:
    """Where a process with `env` looks for the library."""
    monkeypatch.setenv("TORCHMEM_CACHE_DIR", env["TORCHMEM_CACHE_DIR"])
    monkeypatch.setenv("CXX", env["CXX"])
    return native.library_path()


def python(code: str, env: dict[str, str], *prefix: str) -> subprocess.CompletedProcess[str]:
    command = [*prefix, sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def meter_in_fresh_process(env: dict[str, str], *prefix: str) -> tuple[str, list[str]]:
    """The CPU meter's backend in a new process, and the warnings it gave."""
    done = python(METER, env, *prefix)
    assert done.returncode == 0, done.stderr
    first, *messages = done.stdout.splitlines()
    backend, count = first.split()
    assert int(count) == len(messages)
    return backend, messages


def private(cache: Path) -> Path:
    cache.mkdir(mode=0o700)
    cache.chmod(0o700)
    return cache


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def without_root_overrides() -> list[str]:
    """The command prefix under which even root obeys permission bits, as another user does:
    root without CAP_DAC_OVERRIDE (``setpriv``). Empty for another user."""
    if not ROOT:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root ignores permission bits, and setpriv is not here to drop that")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


# What is loaded ------------------------------------------------------------------------


def test_a_library_planted_at_the_cached_name_is_rebuilt_not_loaded(
    tmp_path, monkeypatch, real_library, foreign_library
):
    cxx = stand_in_compiler(tmp_path, real_library)
    marker = tmp_path / "constructor-ran"
    env = environment(tmp_path / "cache", cxx, PLANTED_MARKER=str(marker))
    path = cached_file(monkeypatch, env)
    private(path.parent)
    shutil.copy(foreign_library, path)
    assert meter_in_fresh_process(env) == ("allocator", [])
    assert not marker.exists()
    assert builds(cxx) == 1


def test_a_truncated_cached_library_is_rebuilt_and_the_process_lives(
    tmp_path, monkeypatch, real_library
):
    cxx = stand_in_compiler(tmp_path, real_library)
    env = environment(tmp_path / "cache", cxx)
    assert meter_in_fresh_process(env) == ("allocator", [])
    path = cached_file(monkeypatch, env)
    with path.open("r+b") as f:  # as a full disk or a killed copy leaves it
        f.truncate(path.stat().st_size // 2)
    assert meter_in_fresh_process(env) == ("allocator", [])
    assert builds(cxx) == 2


def test_a_library_without_torchmems_symbols_falls_back_with_one_warning(tmp_path, foreign_library):
    # Built and sealed as ours, so it passes the digest check: its symbols are what is missing.
    cxx = stand_in_compiler(tmp_path, foreign_library)
    backend, (message,) = meter_in_fresh_process(environment(tmp_path / "cache", cxx))
    assert backend == "dispatch"
    assert "counting CPU allocator is not available" in message
    assert "is not torchmem's library" in message
    assert "torchmem_counters" in message  # the first symbol looked up


def test_a_cached_library_is_reused_without_a_build(tmp_path, real_library):
    cxx = stand_in_compiler(tmp_path, real_library)
    env = environment(tmp_path / "cache", cxx)
    for _ in range(2):
        assert meter_in_fresh_process(env) == ("allocator", [])
    assert builds(cxx) == 1
    assert len(list((tmp_path / "cache").iterdir())) == 1


# Who may write the cache -----------------------------------------------------------------


def test_new_cache_directories_are_private_even_under_a_loose_umask(tmp_path, real_library):
    cxx = stand_in_compiler(tmp_path, real_library)
    cache = tmp_path / "made" / "for" / "cache"
    done = python("import os; os.umask(0o002)\n" + METER, environment(cache, cxx))
    assert done.stdout.split()[:2] == ["allocator", "0"], done.stderr
    assert [mode(d) for d in (tmp_path / "made", cache.parent, cache)] == [0o700] * 3
    (library,) = cache.iterdir()
    assert mode(library) == 0o700


def test_an_existing_private_cache_directory_keeps_its_mode(tmp_path, real_library):
    cxx = stand_in_compiler(tmp_path, real_library)
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o755)
    assert meter_in_fresh_process(environment(cache, cxx)) == ("allocator", [])
    assert mode(cache) == 0o755


@pytest.mark.parametrize("loose", ["directory", "library"])
def test_a_cache_writable_by_group_or_others_is_refused(tmp_path, monkeypatch, real_library, loose):
    cxx = stand_in_compiler(tmp_path, real_library)
    env = environment(tmp_path / "cache", cxx)
    assert meter_in_fresh_process(env) == ("allocator", [])  # a good library is cached
    path = cached_file(monkeypatch, env)
    (path.parent if loose == "directory" else path).chmod(0o775)
    backend, (message,) = meter_in_fresh_process(env)
    assert backend == "dispatch"
    assert "writable by group or others" in message
    assert builds(cxx) == 1


@pytest.mark.skipif(not ROOT, reason="only root can give a file to another user")
@pytest.mark.parametrize("foreign", ["directory", "library"])
def test_a_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch, real_library, foreign):
    cxx = stand_in_compiler(tmp_path, real_library)
    env = environment(tmp_path / "cache", cxx)
    assert meter_in_fresh_process(env) == ("allocator", [])
    path = cached_file(monkeypatch, env)
    os.chown(path.parent if foreign == "directory" else path, 65534, 65534)
    backend, (message,) = meter_in_fresh_process(env)
    assert backend == "dispatch"
    assert "owned by uid 65534" in message


def test_a_read_only_empty_cache_falls_back_and_torchmem_run_runs_the_script(
    tmp_path, real_library
):
    prefix = without_root_overrides()
    cxx = stand_in_compiler(tmp_path, real_library)
    cache = private(tmp_path / "cache")
    cache.chmod(0o500)
    (tmp_path / "script.py").write_text("print('the script ran')\n")
    command = [*prefix, sys.executable, "-m", "torchmem", "run", "--quiet", "script.py"]
    env = environment(cache, cxx)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "the script ran\n"), done.stderr
    assert done.stderr.count("counting CPU allocator is not available") == 1
    assert "Permission denied" in done.stderr
    assert list(cache.iterdir()) == []


def test_a_read_only_cache_holding_the_library_loads_it(tmp_path, real_library):
    prefix = without_root_overrides()
    cxx = stand_in_compiler(tmp_path, real_library)
    env = environment(tmp_path / "cache", cxx)
    assert meter_in_fresh_process(env) == ("allocator", [])
    (tmp_path / "cache").chmod(0o500)
    assert meter_in_fresh_process(env, *prefix) == ("allocator", [])
    assert builds(cxx) == 1


# Builds that did not finish ----------------------------------------------------------------


def test_a_stale_temporary_file_is_removed_by_the_next_build_and_a_fresh_one_kept(
    tmp_path, real_library
):
    cxx = stand_in_compiler(tmp_path, real_library)
    cache = private(tmp_path / "cache")
    stale, fresh = cache / "tmpkilled.so", cache / "tmprunning.so"
    for leftover in (stale, fresh):
        leftover.write_bytes(b"half a library")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    assert meter_in_fresh_process(environment(cache, cxx)) == ("allocator", [])
    assert not stale.exists()
    assert fresh.exists()  # it may be another process's build, running now


def test_an_interrupted_build_leaves_no_temporary_file(tmp_path):
    cxx = tmp_path / "c++"  # interrupts its caller (Ctrl-C) while "compiling"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\nkill -INT $PPID\nexec sleep 5\n')
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    # Ctrl-C raises in the child even where this runner ignores SIGINT (a background job
    # of a shell without job control), which the child would inherit.
    code = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    done = python(
        code + "from torchmem.meters import native\nnative.build()\n", environment(cache, cxx)
    )
    assert "KeyboardInterrupt" in done.stderr
    assert list(cache.iterdir()) == []


# What the cache's key holds ------------------------------------------------------------------


def test_the_key_holds_the_abi_and_python_headers(tmp_path, monkeypatch, real_library):
    base = cached_file(monkeypatch, environment(tmp_path / "cache", tmp_path / "c++"))
    abi = torch._C._GLIBCXX_USE_CXX11_ABI
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not abi)
    assert native.library_path() != base
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", abi)
    assert native.library_path() == base
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"include": str(tmp_path)})  # no Python.h
    assert native.library_path() != base


def test_another_compiler_builds_anew_and_none_uses_what_is_cached(tmp_path, real_library):
    """The compiler that built the library is written in it: another compiler, or another
    version of it, builds anew; where there is none (an image that ran ``torchmem build``
    and dropped its compiler), the cached library is used."""
    cache = tmp_path / "cache"
    first = stand_in_compiler(private(tmp_path / "a"), real_library, version="c++ 1.0")
    second = stand_in_compiler(private(tmp_path / "b"), real_library, version="c++ 1.0")
    for cxx in (first, first, second):  # built, reused, built by another command
        assert meter_in_fresh_process(environment(cache, cxx)) == ("allocator", [])
    assert (builds(first), builds(second)) == (1, 1)
    stand_in_compiler(tmp_path / "a", real_library, version="c++ 2.0")  # an upgrade
    assert meter_in_fresh_process(environment(cache, first)) == ("allocator", [])
    assert builds(first) == 2
    without = environment(cache, tmp_path / "no-such-compiler")
    assert meter_in_fresh_process(without) == ("allocator", [])
    assert (builds(first), builds(second)) == (2, 1)
    # Asked once per process for its version, however often the key is made.
    assert first.with_name("c++.log").read_text().count("--version") == 3


# Threads asking at once ------------------------------------------------------------------------

RACE = """\
import threading, time
import torchmem
from torchmem.meters import native

loads = []
init = native.CpuAllocatorLibrary.__init__

def counted(self, path):
    loads.append(path)
    time.sleep(0.2)  # a slow load: every thread arrives while the first one is loading
    init(self, path)

native.CpuAllocatorLibrary.__init__ = counted
barrier = threading.Barrier(4)
meters = []

def first_use():
    barrier.wait()
    meters.append(torchmem.meter("cpu"))

threads = [threading.Thread(target=first_use) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(meters), all(m is meters[0] for m in meters), meters[0].backend, len(loads))
"""


def test_threads_using_the_cpu_meter_first_at_once_get_one_meter_and_one_load(
    tmp_path, real_library
):
    cxx = stand_in_compiler(tmp_path, real_library)
    done = python(RACE, environment(tmp_path / "cache", cxx))
    assert done.stdout.split() == ["4", "True", "allocator", "1"], done.stderr
    assert builds(cxx) == 1
