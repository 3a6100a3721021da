"""Installing the stand-ins for a test (:func:`install_gpus`, :func:`isolated`), and a
machine without a GPU in this process or in a subprocess."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from standins.cuda import CudaStandIn
from standins.gpu import StandInGpu
from standins.nvml import NvmlStandIn


class StandIns(NamedTuple):
    """The stand-ins :func:`install_gpus` installed (``nvml`` is None where it is missing)."""

    cuda: CudaStandIn
    nvml: NvmlStandIn | None


def install_gpus(
    monkeypatch: pytest.MonkeyPatch,
    gpus: list[StandInGpu],
    visible_devices: str | None = None,
    device_order: str = "FASTEST_FIRST",
    nvml: str = "present",
    uuid_bytes: bool = False,
) -> StandIns:
    """Install :class:`CudaStandIn` over `gpus` and, per `nvml`, an :class:`NvmlStandIn`
    (``"present"``), one whose ``nvmlInit`` fails (``"broken"``), or none at all, so that
    ``import pynvml`` fails (``"missing"``). Both record into the same ``calls`` list."""
    cuda = CudaStandIn(gpus, visible_devices, device_order).install(monkeypatch)
    if nvml == "missing":
        NvmlStandIn.hide(monkeypatch)
        return StandIns(cuda, None)
    if nvml not in ("present", "broken"):
        raise AssertionError(f"stand-in: nvml must be present, broken or missing, not {nvml!r}")
    init_error = "Driver/library version mismatch" if nvml == "broken" else None
    lib = NvmlStandIn(gpus, init_error, uuid_bytes, calls=cuda.calls).install(monkeypatch)
    return StandIns(cuda, lib)


# No GPU ------------------------------------------------------------------------------


def hide_gpus(monkeypatch: pytest.MonkeyPatch) -> CudaStandIn:
    """Make this process see no GPU for the rest of the test, whatever the machine has:
    ``torch.cuda.is_available()`` is False and ``device_count()`` is 0 (a
    :class:`CudaStandIn` over no devices).

    The environment is left alone: were some real CUDA call to initialise CUDA during the
    test, a ``CUDA_VISIBLE_DEVICES`` changed here would stay in force for the rest of the
    process, and the tests after this one that need the real GPU would not see it.
    """
    return CudaStandIn([]).install(monkeypatch, environ=False)


def environ_without_gpu() -> dict[str, str]:
    """This process's environment with every GPU hidden (``CUDA_VISIBLE_DEVICES=""``), for
    a subprocess that must see no GPU, whatever the machine has."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


_FRESH_PROCESS = """\
import importlib.util, json, os, sys
path, qualname, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:0] = [os.path.dirname(path), sys.argv[4]]  # the test's folder, tests/
spec = importlib.util.spec_from_file_location("_fresh_process_module", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
function = module
for name in qualname.split("."):
    function = getattr(function, name)
result = function(*args)
import torch
print(json.dumps({"result": result, "cuda_initialized": torch.cuda.is_initialized()}))
"""


def call_in_fresh_process_without_gpu(function: Callable[..., Any], *args: Any) -> Any:
    """Call `function` (module level, in a test module) with `args` in a new Python process
    that sees no GPU (:func:`environ_without_gpu`), and return its result; arguments and
    result travel as JSON.

    For measurements of the whole process, such as its resident memory: there, nothing
    but the code measured runs. The test process, once earlier tests have run, has dozens
    of threads (CUDA's, PyTorch's CPU thread pool, an allocator's background purge thread)
    that fault in and free pages on their own schedule, and Linux counts resident pages
    per CPU in batches: its resident size moves by a MiB or more that no code under test
    caused. The new process imports the test module afresh and never initialises CUDA
    (this is checked).
    """
    qualname = function.__qualname__
    if "<locals>" in qualname:
        raise AssertionError(f"stand-in: {qualname} must be defined at module level")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _FRESH_PROCESS,
            inspect.getfile(function),
            qualname,
            json.dumps(args),
            str(Path(__file__).resolve().parents[1]),  # tests/, where the stand-ins are
        ],
        env=environ_without_gpu(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        raise AssertionError(f"{qualname} failed in a fresh process:\n{result.stderr}")
    answer = json.loads(result.stdout.splitlines()[-1])
    if answer["cuda_initialized"]:
        raise AssertionError(f"{qualname} initialised CUDA in a process meant to have no GPU")
    return answer["result"]
