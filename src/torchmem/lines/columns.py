"""The line profiler's columns: which stats it can show for a device, and the defaults."""

from __future__ import annotations

from collections.abc import Iterable

from torchmem.resolve import DeviceLike, default_device, parse_device

DEFAULT_COLUMNS = ("active_bytes.all.peak", "reserved_bytes.all.peak")
"""pytorch_memlab's default columns, the default on a GPU: the peak of the bytes in tensors
and of the bytes the caching allocator holds, while the line ran."""

_TENSOR_DEFAULT = ("active_bytes.all.peak", "active_bytes.all.delta")
_RAM_DEFAULT = ("rss.peak", "rss.delta")

PARTS = ("peak", "current", "allocated", "freed", "delta")
"""What a column says of its stat: the highest value while the line ran, the value when it
ended, what the line allocated and freed, and its net change."""

_CUDA_STATS = tuple(
    f"{family}.{pool}"
    for family in (
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
        "allocation",
        "segment",
        "active",
        "inactive_split",
    )
    for pool in ("all", "large_pool", "small_pool")
)


def valid_columns(device: DeviceLike | None = None) -> tuple[str, ...]:
    """The column names the line profiler can show for a device (see
    :class:`~torchmem.LineProfiler`).

    ``<stat>.peak`` is the highest value while the line ran, ``<stat>.current`` the value
    when it ended, ``<stat>.allocated`` / ``<stat>.freed`` what it allocated and freed,
    and ``<stat>.delta`` its net change (allocated minus freed). On CUDA and XPU, every
    ``torch.cuda.memory_stats()`` stat (``reserved_bytes.all``, ``allocation.large_pool``,
    ...); on tensor meters (``"cpu"``, ``"meta"``, ...) ``active_bytes.all`` and its alias
    ``allocated_bytes.all``; for ``"ram"``, ``rss`` (no allocated or freed).
    """
    kind = _kind(device)
    if kind == "ram":
        return ("rss.peak", "rss.current", "rss.delta")
    stats = _CUDA_STATS if kind == "allocator" else ("active_bytes.all", "allocated_bytes.all")
    return tuple(f"{stat}.{part}" for stat in stats for part in PARTS)


def check_columns(
    columns: Iterable[str] | None, device: DeviceLike | None = None
) -> tuple[str, ...]:
    """`columns` as a tuple, or the device's default ones for ``None``. Does not initialise
    CUDA.

    Raises:
        ValueError: naming the unknown columns and listing the valid ones.
    """
    if columns is None:
        kind = _kind(device)
        return {"allocator": DEFAULT_COLUMNS, "ram": _RAM_DEFAULT}.get(kind, _TENSOR_DEFAULT)
    if isinstance(columns, str):
        columns = (columns,)
    columns = tuple(columns)
    valid = valid_columns(device)
    unknown = [c for c in columns if c not in valid]
    if unknown or not columns:
        name = default_device() if device is None else device
        raise ValueError(
            f"unknown column(s) {', '.join(map(repr, unknown)) or '(none given)'} for device"
            f" {str(name)!r}; valid columns: {', '.join(valid)}"
        )
    return columns


def _kind(device: DeviceLike | None) -> str:
    """Which meter measures `device`: ``"allocator"``, ``"tensor"`` or ``"ram"``."""
    if device == "ram":
        return "ram"
    parsed = default_device() if device is None else parse_device(device)
    return "allocator" if parsed.type in ("cuda", "xpu") else "tensor"


def with_aliases(values: dict[str, int]) -> dict[str, int]:
    """A copy of `values`; tensor meters count one quantity, which CUDA reports both as
    allocated and as active bytes, so both names are given."""
    values = dict(values)
    for part in PARTS:
        if f"allocated_bytes.all.{part}" in values:
            values.setdefault(f"active_bytes.all.{part}", values[f"allocated_bytes.all.{part}"])
    return values
