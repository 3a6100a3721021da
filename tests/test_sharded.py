"""Sharded training per rank: each rank's parameters, gradients and optimizer state are
its local shards, to the byte. In this process on a fake process group (one rank of four,
no communication), and under ``torchrun`` on real CPU ranks (gloo) with FSDP2, DDP and
tensor-parallel steps (``tests/sharded_job.py``). An estimate of each rank, on the fake
process group, is the peak that rank records, on both."""

from __future__ import annotations

import gc
import json
import resource
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchmem
from launchers import finished, torchrun
from sharded_job import train
from standins import call_in_fresh_process_without_gpu
from torchmem.cli import main

pytestmark = pytest.mark.counting

JOB = Path(__file__).with_name("sharded_job.py")
OWNED = ("parameters", "gradients", "optimizer_state")


@pytest.fixture
def rank_of_four() -> Iterator[None]:
    """This process as rank 1 of 4 on a fake process group: collectives do nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of `tensors` (of a DTensor's local shard)."""
    storages = {}
    for tensor in tensors:
        plain = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storages[plain.untyped_storage().data_ptr()] = plain.untyped_storage().nbytes()
    return sum(storages.values())


def owned(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for values in optimizer.state.values() for v in values.values()]
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": local_bytes(v for v in state if isinstance(v, torch.Tensor)),
    }


def fsdp2() -> nn.Module:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def tensor_parallel() -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    mesh = init_device_mesh("cpu", (4,))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


@pytest.mark.usefixtures("rank_of_four")
@pytest.mark.parametrize(
    ("sharded", "parameters"),
    [
        (fsdp2, 3 * (64 * 256 + 64) * 4),  # a quarter of each weight and bias (rows)
        # A quarter of the first layer's weight and bias (rows), of the second's weight
        # (columns); its bias whole on every rank
        (tensor_parallel, (256 * 256 + 256 + 256 * 256 + 256) * 4),
    ],
)
def test_a_ranks_categories_are_its_local_shards(
    sharded: Callable[[], nn.Module], parameters: int
) -> None:
    with torchmem.record() as rec:
        model = sharded()
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, 256)).sum().backward()
        optimizer.step()
    found = rec.report().devices["cpu"].categories_at_end
    assert {name: found[name] for name in OWNED} == owned(model, optimizer)
    assert found["parameters"] == parameters


@pytest.mark.usefixtures("rank_of_four")
def test_fsdp2s_all_gathered_parameters_count_as_communication_while_they_live() -> None:
    model = fsdp2()
    x = torch.randn(8, 256)
    with torchmem.record() as rec:
        model(x).sum().backward()
    cpu = rec.report().devices["cpu"]
    assert cpu.categories_at_end is not None and cpu.timeline_categories is not None
    gathered = [
        (held.name, held.bytes, held.shape)
        for held in cpu.largest_at_peak
        if held.category == "communication"
    ]
    # The peak is in a layer's backward: its weight whole again (256 x 256 float32), and
    # the all-gather output FSDP keeps until its next all-gather (weight and bias, flat)
    assert ("1.weight (all-gathered)", 256 * 256 * 4, (256, 256)) in gathered
    assert ("FSDP2 collectives of 1", 257 * 256 * 4, (257 * 256,)) in gathered
    # and its whole gradient, before FSDP2 reduce-scatters it into the shard's
    assert ("1.weight.grad (unsharded)", 256 * 256 * 4, (256, 256)) in gathered
    assert cpu.categories_at_end["communication"] == 0  # resharded, the buffers freed
    assert cpu.categories_at_end["parameters"] == 3 * (64 * 256 + 64) * 4
    dropped = [weakref.ref(layer) for layer in model]  # each with its parameter group
    del model
    gc.collect()  # FSDP's own reference cycles
    assert [layer() for layer in dropped] == [None, None, None]  # the recording holds none


@pytest.mark.usefixtures("rank_of_four")
def test_modules_fully_shard_wrapped_show_the_class_the_user_wrote() -> None:
    with torchmem.record() as rec:
        model = fsdp2()
        model(torch.randn(8, 256)).sum().backward()
    found = {(m.name, m.type) for m in rec.report().modules}
    assert found == {("", "Sequential"), ("0", "Linear"), ("1", "Linear"), ("2", "Linear")}
    assert type(model).__name__ == "FSDPSequential"


