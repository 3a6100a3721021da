"""torchmem: PyTorch memory, answered in one call."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("torchmem")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from torchmem.courtesy import Courtesy
from torchmem.devices import (
    GPUMemory,
    gpu_mem_allocate_mbs,
    gpu_mem_get,
    gpu_mem_get_all,
    gpu_mem_get_free,
    gpu_mem_get_free_mbs,
    gpu_mem_get_free_no_cache,
    gpu_mem_get_free_no_cache_mbs,
    gpu_mem_get_total_mbs,
    gpu_mem_get_used,
    gpu_mem_get_used_fast,
    gpu_mem_get_used_mbs,
    gpu_mem_get_used_no_cache,
    gpu_mem_get_used_no_cache_mbs,
    gpu_mem_leave_free_mbs,
    gpu_with_max_free_mem,
    nvml_handle,
    preload_pytorch,
)
from torchmem.errors import TorchmemError
from torchmem.lines import (
    DEFAULT_COLUMNS,
    FunctionRecord,
    LineProfiler,
    LineRecord,
    LineReport,
    clear_global_line_profiler,
    profile,
    profile_every,
    set_target_gpu,
    valid_columns,
)
from torchmem.meters import Meter, TensorMeter, Window, device_meter, meter
from torchmem.notebook import load_ipython_extension
from torchmem.notebook.cells import CellLogger, CellRecord, IPyGPULogger
from torchmem.oom import OOMReport, explain_oom, is_oom, oom_guard
from torchmem.restore import get_ref_free_exc_info, gpu_mem_restore, gpu_mem_restore_ctx
from torchmem.tensors import MemReporter, TensorDiff, TensorRecord, TensorReport, diff
from torchmem.trace import GPUMemTrace, MemTrace, gpu_mem_trace, mem_trace
from torchmem.units import b2mb, parse_size, readable_size

__all__ = [
    "DEFAULT_COLUMNS",
    "CellLogger",
    "CellRecord",
    "Courtesy",
    "FunctionRecord",
    "GPUMemTrace",
    "GPUMemory",
    "IPyGPULogger",
    "LineProfiler",
    "LineRecord",
    "LineReport",
    "MemReporter",
    "MemTrace",
    "Meter",
    "OOMReport",
    "TensorDiff",
    "TensorMeter",
    "TensorRecord",
    "TensorReport",
    "TorchmemError",
    "Window",
    "__version__",
    "b2mb",
    "clear_global_line_profiler",
    "device_meter",
    "diff",
    "explain_oom",
    "get_ref_free_exc_info",
    "gpu_mem_allocate_mbs",
    "gpu_mem_get",
    "gpu_mem_get_all",
    "gpu_mem_get_free",
    "gpu_mem_get_free_mbs",
    "gpu_mem_get_free_no_cache",
    "gpu_mem_get_free_no_cache_mbs",
    "gpu_mem_get_total_mbs",
    "gpu_mem_get_used",
    "gpu_mem_get_used_fast",
    "gpu_mem_get_used_mbs",
    "gpu_mem_get_used_no_cache",
    "gpu_mem_get_used_no_cache_mbs",
    "gpu_mem_leave_free_mbs",
    "gpu_mem_restore",
    "gpu_mem_restore_ctx",
    "gpu_mem_trace",
    "gpu_with_max_free_mem",
    "is_oom",
    "load_ipython_extension",
    "mem_trace",
    "meter",
    "nvml_handle",
    "oom_guard",
    "parse_size",
    "preload_pytorch",
    "profile",
    "profile_every",
    "readable_size",
    "set_target_gpu",
    "valid_columns",
]
