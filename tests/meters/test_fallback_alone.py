"""The dispatch-mode fallback of the CPU meter, tested in a process that never had the
counting allocator.

In the suite's own processes, the fallback's tests run where another test may have loaded
the counting allocator and installed it as PyTorch's CPU allocator first: they test the
fallback on top of it. Here its tests run in a fresh pytest, with ``TORCHMEM_CPU_METER``
set to ``dispatch``, and the library is checked never to have been loaded there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a pytest of its own

TESTS = Path(__file__).resolve().parents[1]
NEVER_LOADED = """
from pathlib import Path


def pytest_sessionfinish(session):
    maps = Path("/proc/self/maps").read_text()
    assert "cpu_allocator-" not in maps, "the counting CPU allocator was loaded"
    print("\\nthe counting CPU allocator was never loaded")
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_the_fallbacks_tests_pass_where_the_counting_allocator_never_was(tmp_path: Path):
    (tmp_path / "never_loaded.py").write_text(NEVER_LOADED)
    env = {
        **os.environ,
        "TORCHMEM_CPU_METER": "dispatch",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "never_loaded",
            "-p",
            "no:cacheprovider",
            "-k",
            # the library's own log functions are tested whatever the backend: not here
            "dispatch and not hooks_log_functions",
            str(TESTS / "meters" / "test_cpu_meter.py"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "the counting CPU allocator was never loaded" in done.stdout
    assert re.search(r"\b(2[0-9]|[3-9][0-9]) passed", done.stdout), done.stdout[-2000:]
