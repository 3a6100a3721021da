"""Stand-ins for the few ``torch.cuda`` and NVML calls torchmem makes, for machines without
a GPU (the way ``wookayin/gpustat``'s tests stand in for NVML).

* :class:`StandInGpu` (:mod:`standins.gpu`): one physical GPU or MIG instance, shared by
  both stand-ins, so memory this process reserves through the CUDA stand-in shows up in
  what NVML reports.
* :class:`CudaStandIn` (:mod:`standins.cuda`): the ``torch.cuda`` functions torchmem
  calls, over a model of PyTorch's caching allocator with exact current and peak counters
  per device. Which devices it exposes, and in which order, follows what CUDA does under
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` (:func:`cuda_devices`).
* :class:`NvmlStandIn` (:mod:`standins.nvml`): a ``pynvml`` module that lists every
  physical device in PCI order, with MIG instances, whatever CUDA shows.

:func:`install_gpus` installs both with pytest's ``monkeypatch`` (:mod:`standins.install`);
:func:`torchmem.meters.isolated` gives a test torchmem's meter registry and NVML cache fresh.

For tests about a machine without a GPU, on every machine: :func:`hide_gpus` makes this
process see none, :func:`environ_without_gpu` is the environment for a subprocess that
must see none, and :func:`call_in_fresh_process_without_gpu` runs a measurement in a new
interpreter where CUDA is never initialised.

:class:`TracerStandIn` stands in for another ``sys.settrace`` tracer (a debugger,
coverage.py) beside the line profiler; :class:`HistoryStandIn` for PyTorch's CUDA
allocator history.
"""

from standins.cuda import CudaStandIn, StandInCUuuid, StandInDeviceProperties
from standins.gpu import (
    MIN_BLOCK,
    SMALL_SIZE,
    GiB,
    KiB,
    MiB,
    StandInAllocator,
    StandInGpu,
    cuda_devices,
    gpu_uuid,
)
from standins.history import HistoryStandIn
from standins.install import (
    StandIns,
    call_in_fresh_process_without_gpu,
    environ_without_gpu,
    hide_gpus,
    install_gpus,
)
from standins.nvml import (
    NVMLError,
    NvmlStandIn,
    StandInNvmlHandle,
    StandInNvmlMemory,
    StandInNvmlProcess,
)
from standins.tracer import TracerStandIn

__all__ = [
    "MIN_BLOCK",
    "SMALL_SIZE",
    "CudaStandIn",
    "GiB",
    "HistoryStandIn",
    "KiB",
    "MiB",
    "NVMLError",
    "NvmlStandIn",
    "StandInAllocator",
    "StandInCUuuid",
    "StandInDeviceProperties",
    "StandInGpu",
    "StandInNvmlHandle",
    "StandInNvmlMemory",
    "StandInNvmlProcess",
    "StandIns",
    "TracerStandIn",
    "call_in_fresh_process_without_gpu",
    "cuda_devices",
    "environ_without_gpu",
    "gpu_uuid",
    "hide_gpus",
    "install_gpus",
]
