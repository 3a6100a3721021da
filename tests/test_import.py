"""Importing torchmem starts nothing: no CUDA, no NVML, no IPython, no thread."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import torchmem

pytestmark = pytest.mark.integration

CHECK = """
import sys, threading
import torch
before = threading.active_count()
import torchmem
assert "IPython" not in sys.modules, "IPython imported"
from torchmem.meters import nvml
assert nvml.nvml.cache_info().currsize == 0, "NVML loaded"
# torch itself may import pynvml; neither may load the NVML library at import.
assert getattr(sys.modules.get("pynvml"), "_nvmlLib", None) is None, "NVML initialised"
assert not torch.cuda.is_initialized(), "CUDA initialised"
assert threading.active_count() == before, "thread started"
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
assert _get_current_dispatch_mode_stack() == [], "dispatch mode left on"
print("clean")
"""


@pytest.mark.slow
def test_import_starts_nothing():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert result.stdout == "clean\n", result.stderr


def test_the_namespace_holds_public_names_and_submodules_only():
    for name in torchmem.__all__:
        getattr(torchmem, name)
    extra = {
        name
        for name, value in vars(torchmem).items()
        if not name.startswith("_")
        and name.isidentifier()  # pytest rewrites a plugin's package: `@py_builtins`
        and name not in torchmem.__all__
        and not getattr(value, "__name__", "").startswith("torchmem.")  # a submodule
    }
    assert extra == set()
    assert dir(torchmem) == sorted(torchmem.__all__)


def test_public_names_are_exported():
    for name in torchmem.__all__:
        assert getattr(torchmem, name) is not None
    assert torchmem.gpu_mem_get_free_mbs is torchmem.gpu_mem_get_free
    assert torchmem.GPUMemory._fields == ("total", "free", "used")


def test_the_typed_imports_match_the_lazy_ones():
    """The ``TYPE_CHECKING`` imports (what type checkers and editors read) name the same
    modules and names as the table the package loads from."""
    tree = ast.parse(Path(torchmem.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)]
    typed = {
        node.module: tuple(sorted(alias.name for alias in node.names))
        for node in block.body
        if isinstance(node, ast.ImportFrom)
    }
    lazy = {module: tuple(sorted(names)) for module, names in torchmem._EXPORTS.items()}
    assert typed == lazy
