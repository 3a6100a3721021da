"""The caching allocator's settings that its model follows, as ``PYTORCH_CUDA_ALLOC_CONF``
writes them (``expandable_segments:True,max_split_size_mb:64``) and as a memory snapshot
records them (its ``allocator_settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchmem.records.caching import LARGE_BUFFER

MIB = 2**20


@dataclass(frozen=True)
class Settings:
    """The allocator options the model follows; the defaults are PyTorch's."""

    expandable_segments: bool = False
    """Each pool is one segment that grows in pages (``expandable_segments:True``)."""
    max_split_size: int | None = None
    """Bytes: blocks this large are never split (``max_split_size_mb``); None: no limit."""
    garbage_collection_threshold: float = 0.0
    """Fraction of the allowed memory over which cached blocks are released by age
    (``garbage_collection_threshold``); 0: never. PyTorch acts on it only where
    ``torch.cuda.set_per_process_memory_fraction`` was called."""

    def __str__(self) -> str:
        """As ``PYTORCH_CUDA_ALLOC_CONF`` writes it; ``""`` for the defaults."""
        options = []
        if self.expandable_segments:
            options.append("expandable_segments:True")
        if self.max_split_size is not None:
            options.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.garbage_collection_threshold:
            options.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(options)


def parse(conf: str) -> Settings:
    """The settings of a ``PYTORCH_CUDA_ALLOC_CONF`` string (options ``key:value`` separated
    by commas). A ValueError names an option the model does not follow or a bad value, as
    PyTorch would refuse it: ``max_split_size_mb`` must be a whole number over 20,
    ``garbage_collection_threshold`` a number strictly between 0 and 1."""
    found: dict[str, Any] = {}
    for option in conf.split(","):
        if not option.strip():
            continue
        key, colon, value = (part.strip() for part in option.partition(":"))
        if not colon or not value:
            raise ValueError(f"allocator setting {option.strip()!r}: expected key:value")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"allocator setting {option.strip()!r}: expected True or False")
            found[key] = value == "True"
        elif key == "max_split_size_mb":
            found["max_split_size"] = _max_split(value, option.strip())
        elif key == "garbage_collection_threshold":
            found[key] = _threshold(value, option.strip())
        else:
            raise ValueError(
                f"allocator setting {option.strip()!r}: the allocator model follows only"
                " expandable_segments, max_split_size_mb and garbage_collection_threshold"
            )
    return Settings(**found)


def _max_split(value: str, option: str) -> int:
    if not value.isdigit() or int(value) * MIB <= LARGE_BUFFER:
        raise ValueError(f"allocator setting {option!r}: expected a whole number of MiB over 20")
    return int(value) * MIB


def _threshold(value: str, option: str) -> float:
    try:
        threshold = float(value)
    except ValueError:
        threshold = 0.0
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"allocator setting {option!r}: expected a number between 0 and 1")
    return threshold


def recorded(settings: object) -> Settings | None:
    """The settings a snapshot's ``allocator_settings`` dict records (``{}`` or None where
    it has none: PyTorch's defaults); None where it sets an option the model does not
    follow (``roundup_power2_divisions``) or is not the dict PyTorch writes."""
    if settings is None:
        return Settings()
    if not isinstance(settings, dict):
        return None
    expandable = settings.get("expandable_segments", False)
    split = settings.get("max_split_size", -1)
    threshold = settings.get("garbage_collection_threshold", 0.0)
    divisions = settings.get("roundup_power2_divisions", {})
    if (
        type(expandable) is not bool
        or type(split) is not int
        or not isinstance(threshold, (int, float))
        or not isinstance(divisions, dict)
        or any(v not in (0, 1) for v in divisions.values())
    ):
        return None
    big = split < 0 or split >= 2**63  # PyTorch writes SIZE_MAX as -1
    return Settings(expandable, None if big else split, float(threshold))


DEFAULTS = Settings()
"""PyTorch's defaults."""
