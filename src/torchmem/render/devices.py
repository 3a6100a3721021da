"""The ``devices`` report as text."""

from __future__ import annotations

from torchmem.records.devices import CPUInfo, GPUInfo, RAMInfo
from torchmem.render.text import table
from torchmem.units import readable_size


def text(gpus: list[GPUInfo], ram: RAMInfo, cpu: CPUInfo) -> str:
    """Every GPU's memory, then host RAM and CPU tensors, as a terminal shows it."""
    lines = []
    if gpus:
        rows = [
            [
                str(g.index),
                g.name,
                *map(readable_size, (g.total, g.used, g.free, g.allocated, g.reserved)),
            ]
            for g in gpus
        ]
        headers = ["GPU", "Name", "Total", "Used", "Free", "Allocated", "Reserved"]
        lines += table([headers, *rows], left=(1,))
        sources = {g.source for g in gpus}
        via = "NVML" if sources == {"nvml"} else "torch.cuda.mem_get_info"
        lines.append(
            f"Total, Used and Free: the whole device, all processes ({via}). "
            "Allocated and Reserved: this process's PyTorch allocator."
        )
    else:
        lines.append("No CUDA GPU is visible (torch.cuda.is_available() is False).")
    lines.append(
        f"RAM: this process {readable_size(ram.process)} resident; "
        f"machine {readable_size(ram.total)} total, {readable_size(ram.available)} available."
    )
    how = "counting CPU allocator" if cpu.backend == "allocator" else "dispatch-mode meter"
    lines.append(
        f"CPU tensors: {readable_size(cpu.used)}, counted by the {how}"
        f" (backend {cpu.backend!r}: {cpu.detail})."
    )
    return "\n".join(lines)