def fsdp2_step(width: int) -> None:
    """An FSDP2 step on this process's ranks; rank r's batch is 8 x (r + 1) rows."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8 * (1 + dist.get_rank()), width)).sum().backward()
    optimizer.step()


def recorded_peaks(step: Callable[[int], None], width: int, ranks: int) -> list[int]:
    """Each rank's peak above its start, recorded as it runs `step(width)` for real on
    the fake process group."""
    measured = []
    for rank in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        gc.collect()  # the rank before's models (FSDP's reference cycles)
        try:
            with torchmem.record() as rec:
                step(width)
        finally:
            dist.destroy_process_group()
        cpu = rec.report().devices["cpu"]
        measured.append(cpu.peak_bytes - cpu.start_bytes)
    return measured


def tp_step(width: int) -> None:
    """A tensor-parallel step, its hidden layer (4 x `width`) split by rows, then by
    columns; rank r's batch is 256 x (r + 1) rows."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(256 * (1 + dist.get_rank()), width)).sum().backward()
    optimizer.step()


def test_a_tensor_parallel_estimate_of_each_rank_is_that_ranks_recorded_peak() -> None:
    # The row-wise layer's output is all-reduced by a functional collective, whose
    # wait_tensor returns its input: on fake tensors it made a copy, one activation more
    estimate = torchmem.estimate(tp_step, 128, device="cpu", world_size=4)
    measured = recorded_peaks(tp_step, 128, 4)
    assert [each.peak_bytes for each in estimate.ranks] == measured
    assert measured == sorted(set(measured))


def test_an_estimate_of_each_rank_is_that_ranks_recorded_peak() -> None:
    estimate = torchmem.estimate(fsdp2_step, 256, device="cpu", world_size=4)
    measured = recorded_peaks(fsdp2_step, 256, 4)
    assert [each.peak_bytes for each in estimate.ranks] == measured
    assert measured == sorted(set(measured))  # each rank's batch longer
    parameters = 4 * (64 * 256 + 64) * 4  # a quarter of each weight and bias (rows)
    assert [each.categories["parameters"] for each in estimate.ranks] == [parameters] * 4
    assert (estimate.rank, estimate.world_size, estimate.peak_bytes) == (3, 4, measured[3])
    assert not dist.is_initialized()
    text = str(estimate).splitlines()
    assert text[0].startswith("torchmem estimate: fsdp2_step on cpu, rank 3 of 4 (")
    at = text.index("Each rank at its peak (*: the highest, shown below):")
    header, *rows = text[at + 1 : at + 6]
    names = ["parameters", "gradients", "communication", "activations", "other"]
    assert header.split() == ["rank", "peak", *names]  # no optimizer state at the peaks
    assert [row.split()[0] for row in rows] == ["0", "1", "2", "3"]
    assert [row.split()[1] == "*" for row in rows] == [False, False, False, True]
    ranks = estimate.to_json()["ranks"]
    assert [(r["rank"], r["peak_bytes"]) for r in ranks] == list(enumerate(measured))


def test_an_estimate_of_ranks_says_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"^world_size must be a whole number of ranks.*: 0$"):
        torchmem.estimate(fsdp2_step, 128, device="cpu", world_size=0)
    with pytest.raises(torchmem.EstimateError, match=r"^estimates of ranks are of CPU tensors"):
        torchmem.estimate(fsdp2_step, 128, device="cuda", world_size=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(torchmem.EstimateError, match="a process group is initialised"):
            torchmem.estimate(fsdp2_step, 128, device="cpu", world_size=2)
    finally:
        dist.destroy_process_group()

    def ddp_step(width: int) -> None:
        nn.parallel.DistributedDataParallel(nn.Linear(width, width))

    with pytest.raises(torchmem.EstimateError, match=r"^DistributedDataParallel cannot run"):
        torchmem.estimate(ddp_step, 250, device="cpu", world_size=2)
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "modes"),
    [
        (2, "fsdp2,tp,ddp"),
        (4, "fsdp2-kept-bf16,tp,ddp-bucket-view"),
    ],
)
def test_each_ranks_categories_at_the_end_are_its_local_shards(
    tmp_path: Path, ranks: int, modes: str
) -> None:
    shutil.copy(JOB, tmp_path / "job.py")
    words = ["--standalone", f"--nproc-per-node={ranks}", "-m", "torchmem", "run"]
    process = torchrun(*words, "--json", "ranks.json", "job.py", cwd=tmp_path, env={"MODES": modes})
    code, _, err = finished(process)
    assert code == 0, err
    report = json.loads((tmp_path / "ranks.json").read_text())
    found = [
        {name: rank["devices"]["cpu"]["categories_at_end"][name] for name in OWNED}
        for rank in report["ranks"]
    ]
    truth = [json.loads((tmp_path / f"truth{r}.json").read_text()) for r in range(ranks)]
    assert found == [{name: t[name] for name in OWNED} for t in truth]
    assert all(t["parameters"] > 0 for t in truth)
    for mode in modes.split(","):
        if mode.startswith("ddp"):
            continue  # an estimate refuses DDP
        estimate = torchmem.estimate(train, mode, device="cpu", world_size=ranks)
        found = [each.peak_bytes for each in estimate.ranks]
        measured = [t["peaks"][mode] for t in truth]
        if mode == "tp":
            # parallelize_module scatters each weight from rank 0, and gloo copies what it
            # scatters into a buffer of its own there (alive at the peak with 4 ranks, not
            # with 2): the fake process group has none
            assert found[1:] == measured[1:] and found[0] <= measured[0]
        else:
            assert found == measured


