"""GPUs by name, with the memory PyTorch reports for them, for the questions that name a
GPU instead of a capacity."""

from __future__ import annotations

from torchmem.units import parse_size

MIB = 2**20
GPUS: dict[str, int] = {
    "A100-40GB": 40_536 * MIB,
    "A100-80GB": 81_920 * MIB,
    "H100-80GB": 81_082 * MIB,
    "H200": 143_156 * MIB,
}
"""Bytes of each GPU's memory as ``torch.cuda.get_device_properties(0).total_memory``
gives it (whole MiB; an H100's varies by up to 8 MiB with the driver: the least seen is
here). The CUDA context and the caching allocator's segments come out of it."""


def capacity(gpu: int | float | str) -> int:
    """Bytes of memory of `gpu`: a name of :data:`GPUS` (any case, with or without
    ``NVIDIA`` and dashes: ``"h100 80gb"``), or a capacity in bytes or as a size
    (``"80 GiB"``)."""
    if isinstance(gpu, str):
        wanted = _key(gpu)
        for name, nbytes in GPUS.items():
            if _key(name) == wanted:
                return nbytes
        try:
            return parse_size(gpu)
        except ValueError as exc:
            raise ValueError(f"{exc}; or name a GPU: {', '.join(GPUS)}") from None
    return parse_size(gpu)


def _key(name: str) -> str:
    name = name.upper().removeprefix("NVIDIA")
    return "".join(c for c in name if c.isalnum())
