"""torchmem: PyTorch memory, answered in one call.

Every public name is importable from here, and loaded on first use: ``import torchmem``
imports neither PyTorch nor anything else heavy, so ``torchmem --help`` answers at once.
"""

import importlib as _importlib
import typing as _typing

from torchmem._version import __version__

_EXPORTS = {
    "torchmem.cells": (
        "CellLogger",
        "IPyGPULogger",
    ),
    "torchmem.courtesy": ("Courtesy",),
    "torchmem.devices": (
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
        "gpu_with_max_free_mem",
        "nvml_handle",
        "preload_pytorch",
    ),
    "torchmem.errors": (
        "BuildError",
        "CommandError",
        "EstimateError",
        "SnapshotError",
        "TorchmemError",
        "TorchmemWarning",
        "UsageError",
    ),
    "torchmem.estimator": (
        "estimate",
        "Estimate",
        "max_batch_size",
    ),
    "torchmem.estimator.advice": ("advise", "Advice"),
    "torchmem.estimator.scale": ("min_world_size",),
    "torchmem.lines": (
        "clear_global_line_profiler",
        "DEFAULT_COLUMNS",
        "FunctionRecord",
        "LineProfiler",
        "LineRecord",
        "LineReport",
        "profile",
        "profile_every",
        "set_target_gpu",
        "valid_columns",
    ),
    "torchmem.meters": (
        "device_meter",
        "Meter",
        "meter",
        "TensorMeter",
        "Window",
    ),
    "torchmem.notebook": (
        "load_ipython_extension",
        "unload_ipython_extension",
    ),
    "torchmem.oom": (
        "explain_oom",
        "is_oom",
        "oom_guard",
        "OOMReport",
    ),
    "torchmem.ranks": (
        "gather_reports",
        "RanksReport",
    ),
    "torchmem.recording": (
        "record",
        "Recording",
        "RunReport",
    ),
    "torchmem.records.cells": ("CellRecord",),
    "torchmem.records.devices": ("GPUMemory",),
    "torchmem.records.tensors": ("TensorRecord",),
    "torchmem.resolve": ("resolve_device",),
    "torchmem.restore": (
        "get_ref_free_exc_info",
        "gpu_mem_restore",
        "gpu_mem_restore_ctx",
    ),
    "torchmem.snapshot": (
        "load_snapshot",
        "Snapshot",
        "SnapshotDiff",
    ),
    "torchmem.tensors": (
        "diff",
        "MemReporter",
        "TensorDiff",
        "TensorReport",
    ),
    "torchmem.trace": (
        "gpu_mem_trace",
        "GPUMemTrace",
        "mem_trace",
        "MemTrace",
    ),
    "torchmem.units": (
        "b2mb",
        "parse_size",
        "readable_size",
    ),
}
"""Module -> the public names it gives the package."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["__version__", *sorted(_MODULE_OF)]


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'torchmem' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if _typing.TYPE_CHECKING:
    from torchmem.cells import (
        CellLogger as CellLogger,
        IPyGPULogger as IPyGPULogger,
    )
    from torchmem.courtesy import (
        Courtesy as Courtesy,
    )
    from torchmem.devices import (
        gpu_mem_allocate_mbs as gpu_mem_allocate_mbs,
        gpu_mem_get as gpu_mem_get,
        gpu_mem_get_all as gpu_mem_get_all,
        gpu_mem_get_free as gpu_mem_get_free,
        gpu_mem_get_free_mbs as gpu_mem_get_free_mbs,
        gpu_mem_get_free_no_cache as gpu_mem_get_free_no_cache,
        gpu_mem_get_free_no_cache_mbs as gpu_mem_get_free_no_cache_mbs,
        gpu_mem_get_total_mbs as gpu_mem_get_total_mbs,
        gpu_mem_get_used as gpu_mem_get_used,
        gpu_mem_get_used_fast as gpu_mem_get_used_fast,
        gpu_mem_get_used_mbs as gpu_mem_get_used_mbs,
        gpu_mem_get_used_no_cache as gpu_mem_get_used_no_cache,
        gpu_mem_get_used_no_cache_mbs as gpu_mem_get_used_no_cache_mbs,
        gpu_mem_leave_free_mbs as gpu_mem_leave_free_mbs,
        gpu_with_max_free_mem as gpu_with_max_free_mem,
        nvml_handle as nvml_handle,
        preload_pytorch as preload_pytorch,
    )
    from torchmem.errors import (
        BuildError as BuildError,
        CommandError as CommandError,
        EstimateError as EstimateError,
        SnapshotError as SnapshotError,
        TorchmemError as TorchmemError,
        TorchmemWarning as TorchmemWarning,
        UsageError as UsageError,
    )
    from torchmem.estimator import (
        Estimate as Estimate,
        estimate as estimate,
        max_batch_size as max_batch_size,
    )
    from torchmem.estimator.advice import Advice as Advice, advise as advise
    from torchmem.estimator.scale import min_world_size as min_world_size
    from torchmem.lines import (
        DEFAULT_COLUMNS as DEFAULT_COLUMNS,
        FunctionRecord as FunctionRecord,
        LineProfiler as LineProfiler,
        LineRecord as LineRecord,
        LineReport as LineReport,
        clear_global_line_profiler as clear_global_line_profiler,
        profile as profile,
        profile_every as profile_every,
        set_target_gpu as set_target_gpu,
        valid_columns as valid_columns,
    )
    from torchmem.meters import (
        Meter as Meter,
        TensorMeter as TensorMeter,
        Window as Window,
        device_meter as device_meter,
        meter as meter,
    )
    from torchmem.notebook import (
        load_ipython_extension as load_ipython_extension,
        unload_ipython_extension as unload_ipython_extension,
    )
    from torchmem.oom import (
        OOMReport as OOMReport,
        explain_oom as explain_oom,
        is_oom as is_oom,
        oom_guard as oom_guard,
    )
    from torchmem.ranks import (
        RanksReport as RanksReport,
        gather_reports as gather_reports,
    )
    from torchmem.recording import (
        Recording as Recording,
        RunReport as RunReport,
        record as record,
    )
    from torchmem.records.cells import (
        CellRecord as CellRecord,
    )
    from torchmem.records.devices import (
        GPUMemory as GPUMemory,
    )
    from torchmem.records.tensors import (
        TensorRecord as TensorRecord,
    )
    from torchmem.resolve import (
        resolve_device as resolve_device,
    )
    from torchmem.restore import (
        get_ref_free_exc_info as get_ref_free_exc_info,
        gpu_mem_restore as gpu_mem_restore,
        gpu_mem_restore_ctx as gpu_mem_restore_ctx,
    )
    from torchmem.snapshot import (
        Snapshot as Snapshot,
        SnapshotDiff as SnapshotDiff,
        load_snapshot as load_snapshot,
    )
    from torchmem.tensors import (
        MemReporter as MemReporter,
        TensorDiff as TensorDiff,
        TensorReport as TensorReport,
        diff as diff,
    )
    from torchmem.trace import (
        GPUMemTrace as GPUMemTrace,
        MemTrace as MemTrace,
        gpu_mem_trace as gpu_mem_trace,
        mem_trace as mem_trace,
    )
    from torchmem.units import (
        b2mb as b2mb,
        parse_size as parse_size,
        readable_size as readable_size,
    )
