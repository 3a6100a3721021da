"""The shared device model: one physical GPU or MIG instance (:class:`StandInGpu`), its
caching allocator (:class:`StandInAllocator`), and which devices CUDA shows
(:func:`cuda_devices`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KiB = 2**10
MiB = 2**20
GiB = 2**30

SMALL_SIZE = 1 * MiB
"""Largest request served from the small pool, as in PyTorch's allocator (``kSmallSize``)."""
MIN_BLOCK = 512
"""Every request is rounded up to a multiple of this, as in PyTorch (``kMinBlockSize``)."""

_POOLS = ("all", "large_pool", "small_pool")
_BYTE_STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")
_COUNT_STATS = ("allocation", "active")


def gpu_uuid(n: int, prefix: str = "GPU") -> str:
    """A distinct, well-formed UUID as NVML spells it: ``gpu_uuid(2) == "GPU-5e1f0a3c-..."``."""
    return f"{prefix}-5e1f0a3c-{n:04x}-4a7b-9c2d-{0xE0F1A2B3C4D5 + n:012x}"


# The shared device model ---------------------------------------------------------------


@dataclass
class _Counter:
    """One ``memory_stats`` quantity: ``.current``, ``.peak``, ``.allocated``, ``.freed``."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def add(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        self.peak = max(self.peak, self.current)

    def sub(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


@dataclass
class StandInAllocator:
    """Stand-in for PyTorch's CUDA caching allocator on one device, this process only.

    Counts exactly like the real one, in a simplified block model: a request is rounded
    up to :data:`MIN_BLOCK` bytes and served from the small pool up to :data:`SMALL_SIZE`,
    else the large pool; a freed block stays reserved in its pool's cache; a request takes
    what it can from its pool's cache and reserves the rest from the device (segments are
    exactly as large as needed); :meth:`empty_cache` gives every cached byte back.
    ``active`` equals ``allocated`` (there are no streams here).
    """

    counters: dict[str, _Counter] = field(
        default_factory=lambda: {
            f"{stat}.{pool}": _Counter() for stat in _BYTE_STATS + _COUNT_STATS for pool in _POOLS
        }
    )
    cached: dict[str, int] = field(default_factory=lambda: {"large_pool": 0, "small_pool": 0})
    num_alloc_retries: int = 0
    num_ooms: int = 0

    def current(self, key: str) -> int:
        return self.counters[key].current

    def peak(self, key: str) -> int:
        return self.counters[key].peak

    def _change(self, stat: str, pool: str, amount: int) -> None:
        for key in (f"{stat}.all", f"{stat}.{pool}"):
            if amount >= 0:
                self.counters[key].add(amount)
            else:
                self.counters[key].sub(-amount)

    def alloc(self, nbytes: int, capacity: int) -> int:
        """Allocate a block of `nbytes`; `capacity` is how much this allocator may reserve
        in all. Returns the block's size; raises ``torch.OutOfMemoryError`` like PyTorch,
        after giving back the cache and retrying once."""
        size, pool = _block(nbytes)
        if size == 0:
            return 0
        take = min(self.cached[pool], size)
        grow = size - take
        if self.current("reserved_bytes.all") + grow > capacity:
            self.num_alloc_retries += 1
            self.empty_cache()
            take, grow = 0, size
            if self.current("reserved_bytes.all") + grow > capacity:
                self.num_ooms += 1
                free = capacity - self.current("reserved_bytes.all")
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (stand-in). Tried to allocate {size} bytes; "
                    f"{free} bytes free"
                )
        self.cached[pool] -= take
        self._change("reserved_bytes", pool, grow)
        for stat in ("allocated_bytes", "active_bytes"):
            self._change(stat, pool, size)
        self._change("requested_bytes", pool, nbytes)
        for stat in _COUNT_STATS:
            self._change(stat, pool, 1)
        return size

    def free(self, nbytes: int) -> int:
        """Free a block allocated for `nbytes`: it stays reserved, cached in its pool."""
        size, pool = _block(nbytes)
        if size == 0:
            return 0
        if self.current(f"allocated_bytes.{pool}") < size:
            raise AssertionError(f"stand-in: freeing {nbytes} bytes that were never allocated")
        for stat in ("allocated_bytes", "active_bytes"):
            self._change(stat, pool, -size)
        self._change("requested_bytes", pool, -nbytes)
        for stat in _COUNT_STATS:
            self._change(stat, pool, -1)
        self.cached[pool] += size
        return size

    def empty_cache(self) -> None:
        for pool, cached in self.cached.items():
            self._change("reserved_bytes", pool, -cached)
            self.cached[pool] = 0

    def reset_peaks(self) -> None:
        """Every peak becomes its current value, as ``reset_peak_memory_stats`` does."""
        for counter in self.counters.values():
            counter.peak = counter.current

    def stats(self) -> dict[str, int]:
        """The flat dict ``torch.cuda.memory_stats`` returns, keys sorted as there."""
        flat = {"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}
        for key, counter in self.counters.items():
            for part in ("current", "peak", "allocated", "freed"):
                flat[f"{key}.{part}"] = getattr(counter, part)
        return dict(sorted(flat.items()))


def _block(nbytes: int) -> tuple[int, str]:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise AssertionError(f"stand-in: a block size must be a non-negative int, got {nbytes!r}")
    size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    return size, "small_pool" if size <= SMALL_SIZE else "large_pool"


@dataclass(eq=False)
class StandInGpu:
    """Stand-in for one GPU (or one MIG instance of a GPU), as CUDA and NVML both see it.

    NVML's ``used`` is what other processes and contexts hold (:attr:`used_elsewhere`)
    plus what this process's allocator has reserved here; ``free`` is the rest of
    :attr:`total`. ``cudaMemGetInfo`` reports the same numbers.
    """

    uuid: str
    """As NVML spells it: ``"GPU-..."``, or ``"MIG-..."`` for a MIG instance."""
    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GiB
    used_elsewhere: int = 0
    """Bytes held by other processes and CUDA contexts."""
    speed: int = 1
    """Relative speed, for ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (higher is faster)."""
    unallocatable: int = 0
    """Bytes reported free that ``cudaMalloc`` still cannot hand out."""
    mig_mode: int | None = None
    """NVML's current MIG mode (0 off, 1 on); None for a GPU without MIG support."""
    mig_slots: list[StandInGpu | None] = field(default_factory=list)
    """The MIG slots of this GPU (``nvmlDeviceGetMaxMigDeviceCount``); None is empty."""
    processes: dict[int, int | None] = field(default_factory=dict)
    """Bytes each compute process holds here, by process id, as
    ``nvmlDeviceGetComputeRunningProcesses`` lists them (None: NVML does not say)."""
    allocator: StandInAllocator = field(default_factory=StandInAllocator)

    @property
    def used(self) -> int:
        return self.used_elsewhere + self.allocator.current("reserved_bytes.all")

    @property
    def free(self) -> int:
        return self.total - self.used


