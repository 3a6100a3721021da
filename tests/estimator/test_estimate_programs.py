"""The estimator on programs as users write them: a training script shaped like nanoGPT's,
run unedited by ``torchmem estimate``, and values that decide shapes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchmem.cli.estimate import _target
from torchmem.estimator import EstimateError, estimate

pytestmark = pytest.mark.slow

MODEL = """
import torch

import torchmem
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        wide = 4 * width
        self.mlp = nn.Sequential(nn.Linear(width, wide), nn.GELU(), nn.Linear(wide, width))

    def forward(self, x):
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, width=64, heads=4, layers=2, block=32):
        super().__init__()
        self.tokens, self.places = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.places(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
"""

TRAIN = """
import os
import sys

import numpy as np
import torch

import torchmem

from model import GPT

block_size, batch_size = 32, 8


def get_batch(data):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix]
    )
    return x, y


def main():
    path = os.path.join(os.path.dirname(__file__), "train.bin")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = get_batch(data)
    logits, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""

MEASURE = """
import runpy, sys
import torchmem
sys.path.insert(0, ".")
window = None
for _ in range(2):  # the second run is measured: a kernel's first use may fill caches
    window = torchmem.meter("cpu").window()
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit:
        pass
    peak = window.peak()
    window.close()
print(peak)
"""


