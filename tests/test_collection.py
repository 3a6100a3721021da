"""Collecting the suite changes nothing in the process that collects it: no meter, no
allocator, no hook, no thread. What a test needs is made when it runs (the `counting`
marker asks for the CPU meter at set-up, see ``conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent

PROBE = """
import json, threading
from pathlib import Path


def pytest_collection_finish(session):
    import torch
    import torchmem.meters
    from torchmem import _compat
    from torchmem._compat.autograd import top_saved_tensors_hooks
    from torchmem.meters import allocator

    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    found = {
        "items": len(session.items),
        "counting library mapped": "cpu_allocator-" in maps,
        "meters": sorted(torchmem.meters._meters),
        "allocator windows": len(allocator._watching),
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
        "dispatch modes": len(_compat.dispatch_mode_stack()),
        "saved-tensor hooks": top_saved_tensors_hooks() is not None,
        "module hooks": sum(
            len(getattr(torch.nn.modules.module, name))
            for name in dir(torch.nn.modules.module) if name.startswith("_global_")
            and isinstance(getattr(torch.nn.modules.module, name), dict)
        ),
    }
    Path(session.config.getoption("--probe-out")).write_text(json.dumps(found))


def pytest_addoption(parser):
    parser.addoption("--probe-out")
"""


def test_collecting_the_whole_suite_changes_nothing_in_the_process(tmp_path: Path) -> None:
    (tmp_path / "collection_probe.py").write_text(PROBE)
    out = tmp_path / "found.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "collection_probe",
            f"--probe-out={out}",
            "-p",
            "no:cacheprovider",
            str(TESTS),
        ],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={  # unmeasured: collecting runs none of torchmem, and takes half the time
            **{k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")},
            "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
        },
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found.pop("items") > 1800
    assert found == {
        "counting library mapped": False,
        "meters": [],
        "allocator windows": 0,
        "threads": [],
        "dispatch modes": 0,
        "saved-tensor hooks": False,
        "module hooks": 0,
    }
