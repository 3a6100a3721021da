"""Calls CUDA runs by other kernels than the CPU's, keeping other tensors for the
backward pass: run on the fake CPU as CUDA runs them, for a CUDA target.

- ``F.dropout`` in training: CUDA's fused kernel (``native_dropout``) keeps a bool mask
  (1 byte an element); the CPU's keeps its scaled noise in the input's dtype (4 bytes an
  element for float32). In place (``inplace=True``) both take the CPU's way.
- ``F.scaled_dot_product_attention``: CUDA takes a fused kernel where the inputs allow it
  (:func:`backend`), which keeps the output and a row's log-sum-exp, where the CPU runs
  the composite ("math") one whenever dropout is on, keeping the attention weights, the
  dropout's noise and the weights after it (each batch x heads x length x length). The
  fused kernels' random seed and offset are CPU tensors
  (:data:`~torchmem.estimator.fake.CPU_OUTPUTS`).

The backends are chosen as PyTorch's ``sdp_utils.cpp`` chooses them on a GPU of compute
capability 8.0 or more (A100, H100, H200), in its default order: FlashAttention (float16
and bfloat16, no mask), then memory-efficient attention (float32 too, and a mask), then
the composite; ``torch.backends.cuda``'s switches (``sdpa_kernel``) are read. cuDNN's
attention, which PyTorch puts first on some H100 installations for float16 and bfloat16,
keeps what FlashAttention keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


def _bound(names: tuple[str, ...], defaults: dict[str, Any], args: Any, kwargs: Any) -> Any:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.dropout`` (or ``torch.dropout``) as CUDA runs it: NotImplemented where CUDA
    takes the CPU's way too (not training, in place, ``p`` of 0 or 1, no elements)."""
    names = ("input", "p", "training", "inplace")
    got = _bound(names, {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
    if "train" in got:  # torch.dropout's name
        got["training"] = got.pop("train")
    x, p = got["input"], got["p"]
    fused = got["training"] and not got["inplace"] and 0 < p < 1 and x.numel() > 0
    return aten.native_dropout.default(x, p, True)[0] if fused else NotImplemented


def backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, causal: bool) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel a GPU runs attention by."""
    cuda: Any = torch.backends.cuda  # its switches are untyped
    tensors = (q, k, v)
    dense = all(t.dim() == 4 and t.stride(-1) == 1 for t in tensors)
    same = q.shape[:2] == k.shape[:2] == v.shape[:2] and q.dtype == k.dtype == v.dtype
    if not (dense and same):
        return "math"
    sizes = (q.shape[-1], k.shape[-1], v.shape[-1])
    flash = (
        cuda.flash_sdp_enabled()
        and mask is None
        and q.dtype in _HALF
        and len(set(sizes)) == 1
        and sizes[0] <= 256
        and not (causal and q.shape[-2] != k.shape[-2])
    )
    if flash:
        return "flash"
    align = 8 if q.dtype in _HALF else 4
    efficient = (
        cuda.mem_efficient_sdp_enabled()
        and q.dtype in (*_HALF, torch.float32)
        and sizes[0] == sizes[1]
        and all(size % align == 0 for size in sizes)
        and all(t.storage_offset() % align == 0 for t in tensors)
    )
    return "efficient" if efficient else "math"


def _additive(mask: Any, dtype: torch.dtype) -> Any:
    """A bool mask as the additive one PyTorch makes of it (``convert_boolean_attn_mask``)."""
    if mask is None or mask.dtype is not torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _aligned(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The mask as memory-efficient attention takes it (``preprocess_mask``): expanded to
    batch x heads x L x S, its last dimension padded to a multiple of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    size = mask.shape[-1]
    if size % 16:
        return F.pad(mask, (0, 16 - size % 16))[..., :size]
    if any(stride % 16 for stride in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.scaled_dot_product_attention`` as a GPU runs it (CUDA autocast's cast of its
    inputs included)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
    got = _bound(names, {**defaults, "enable_gqa": False}, args, kwargs)
    q, k, v, mask = got["query"], got["key"], got["value"], got["attn_mask"]
    if torch.is_autocast_enabled("cpu"):  # CUDA autocast, on the fake CPU
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v, mask = (
            t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in (q, k, v, mask)
        )
    mask = _additive(mask, q.dtype)
    p, causal, scale = got["dropout_p"], got["is_causal"], got["scale"]
    chosen = backend(q, k, v, mask, causal)
    if chosen == "flash":
        return aten._scaled_dot_product_flash_attention.default(
            q, k, v, p, causal, False, scale=scale
        )[0]
    if chosen == "efficient":
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        mask = None if mask is None else _aligned(mask, q, k)
        return aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, lse, p, causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math.default(
        q, k, v, mask, p, causal, None, scale=scale, enable_gqa=got["enable_gqa"]
    )[0]


PATHS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    F.dropout: dropout,
    torch.dropout: dropout,
    F.scaled_dot_product_attention: attention,
}
"""The calls whose CUDA way is run here, by the function each is called as."""