def test_the_command_line_estimates_each_rank(capsys: pytest.CaptureFixture[str]) -> None:
    words = ["estimate", "--device", "cpu", "test_sharded:even_step", "--world-size", "2"]
    assert main([*words, "--batch", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("torchmem estimate: even_step on cpu, rank 0 of 2 (")
    at = out.index("Each rank at its peak (*: the highest, shown below):")
    assert [row.split()[:2] for row in out[at + 2 : at + 4]] == [
        ["0", "*"],
        ["1", out[at + 3].split()[1]],
    ]
    assert main([*words, "--capacity", "4 MiB"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("largest batch size that fits 4 MiB on cpu: ")
    batch = int(said.split()[-1])
    fits = [
        torchmem.estimate(even_step, b, device="cpu", world_size=2).peak_bytes <= 4 * 2**20
        for b in (batch, batch + 1)
    ]
    assert batch > 1 and fits == [True, False]
    assert main([*words, "--batch", "8", "--advice"]) == 2
    assert "--advice is for one process" in capsys.readouterr().err


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    """A Llama 7B's block: hidden 4,096, 32 heads, 11,008 intermediate (SwiGLU)."""

    def __init__(self, hidden: int = 4096, heads: int = 32, inner: int = 11008) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hidden = x.shape
        q, k, v = (
            y.view(b, t, self.heads, -1).transpose(1, 2)
            for y in self.wqkv(self.attention_norm(x)).split(hidden, dim=-1)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, hidden))
        h = self.ffn_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


def llama(layers: int, vocabulary: int = 32000, hidden: int = 4096) -> nn.Module:
    return nn.Sequential(
        nn.Embedding(vocabulary, hidden),
        *[LlamaBlock() for _ in range(layers)],
        RMSNorm(hidden),
        nn.Linear(hidden, vocabulary, bias=False),
    )


def llama_step(batch: int) -> None:
    """An FSDP2 training step of a Llama 7B's width with 4 blocks, 2,048 tokens a row."""
    model = llama(4)
    for block in model[1:5]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 32000, (batch, 2048))
    logits = model(tokens)
    nn.functional.cross_entropy(logits.view(-1, 32000), tokens.view(-1)).backward()
    optimizer.step()


def estimate_llama_on_eight_ranks() -> dict[str, object]:
    """In a fresh process: each rank's parameters, and the process's peak RSS."""
    estimate = torchmem.estimate(llama_step, 1, device="cpu", world_size=8)
    return {
        "parameters": [each.categories["parameters"] for each in estimate.ranks],
        "peaks": [each.peak_bytes for each in estimate.ranks],
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


@pytest.mark.slow
def test_a_llama_7b_width_on_eight_fake_ranks_is_estimated_in_little_memory() -> None:
    found = call_in_fresh_process_without_gpu(estimate_llama_on_eight_ranks)
    with torch.device("meta"):
        shapes = [p.shape for p in llama(4).parameters()]
    # FSDP2 gives each rank ceil(rows / 8) of every parameter's rows
    sharded = sum(-(-shape[0] // 8) * (shape.numel() // shape[0]) * 4 for shape in shapes)
    assert sharded == 535_840_768
    assert found["parameters"] == [sharded] * 8
    assert len(set(found["peaks"])) == 1 and found["peaks"][0] > 4 * sharded
    assert found["rss"] < 4 * 2**30  # fake tensors: no rank's memory is allocated


def even_step(batch: int) -> None:
    """An FSDP2 step of four 256 x 256 layers, the same on every rank."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(batch, 256)).sum().backward()
    optimizer.step()


def test_the_fewest_ranks_a_step_fits_on_is_a_power_of_two() -> None:
    peaks = {n: torchmem.estimate(even_step, 64, device="cpu", world_size=n) for n in (2, 4)}
    assert all(len({r.peak_bytes for r in peaks[n].ranks}) == 1 for n in peaks)
    two, four = peaks[2].peak_bytes, peaks[4].peak_bytes
    assert two > four
    assert torchmem.min_world_size(even_step, 64, capacity=four) == 4
    assert torchmem.min_world_size(even_step, 64, capacity=two) == 2
    assert torchmem.min_world_size(even_step, 64, capacity="1 GiB") == 1
    # The activations and what FSDP2 all-gathers do not shard: 1 KiB fits no number of ranks
    assert torchmem.min_world_size(even_step, 64, capacity=1024) is None
    assert not dist.is_initialized()
