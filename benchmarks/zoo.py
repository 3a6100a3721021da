"""Estimator model zoo: real architectures of the ``transformers`` library, each built from
its configuration at a small size (2 layers, width 128, no weights downloaded), one
training step each (a batch of 2, forward with the loss, backward, AdamW): the estimate
of the step on the CPU (``torchmem.estimate(step, device="cpu")``) against the peak the
CPU meter measures for the real step (its second run: a kernel's first use may fill
caches), and how long the estimate took. Targets: at least 95% of the models estimate
without error, their median error at most 0.5%, the largest at most 2%."""

from __future__ import annotations

import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import torchmem

BATCH, SEQUENCE, IMAGE = 2, 32, 64
TARGETS = {"estimated": 0.95, "median": 0.5, "largest": 2.0}
"""The share of models that estimate, and the median and largest error (percent)."""
WIDTH = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
DECODER = {**WIDTH, "intermediate_size": 256, "vocab_size": 1000, "num_key_value_heads": 2}


def _text(config: str, model: str, **options: Any) -> Callable[[], None]:
    return lambda: _train(config, model, options, {"input_ids": "ids", "labels": "ids"})


def _image(config: str, model: str, **options: Any) -> Callable[[], None]:
    return lambda: _train(config, model, options, {"pixel_values": "image", "labels": "label"})


def _train(config: str, model: str, options: dict[str, Any], inputs: dict[str, str]) -> None:
    import transformers

    torch.manual_seed(0)
    built = getattr(transformers, model)(getattr(transformers, config)(**options))
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-4)
    made = {
        "ids": torch.randint(0, 1000, (BATCH, SEQUENCE)),
        "image": torch.randn(BATCH, 3, IMAGE, IMAGE),
        "label": torch.randint(0, 10, (BATCH,)),
    }
    built(**{name: made[kind] for name, kind in inputs.items()}).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


MODELS: dict[str, Callable[[], None]] = {
    "GPT-2": _text(
        "GPT2Config", "GPT2LMHeadModel", n_embd=128, n_layer=2, n_head=4, vocab_size=1000
    ),
    "BERT": _text("BertConfig", "BertForMaskedLM", **WIDTH, intermediate_size=256, vocab_size=1000),
    "RoBERTa": _text(
        "RobertaConfig", "RobertaForMaskedLM", **WIDTH, intermediate_size=256, vocab_size=1000
    ),
    "DistilBERT": _text(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dim=128,
        n_layers=2,
        n_heads=4,
        hidden_dim=256,
        vocab_size=1000,
    ),
    "T5": _text(
        "T5Config",
        "T5ForConditionalGeneration",
        d_model=128,
        d_ff=256,
        num_layers=2,
        num_heads=4,
        d_kv=32,
        vocab_size=1000,
        decoder_start_token_id=0,
    ),
    "BART": _text(
        "BartConfig",
        "BartForConditionalGeneration",
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        vocab_size=1000,
    ),
    "Llama": _text("LlamaConfig", "LlamaForCausalLM", **DECODER),
    "Mistral": _text("MistralConfig", "MistralForCausalLM", **DECODER),
    "Mixtral (MoE)": _text(
        "MixtralConfig",
        "MixtralForCausalLM",
        **DECODER,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "Qwen2": _text("Qwen2Config", "Qwen2ForCausalLM", **DECODER),
    "Phi": _text("PhiConfig", "PhiForCausalLM", **DECODER),
    "Gemma": _text("GemmaConfig", "GemmaForCausalLM", **DECODER, head_dim=32),
    "OPT": _text(
        "OPTConfig",
        "OPTForCausalLM",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=256,
        word_embed_proj_dim=128,
        vocab_size=1000,
    ),
    "GPT-NeoX": _text(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", **WIDTH, intermediate_size=256, vocab_size=1000
    ),
    "ViT": _image(
        "ViTConfig",
        "ViTForImageClassification",
        **WIDTH,
        intermediate_size=256,
        image_size=IMAGE,
        patch_size=16,
        num_labels=10,
    ),
    "ConvNeXt": _image(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        hidden_sizes=[32, 64, 128, 256],
        depths=[1, 1, 1, 1],
        num_labels=10,
    ),
    "ResNet": _image(
        "ResNetConfig",
        "ResNetForImageClassification",
        hidden_sizes=[32, 64, 128, 256],
        depths=[1, 1, 1, 1],
        embedding_size=32,
        num_labels=10,
    ),
}


@dataclass
class ZooRow:
    model: str
    measured: int
    """Bytes: the real step's peak, by the CPU meter."""
    estimated: int | None
    """Bytes; None where the estimate failed."""
    seconds: float
    error: str = ""

    @property
    def percent(self) -> float | None:
        if self.estimated is None:
            return None
        return 100 * (self.estimated - self.measured) / self.measured


def measure(count: int | None = None) -> list[ZooRow]:
    """A row per model of :data:`MODELS` (the first `count` of them)."""
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            for name, step in list(MODELS.items())[:count]:
                rows.append(_measure(name, step))
        finally:
            logging.disable(logging.NOTSET)
    return rows


def _measure(name: str, step: Callable[[], None]) -> ZooRow:
    step()
    gc.collect()
    window = torchmem.meter("cpu").window()
    try:
        step()
    finally:
        measured = window.peak()
        window.close()
    started = time.perf_counter()
    try:
        estimated = torchmem.estimate(step, device="cpu").peak_bytes
    except Exception as exc:  # a model the estimator cannot run: counted, shown
        return ZooRow(name, measured, None, time.perf_counter() - started, str(exc)[:120])
    return ZooRow(name, measured, estimated, time.perf_counter() - started)


def table(rows: list[ZooRow]) -> str:
    lines = [
        "| model | measured peak | estimate | error | estimate's time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        estimate = f"{r.estimated:,} B" if r.estimated is not None else f"failed: {r.error}"
        error = f"{r.percent:+.4f}%" if r.percent is not None else "-"
        lines.append(f"| {r.model} | {r.measured:,} B | {estimate} | {error} | {r.seconds:.2f} s |")
    return "\n".join(lines)


def verdicts(rows: list[ZooRow]) -> str:
    errors = [abs(r.percent) for r in rows if r.percent is not None]
    share = len(errors) / len(rows) if rows else 0.0
    median = statistics.median(errors) if errors else float("inf")
    largest = max(errors) if errors else float("inf")

    def met(ok: bool) -> str:
        return "met" if ok else "missed"

    return "\n".join(
        [
            f"- estimated without error: {len(errors)} of {len(rows)} ({share:.0%};"
            f" target {TARGETS['estimated']:.0%}: {met(share >= TARGETS['estimated'])})",
            f"- median error: {median:.4f}% (target {TARGETS['median']}%:"
            f" {met(median <= TARGETS['median'])})",
            f"- largest error: {largest:.4f}% (target {TARGETS['largest']}%:"
            f" {met(largest <= TARGETS['largest'])})",
        ]
    )