@pytest.fixture
def nanogpt(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0)).to(
        torch.int16
    ).numpy().tofile(tmp_path / "train.bin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_nanogpt_shaped_script_estimates_unedited_as_it_measures(nanogpt) -> None:  # type: ignore[no-untyped-def]
    measured = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, check=True
    )
    fn, args = _target("train.py", [], None)
    found = estimate(fn, *args, device="cpu")
    # The batch is the real one: offsets drawn with torch.randint are known, not taken as 1
    # (an empty slice, and an estimate 84% low, before).
    assert abs(found.peak_bytes - int(measured.stdout.split()[-1])) <= 0.02 * found.peak_bytes
    assert sys.path[0] != str(nanogpt) and "model" in sys.modules  # sys.path is put back
    run = subprocess.run(
        [sys.executable, "-m", "torchmem", "estimate", "--device", "cpu", "train.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "loss 1.0000" in run.stdout  # a 0-d fake tensor formats as its value: taken as 1
    assert "torchmem estimate: train.py on cpu" in run.stdout


def test_random_offsets_are_drawn_for_real_and_the_generator_is_put_back() -> None:
    def step() -> None:
        start = torch.randint(90, ())
        window = torch.arange(100)[start : start + 10]
        assert window.shape == (10,)
        torch.empty(int(window.sum()) * 256)  # a size computed from known values: known

    torch.manual_seed(0)
    state = torch.get_rng_state()
    start = int(torch.randint(90, ()))
    torch.set_rng_state(state)
    found = estimate(step, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    # The float32 buffer of 256 x (start + ... + start + 9), the arange's 100 int64s, the
    # offset's one: what a real run allocates.
    assert found.peak_bytes == (10 * start + 45) * 256 * 4 + 100 * 8 + 8
    assert not found.notes  # nothing was guessed


def test_an_unknown_value_used_as_a_size_is_named_not_guessed() -> None:
    def step() -> None:
        n = (torch.randn(()).abs() * 100).long()
        print(([0] * 1000)[:n])

    with pytest.raises(
        EstimateError, match=r"test_estimate_programs\.py:\d+: a tensor's value is used here"
    ):
        estimate(step, device="cpu")


def measured_cpu_peak(name: str) -> int:
    """The CPU meter's peak of a real run of this module's function `name`, in a fresh
    process (inside the whole suite the meter sees state earlier tests leave behind), at
    its second run (a kernel's first use may fill caches)."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torchmem
import test_estimate_programs as here
step = getattr(here, {name!r})
step()
window = torchmem.meter("cpu").window()
step()
print(window.peak())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


def mask_step() -> None:
    mask = torch.arange(10) % 3 == 0  # rows 0, 3, 6, 9
    rows = torch.ones(10, 1000)[mask]
    assert rows.shape == (4, 1000)
    torch.ones(1000, 1000)[torch.arange(1000) < 250].sum()


def test_a_mask_of_known_values_selects_what_a_real_run_selects() -> None:
    found = estimate(mask_step, device="cpu")
    assert found.peak_bytes == measured_cpu_peak("mask_step")
    assert found.peak_bytes >= 1000 * 1000 * 4 + 250 * 1000 * 4


def test_routing_on_unknown_values_is_named_at_the_users_line() -> None:
    def moe_step() -> None:
        tokens, router = torch.randn(16, 8), torch.randn(16, 4)
        chosen = router.argmax(-1)  # from float values: not known
        for expert in range(4):
            tokens[chosen == expert].sum()

    with pytest.raises(
        EstimateError, match=r"test_estimate_programs\.py:\d+: aten\.\w+\.\w+ cannot run"
    ):
        estimate(moe_step, device="cpu")


def test_an_operators_error_passes_through_with_a_note_of_the_line() -> None:
    def step() -> None:
        torch.randn(2, 3) @ torch.randn(4, 5)

    with pytest.raises(RuntimeError) as raised:  # the fake kernel's own message
        estimate(step, device="cpu")
    assert type(raised.value) is RuntimeError
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and "test_estimate_programs.py:" in notes[0]


def moe_step() -> None:
    """A mixture of experts routed as Mixtral's eager path routes: top-2 of 8 experts."""
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(8)
    )
    router = torch.nn.Linear(64, 8)
    x = torch.randn(512, 64, requires_grad=True)
    weights, chosen = router(x).softmax(-1).topk(2, dim=-1)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(chosen, 8).permute(2, 1, 0)
    for expert in range(8):
        slot, token = torch.where(mask[expert])
        out = out.index_add(0, token, experts[expert](x[token]) * weights[token, slot, None])
    out.sum().backward()


def test_a_mixture_of_experts_estimates_with_its_routing_assumed_even() -> None:
    found = estimate(moe_step, device="cpu")
    measured = measured_cpu_peak("moe_step")
    assert abs(found.peak_bytes - measured) <= 0.02 * measured
    assert any(note.startswith("Assumed: the choices of 1 topk call(s)") for note in found.notes)


def grouped_step() -> None:
    tokens = torch.randn(64, 32, requires_grad=True)
    weights = torch.randn(4, 32, 48, requires_grad=True)
    offsets = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    torch._grouped_mm(tokens, weights, offs=offsets).pow(2).sum().backward()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm here")
def test_grouped_matrix_products_in_float32_estimate_as_the_cpu_runs_them() -> None:
    # The meta kernel takes bfloat16 only (as CUDA's); the CPU kernel takes float32.
    found = estimate(grouped_step, device="cpu")
    assert found.peak_bytes == measured_cpu_peak("grouped_step")


def estimate_command(cwd: Path, *words: str) -> subprocess.CompletedProcess[str]:
    """``torchmem estimate *words`` in a fresh process, in `cwd`."""
    command = [sys.executable, "-m", "torchmem", "estimate", *words]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def test_the_command_line_refuses_batch_for_a_script_and_asks_for_a_forgotten_one(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "steps.py").write_text("import torch\n\ndef step(batch):\n    torch.empty(batch)\n")
    (tmp_path / "train.py").write_text("import torch\n\ntorch.empty(10)\n")

    # Ignored before: the script ran, without a word.
    script = estimate_command(tmp_path, "--device", "cpu", "--batch", "4", "train.py")
    assert script.returncode == 1
    assert "--batch takes a MODULE:FUNCTION" in script.stderr
    # A traceback through torchmem's code before.
    forgotten = estimate_command(tmp_path, "--device", "cpu", "steps:step")
    assert forgotten.returncode == 1
    assert "steps:step(batch) cannot be called with no arguments" in forgotten.stderr
    assert "Traceback" not in forgotten.stderr
    assert (
        estimate_command(tmp_path, "--device", "cpu", "steps:step", "--batch", "4").returncode == 0
    )


def test_the_functions_own_error_keeps_its_traceback_and_bad_options_are_one_line(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "train.py").write_text('import torch\n\nlr = float("0.1x")\n')
    (tmp_path / "steps.py").write_text("import torch\n\ndef step(batch):\n    torch.empty(batch)\n")

    # One line, "error: could not convert...", before: the traceback was lost.
    own = estimate_command(tmp_path, "--device", "cpu", "train.py")
    assert own.returncode == 1
    assert own.stderr.startswith("Traceback (most recent call last):\n"), own.stderr
    assert 'File "train.py", line 3, in <module>' in own.stderr
    assert own.stderr.endswith("ValueError: could not convert string to float: '0.1x'\n")
    assert "torchmem" not in own.stderr.partition("train.py")[0]  # none of our frames first
    for words, said in [
        (("--device", "tpu"), "cannot estimate for device 'tpu': use 'cuda' or 'cpu'"),
        (("--capacity", "3x"), "invalid size '3x'"),
    ]:
        bad = estimate_command(
            tmp_path, *words, "steps:step", *(() if "--capacity" in words else ("--batch", "4"))
        )
        assert bad.returncode == 2
        assert bad.stderr.startswith(f"torchmem estimate: error: {said}"), bad.stderr
        assert len(bad.stderr.splitlines()) == 1


def test_a_real_tensor_met_in_the_fake_run_is_refused_and_left_unchanged() -> None:
    weights = torch.ones(4)

    def step(batch: int) -> torch.Tensor:
        weights.mul_(5.0)
        return torch.randn(batch, 4) * weights

    # It became 5.0, then failed inside PyTorch, before.
    with pytest.raises(EstimateError) as refused:
        estimate(step, 8, device="cpu")
    line = step.__code__.co_firstlineno + 1
    assert str(refused.value).startswith(
        f"aten.mul_.Tensor at {__file__}:{line} was given a real tensor (torch.float32 (4,)"
        " on cpu), made before the estimate began"
    )
    assert weights.tolist() == [1.0, 1.0, 1.0, 1.0]


def loader_step(batch: int, workers: int) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 256))
    model = torch.nn.Linear(256, 256, bias=False)
    loader = DataLoader(data, batch_size=batch, num_workers=workers, persistent_workers=workers > 0)
    for (x,) in loader:
        model(x).sum().backward()
    assert loader.num_workers == workers  # the loader is as it was made


def test_a_dataloaders_workers_make_their_batches_in_the_estimating_process() -> None:
    # Ended in a PyTorch-internal error from the workers before.
    with_workers = estimate(loader_step, 16, 2, device="cpu")
    in_process = estimate(loader_step, 16, 0, device="cpu")
    assert with_workers.peak_bytes == in_process.peak_bytes
    assert any(note.startswith("DataLoader workers: 1 pass(es)") for note in with_workers.notes)
    assert not any(note.startswith("DataLoader") for note in in_process.notes)
