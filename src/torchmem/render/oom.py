"""The out-of-memory report as text."""

from __future__ import annotations

from torchmem.records.oom import Hint, OOMRecord
from torchmem.render.kit import size
from torchmem.render.tensors import rows, size_text
from torchmem.units import readable_size


def text(report: OOMRecord) -> str:
    """A few lines: what was asked, the device's and the allocator's numbers, the largest
    live tensors, what to try."""
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
        lines += rows(
            [(f"  {r.name}", size_text(r.shape), readable_size(r.nbytes)) for r in report.largest]
        )
    lines.extend(report.notes)
    lines.append("What to try:")
    lines.extend(f"- {hint_text(hint, report)}" for hint in report.hints)
    return "\n".join(lines)


def hint_text(hint: Hint, report: OOMRecord) -> str:
    """One hint as advice, with the figures of `report` it rests on."""
    held = size(hint.nbytes, missing="?")
    if hint.kind == "request_too_large":
        return (
            f"The request alone ({held}) is larger than the whole device"
            f" ({size(report.total, missing='?')}): a shape is probably wrong, or this work"
            " must be split (smaller batch, chunks)."
        )
    if hint.kind == "fragmentation":
        return (
            f"{held} is reserved but unallocated (fragmentation): set"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python."
        )
    if hint.kind == "autograd_history":
        return (
            f"{held} is in tensors with autograd history. Evaluating? Run"
            " it under torch.no_grad() (or torch.inference_mode()). Training? Activation"
            " checkpointing (torch.utils.checkpoint) or mixed precision (torch.autocast)"
            " keeps less for backward."
        )
    return "Use a smaller batch size."
