"""Dropout and attention in a CUDA estimate, run as CUDA runs them
(:mod:`torchmem.estimator.cuda_paths`): their CPU kernels keep more for the backward pass
(dropout's noise as floats, attention's weights whenever dropout is on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchmem.estimator import estimate
from torchmem.estimator.cuda_paths import backend

MIB = 2**20


def test_dropout_keeps_a_mask_of_bools_on_a_gpu() -> None:
    def step() -> None:
        x = torch.randn(MIB, device="cuda", requires_grad=True)
        F.dropout(x, 0.1)

    # x and the result (4 MiB each) and CUDA's mask, a bool an element (1 MiB); the CPU's
    # kernel keeps its noise as floats instead (4 MiB).
    assert estimate(step).peak_bytes == 9 * MIB


def test_dropout_in_place_or_in_evaluation_takes_the_cpus_way_on_a_gpu_too() -> None:
    def step(inplace: bool) -> None:
        x = torch.randn(MIB, device="cuda")
        F.dropout(x, 0.1, training=inplace, inplace=inplace)

    assert estimate(step, True).peak_bytes == 2 * 4 * MIB  # x and the noise, as floats
    assert estimate(step, False).peak_bytes == 4 * MIB  # x alone


def attention(dtype: torch.dtype, dropout: float = 0.1) -> None:
    q, k, v = (
        torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    )
    F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)


@pytest.mark.parametrize(
    ("dtype", "peak"),
    [
        # memory-efficient attention: q, k, v and the output (524,288 bytes each) and a
        # float log-sum-exp per row (2 x 4 x 256 x 4 bytes)
        (torch.float32, 4 * 524_288 + 8192),
        # FlashAttention: the same, at 2 bytes an element
        (torch.bfloat16, 4 * 262_144 + 8192),
    ],
    ids=["float32-efficient", "bfloat16-flash"],
)
def test_attention_with_dropout_keeps_no_weights_on_a_gpu(dtype: torch.dtype, peak: int) -> None:
    # The CPU's composite kernel keeps the weights, the dropout's noise and the weights
    # after it: 3 x 2 MiB more for float32.
    assert estimate(attention, dtype).peak_bytes == peak


def test_attention_takes_the_composite_kernel_where_the_gpu_does() -> None:
    with sdpa_kernel([SDPBackend.MATH]):
        found = estimate(attention, torch.float32, 0.0)
    # cuBLAS's workspace (32 MiB) for the batched products; at the softmax, q, k and v,
    # q and k scaled, the weights and their softmax: 1.5 + 1 + 2 + 2 MiB.
    assert found.peak_bytes == 32 * MIB + 6 * MIB + MIB // 2


def test_the_backend_is_chosen_as_on_a_gpu() -> None:
    def qkv(dtype: torch.dtype, size: int = 64) -> list[torch.Tensor]:
        return [torch.empty(2, 4, 16, size, dtype=dtype) for _ in range(3)]

    mask = torch.zeros(16, 16)
    assert backend(*qkv(torch.bfloat16), None, False) == "flash"
    assert backend(*qkv(torch.bfloat16), mask, False) == "efficient"
    assert backend(*qkv(torch.float32), None, True) == "efficient"
    assert backend(*qkv(torch.float32, 6), None, False) == "math"  # not a multiple of 4
    assert backend(*qkv(torch.float64), None, False) == "math"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert backend(*qkv(torch.bfloat16), None, False) == "efficient"


def test_berts_training_step_is_the_peak_an_h100_measured() -> None:
    """BERT for masked language modelling (hidden 256, 4 layers of 4 heads, its default
    vocabulary and dropout), batch 4 x 128, one AdamW step: estimated at 321,888,768
    bytes before dropout and attention ran as on a GPU, 16,089,088 more (5.26%) than an
    H100's max_memory_allocated(); 305,799,680 now."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
    )

    def step() -> None:
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(config).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (4, 128), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    found = estimate(step)
    assert found.peak_bytes == 321_888_768 - 16_089_088 == 305_799_680
    assert found.reserved_bytes == 343_932_928
