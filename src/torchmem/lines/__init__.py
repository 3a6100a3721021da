"""The line profiler: the memory each line of the watched functions peaked and kept.

One module per concern: :mod:`~torchmem.lines.columns` (what can be shown),
:mod:`~torchmem.lines.state` (what is recorded, and the calls being measured),
:mod:`~torchmem.lines.settrace` and :mod:`~torchmem.lines.monitoring` (where events come
from), :mod:`~torchmem.lines.profiler` (``LineProfiler``),
:mod:`~torchmem.lines.wrapping` (decorating every kind of function and method) and
:mod:`~torchmem.lines.memlab` (pytorch_memlab's global profiler and decorators). The
records are :class:`~torchmem.records.lines.FunctionRecord` and
:class:`~torchmem.records.lines.LineRecord`.
"""

from torchmem.lines.columns import DEFAULT_COLUMNS, check_columns, valid_columns
from torchmem.lines.memlab import (
    clear_global_line_profiler,
    global_line_profiler,
    profile,
    profile_every,
    set_target_gpu,
)
from torchmem.lines.profiler import LineProfiler, LineReport
from torchmem.records.lines import FunctionRecord, LineRecord

__all__ = [
    "DEFAULT_COLUMNS",
    "FunctionRecord",
    "LineProfiler",
    "LineRecord",
    "LineReport",
    "check_columns",
    "clear_global_line_profiler",
    "global_line_profiler",
    "profile",
    "profile_every",
    "set_target_gpu",
    "valid_columns",
]
