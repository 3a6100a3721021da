"""The out-of-memory report as text."""

from __future__ import annotations

from torchmem.oom import OOMReport
from torchmem.render.tensors import ROW, size_text
from torchmem.units import readable_size


def oom_text(report: OOMReport) -> str:
    """A few lines: what was asked, the device's and the allocator's numbers, what to try."""
    asked = f": tried to allocate {readable_size(report.requested)}" if report.requested else ""
    lines = [f"Out of memory on {report.device}{asked}."]
    if report.total is not None and report.free is not None:
        lines.append(
            f"Device: {readable_size(report.total)} total, {readable_size(report.free)} free"
            " (all processes)."
        )
    if report.allocated is not None and report.reserved is not None:
        idle = report.reserved - report.allocated
        lines.append(
            f"PyTorch: {readable_size(report.allocated)} in tensors,"
            f" {readable_size(report.reserved)} reserved ({readable_size(idle)} reserved but"
            " unallocated)."
        )
    if report.largest:
        lines.append(f"Largest live tensors on {report.device}:")
        lines.extend(
            ROW.format(f"  {r.name}", size_text(r.shape), readable_size(r.nbytes))
            for r in report.largest
        )
    lines.append("What to try:")
    lines.extend(f"- {hint}" for hint in report.hints)
    return "\n".join(lines)