def cuda_devices(
    gpus: list[StandInGpu],
    visible_devices: str | None = None,
    device_order: str = "FASTEST_FIRST",
) -> list[StandInGpu]:
    """The devices CUDA shows, in its order, for physical `gpus` listed in PCI order.

    Models the CUDA runtime: ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` (the default) sorts by
    speed, ties in PCI order; ``PCI_BUS_ID`` keeps PCI order. ``CUDA_VISIBLE_DEVICES``
    then picks devices by index in that order, or by UUID (``GPU-...``, ``MIG-...``, or a
    unique prefix of one); parsing stops at the first entry that names no device. MIG
    instances are visible only when named by UUID.
    """
    if device_order == "PCI_BUS_ID":
        ordered = list(gpus)
    elif device_order == "FASTEST_FIRST":
        ordered = sorted(gpus, key=lambda gpu: -gpu.speed)  # stable: ties keep PCI order
    else:
        raise AssertionError(f"stand-in: unknown CUDA_DEVICE_ORDER {device_order!r}")
    if visible_devices is None:
        return ordered
    everything = [*gpus, *(mig for gpu in gpus for mig in gpu.mig_slots if mig is not None)]
    visible: list[StandInGpu] = []
    for entry in visible_devices.split(","):
        entry = entry.strip()
        if entry.isdigit():
            found = [ordered[int(entry)]] if int(entry) < len(ordered) else []
        elif entry.startswith(("GPU-", "MIG-")):
            found = [gpu for gpu in everything if gpu.uuid.startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in visible:
            break
        visible.append(found[0])
    return visible
