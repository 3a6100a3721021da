"""What other caching-allocator settings would have reserved, and the fragmentation at the
peak (:class:`~torchmem.records.whatif.WhatIf`): the lines under a snapshot's device and a
recorded GPU's."""

from __future__ import annotations

from torchmem.records.whatif import Outcome, WhatIf
from torchmem.render.kit import Section, signed
from torchmem.units import readable_size


def _settings(settings: str) -> str:
    return settings or "PyTorch's defaults"


def _would(outcome: Outcome, today: int) -> str:
    """``with expandable_segments:True the reserved peak would be 41.20G instead of
    44.70G (-3.50G)``."""
    change = outcome.reserved_peak_bytes - today
    line = (
        f"with {_settings(outcome.settings)} the reserved peak would be"
        f" {readable_size(outcome.reserved_peak_bytes)} instead of {readable_size(today)}"
        f" ({signed(change) if change else 'no change'})"
    )
    if outcome.out_of_memory:
        line += ", and it would run out of the allowed memory"
    elif "garbage_collection_threshold" in outcome.settings and not change:
        line += ": it acts only where a memory fraction is set"
    return line


def what_if_section(device: str, found: WhatIf) -> Section:
    """The lines of a what-if (:class:`WhatIf`) for `device` (``"cuda:0"``)."""
    title = (
        f"Allocator settings on {device}: the trace's {found.allocations:,} allocations"
        " replayed through the model of PyTorch's caching allocator, under each setting alone"
    )
    if found.settings is None or found.today is None or not found.reproduced:
        return Section(title, [(f"No what-if: {found.note}.",)], code=(0,))
    today = found.today
    rows = [
        (
            f"recorded under {_settings(found.settings)}: reserved peak"
            f" {readable_size(found.reserved_peak_bytes)}, allocated peak"
            f" {readable_size(found.allocated_peak_bytes)}; the replay reproduces both",
        ),
        (
            f"at the allocated peak {readable_size(today.fragmentation_bytes)} were reserved"
            f" but not allocated; the largest free block was"
            f" {readable_size(today.largest_free_at_peak_bytes)}",
        ),
    ]
    rows += [(_would(other, found.reserved_peak_bytes),) for other in found.alternatives]
    kept = (
        "The segments of the trace's start are kept as they were (allocated again they do"
        " not reproduce its peaks): each setting is as if changed at the trace's start."
    )
    return Section(title, rows, more=kept if found.kept else "", code=(0,))  # never cut
