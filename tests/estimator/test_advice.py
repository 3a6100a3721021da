"""torchmem.advise: each change's saving, as the estimator computes it, against the saving
a real CPU run of the changed step measures.

The real runs are measured with the CPU meter (every CPU tensor storage of the process,
to the byte, the tensors PyTorch makes inside its kernels too), after one run first, with
oneDNN off: its bfloat16 matrix products take scratch space of their own, which the
estimate leaves out; the changes are made to them by the
same :func:`~torchmem.estimator.changes.applied` block that the estimates run in, so a
real run and an estimate differ only by the tensors being fake.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchmem
from torchmem.estimator.advice import checkpoint_candidates
from torchmem.estimator.changes import Changes, applied
from torchmem.estimator.gpus import GPUS, capacity
from torchmem.records.run import ModulePeak

pytestmark = pytest.mark.integration

MIB = 2**20


def mlp_step(batch: int, device: str = "cpu") -> None:
    """An MLP 128-256-256-256-256-256-10 trained twice with Adam (foreach), zeroing its
    gradients with set_to_none=False."""
    layers = [nn.Linear(128, 256), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    x = torch.randn(batch, 128, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def wide_step(batch: int) -> None:
    """An MLP 256-512-512-10, one step of Adam (foreach), gradients zeroed as None."""
    model = nn.Sequential(
        nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    x = torch.randn(batch, 256)
    y = torch.randint(0, 10, (batch,))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP, each added to its input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


def block_step(batch: int, device: str = "cpu") -> None:
    """Two blocks of width 64 and a head, on sequences of 16, trained twice with AdamW
    (foreach), zeroing with set_to_none=False."""
    model = nn.Sequential(Block(64), Block(64), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(batch, 16, 64, device=device)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()


@contextlib.contextmanager
def without_onednn() -> Iterator[None]:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def measured_peak(step: Callable[..., None], batch: int, changes: Changes) -> int:
    """The peak of the tensors of a real CPU run of `step` with `changes` made, above the
    tensors alive before it."""
    with without_onednn():
        step(batch)
        gc.collect()
        with torchmem.meter("cpu").window() as window, applied(changes):
            step(batch)
            return window.peak() - window.start


def estimated_peak(step: Callable[..., None], batch: int, changes: Changes) -> int:
    def changed(batch: int) -> None:
        with applied(changes):
            step(batch)

    return torchmem.estimate(changed, batch, device="cpu").peak_bytes


BLOCKS = frozenset({"0", "1"})
SAVINGS = [
    # (step, batch, change, estimated saving in bytes); 0: the peak stays, < 0: it rises
    (mlp_step, 64, Changes("cpu", no_foreach=True), 538_668),
    (mlp_step, 64, Changes("cpu", autocast=True), 0),
    (mlp_step, 1024, Changes("cpu", autocast=True), 2_883_588),
    (mlp_step, 1024, Changes("cpu", set_to_none=True), 1_184_768),
    (mlp_step, 1024, Changes("cpu", no_foreach=True), 0),
    (block_step, 32, Changes("cpu", checkpoint=BLOCKS), 1_837_440),
    (block_step, 32, Changes("cpu", autocast=True), 1_767_432),
    (block_step, 32, Changes("cpu", set_to_none=True), 398_848),
    (block_step, 32, Changes("cpu", no_foreach=True), 0),
    # Adam's first step peaks with its temporaries: foreach makes sqrt(exp_avg_sq) of every
    # parameter at once (1,597,480 bytes: 399,370 floats), one tensor at a time makes it and
    # its quotient for each (2 x 1,048,576 bytes for the 512 x 512 weight): 499,672 bytes
    # more, and 2,048 bytes of the loop's smaller temporaries.
    (wide_step, 64, Changes("cpu", no_foreach=True), -501_720),
]


@pytest.mark.parametrize(
    ("step", "batch", "changes", "saving"),
    SAVINGS,
    ids=[f"{s.__name__}-{b}-{i}" for i, (s, b, _, _) in enumerate(SAVINGS)],
)
def test_each_change_saves_what_the_changed_real_step_saves(
    step: Callable[..., None], batch: int, changes: Changes, saving: int
) -> None:
    plain = Changes("cpu")
    estimated = estimated_peak(step, batch, plain) - estimated_peak(step, batch, changes)
    measured = measured_peak(step, batch, plain) - measured_peak(step, batch, changes)
    assert estimated == measured == saving


def test_set_to_none_saves_the_gradient_accumulated_into_the_kept_one() -> None:
    """A 1024 x 1024 layer without bias (4 MiB of weights) trained twice with plain SGD.
    With set_to_none=False the second backward pass makes the new gradient (4 MiB) and
    adds it into the zeroed one kept from the first (4 MiB): 4 MiB more at its peak than
    where the new gradient simply becomes the layer's gradient."""

    def step(batch: int) -> None:
        model = nn.Linear(1024, 1024, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch, 1024)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            model(x).sum().backward()
            optimizer.step()

    advice = torchmem.advise(step, 1, device="cpu")
    assert [change.kind for change in advice.changes] == ["set_to_none"]
    assert advice.changes[0].saving_bytes == 1024 * 1024 * 4 == 4_194_304
    measured = measured_peak(step, 1, Changes("cpu")) - measured_peak(
        step, 1, Changes("cpu", set_to_none=True)
    )
    assert measured == 4_194_304


@pytest.mark.parametrize(
    ("step", "batch", "kinds"),
    [
        (mlp_step, 64, ["foreach"]),
        (mlp_step, 1024, ["autocast", "set_to_none"]),
        (block_step, 32, ["checkpoint", "autocast", "set_to_none"]),
    ],
)
def test_advice_lists_what_saves_and_each_saving_is_measured(
    step: Callable[..., None], batch: int, kinds: list[str]
) -> None:
    advice = torchmem.advise(step, batch, device="cpu")
    assert [change.kind for change in advice.changes] == kinds  # largest saving first
    plain = measured_peak(step, batch, Changes("cpu"))
    assert advice.peak_bytes == advice.reserved_bytes == plain
    everything = Changes("cpu")
    for change in advice.changes:
        changes = _changes_of(change.kind, change.modules)
        assert advice.peak_bytes - change.peak_bytes == change.saving_bytes > 0
        assert plain - measured_peak(step, batch, changes) == change.saving_bytes
        everything = _with(everything, changes)
    assert advice.advised_peak_bytes == measured_peak(step, batch, everything)


def _changes_of(kind: str, modules: tuple[str, ...], device: str = "cpu") -> Changes:
    """The change an advice's entry of `kind` (naming `modules`) describes."""
    if kind == "checkpoint":
        return Changes(device, checkpoint=frozenset(modules))
    flag = {"foreach": "no_foreach"}.get(kind, kind)
    return Changes(device, **{flag: True})  # type: ignore[arg-type]


def _with(first: Changes, second: Changes) -> Changes:
    return Changes(
        "cpu",
        checkpoint=first.checkpoint | second.checkpoint,
        autocast=first.autocast or second.autocast,
        set_to_none=first.set_to_none or second.set_to_none,
        no_foreach=first.no_foreach or second.no_foreach,
    )


def test_checkpointing_names_the_blocks_and_says_why_not_for_an_mlp() -> None:
    blocks = torchmem.advise(block_step, 32, device="cpu")
    (checkpoint,) = [c for c in blocks.changes if c.kind == "checkpoint"]
    assert checkpoint.modules == ("0", "1")
    assert checkpoint.action.startswith("Checkpoint each Block (0, 1) with torch.utils.checkpoint")
    mlp = torchmem.advise(mlp_step, 1024, device="cpu")
    assert (
        "checkpoint: not tried: no module below the outermost one calls submodules"
        in (mlp.notes[0])
    )


def test_checkpointing_is_tried_per_class_of_modules_that_call_submodules() -> None:
    def peak(name: str, kind: str, kept: int, backward: int | None = 1) -> ModulePeak:
        return ModulePeak(name, kind, "cpu", 1, backward, 1, forward_kept_bytes=kept)

    modules = [
        peak("", "Sequential", 500),  # the outermost: never
        peak("0", "Block", 200),
        peak("0.mlp", "Sequential", 80),
        peak("0.mlp.0", "Linear", 40),  # a single layer: never
        peak("1", "Block", 200),
        peak("1.mlp", "Sequential", 80),
        peak("1.mlp.0", "Linear", 40),
        peak("2", "Head", 300, backward=None),  # no backward pass through it
        peak("2.0", "Linear", 1, backward=None),
        peak("3", "Wrapper", 0),  # keeps nothing
        peak("3.0", "Linear", 0),
    ]
    assert checkpoint_candidates(modules) == [
        ("Block", ("0", "1")),  # 400 bytes kept
        ("Sequential", ("0.mlp", "1.mlp")),  # 160
    ]
    several = [peak("Net", "Net", 9), peak("Net.body", "Body", 5), peak("Net.body.0", "Linear", 1)]
    several.append(peak("CrossEntropyLoss", "CrossEntropyLoss", 1))
    assert checkpoint_candidates(several) == [("Body", ("Net.body",))]


def test_a_change_the_step_already_makes_is_not_tried() -> None:
    def step(batch: int) -> None:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        optimizer = torch.optim.Adam(model.parameters())  # foreach: None, the CPU's loop
        x = torch.randn(batch, 64)
        for _ in range(2):
            optimizer.zero_grad()  # set_to_none=True, the default
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().sum().backward()
            optimizer.step()

    advice = torchmem.advise(step, 256, device="cpu")
    assert advice.changes == ()
    assert advice.advised_peak_bytes == advice.peak_bytes
    assert advice.notes[1:] == (
        "autocast: not tried: the forward already runs under autocast.",
        "set_to_none: not tried: the step never calls zero_grad(set_to_none=False).",
        "foreach: not tried: no optimizer step uses foreach (on the CPU, optimizers step one"
        " tensor at a time unless given foreach=True; fused ones have no foreach"
        " temporaries).",
    )


def test_a_change_that_raises_the_peak_is_noted_with_its_rise() -> None:
    advice = torchmem.advise(wide_step, 64, device="cpu")
    assert advice.changes == ()
    assert advice.notes[1:] == (
        "autocast: not advised: estimated, run the model's forward under"
        " torch.autocast('cpu', dtype=torch.bfloat16) leaves the peak as it is.",
        "set_to_none: not tried: the step never calls zero_grad(set_to_none=False).",
        "foreach: not advised: estimated, create the optimizer with foreach=False (one"
        " parameter at a time in its step) raises the peak by 489.96K.",  # 501,720 bytes
    )


@pytest.mark.slow
def test_the_largest_batch_fits_and_one_more_does_not_when_run() -> None:
    limit = 10 * MIB
    advice = torchmem.advise(block_step, 32, device="cpu", capacity=limit)
    found = advice.largest_batch
    assert found is not None and found.gpu == "" and found.capacity_bytes == limit
    assert found.advised_batch > found.batch > 32
    plain = Changes("cpu")
    assert measured_peak(block_step, found.batch, plain) <= limit
    assert measured_peak(block_step, found.batch + 1, plain) > limit
    everything = Changes("cpu", checkpoint=BLOCKS, autocast=True, set_to_none=True)
    assert measured_peak(block_step, found.advised_batch, everything) <= limit
    assert measured_peak(block_step, found.advised_batch + 1, everything) > limit


def test_gpus_are_named_or_given_as_sizes() -> None:
    assert capacity("H100-80GB") == capacity("NVIDIA H100 80GB") == 81_082 * MIB
    assert capacity("h200") == GPUS["H200"] == 143_156 * MIB
    assert capacity("80 GiB") == 80 * 2**30
    assert capacity(1024) == 1024
    message = r"^invalid size 'H300'.*; or name a GPU: A100-40GB, A100-80GB, H100-80GB, H200$"
    with pytest.raises(ValueError, match=message):
        capacity("H300")


def test_every_capacity_takes_a_gpus_name() -> None:
    """A step that holds 1 MiB, asked of a GPU by name wherever a capacity is asked for."""

    def step(batch: int) -> None:
        torch.zeros(batch, 256 * 1024)  # batch MiB

    assert torchmem.estimate(step, 1, device="cpu").fits("H100-80GB")
    assert torchmem.max_batch_size(step, "H100-80GB", device="cpu") == 81_082
    with pytest.raises(ValueError, match="or name a GPU"):
        torchmem.estimate(step, 1, device="cpu").fits("H300")


def test_a_capacity_needs_the_batch_first() -> None:
    with pytest.raises(TypeError, match="calls fn with the batch size first"):
        torchmem.advise(lambda: None, device="cpu", capacity="H100-80GB")


def test_errors_pass_through_and_every_change_is_undone() -> None:
    originals = (nn.Module.__call__, nn.Module.zero_grad, torch.optim.Optimizer.zero_grad)

    def step(batch: int) -> None:
        nn.Linear(4, 4)(torch.randn(batch, 4))
        raise KeyError("the step's own")

    with pytest.raises(KeyError, match="the step's own"):
        torchmem.advise(step, 2, device="cpu")
    everything = Changes("cpu", checkpoint=BLOCKS, autocast=True, set_to_none=True)
    with pytest.raises(KeyError), applied(everything):
        step(2)
    assert (nn.Module.__call__, nn.Module.zero_grad, torch.optim.Optimizer.zero_grad) == originals
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    with applied(Changes("cpu", no_foreach=True)) as seen:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert seen.foreach_steps == 1
    assert optimizer.param_groups[0]["foreach"] is True  # put back after the step
    optimizer.step()
    assert seen.foreach_steps == 1  # the hooks are gone


def test_on_cuda_the_optimizers_default_foreach_is_tried() -> None:
    """On a GPU, Adam's default steps with foreach; advice on CUDA tries foreach=False."""

    def step(batch: int) -> None:
        model = nn.Linear(256, 256).cuda()
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(batch, 256, device="cuda")).sum().backward()
        optimizer.step()

    advice = torchmem.advise(step, 8)
    assert advice.device == "cuda"
    tried = [c.kind for c in advice.changes] + [n.split(":")[0] for n in advice.notes]
    assert "foreach" in tried
    assert not any(n.startswith("foreach: not tried") for n in advice.notes)


def test_reports() -> None:
    advice = torchmem.advise(mlp_step, 1024, device="cpu", capacity="8 MiB")
    data = advice.to_json()
    assert list(data) == [
        "function",
        "device",
        "peak_bytes",
        "reserved_bytes",
        "changes",
        "advised_peak_bytes",
        "advised_reserved_bytes",
        "largest_batch",
        "notes",
        "seconds",
    ]
    assert data["changes"][0]["saving_bytes"] == 2_883_588
    assert data["largest_batch"]["capacity_bytes"] == 8 * MIB
    frame = advice.to_dataframe()
    assert list(frame["change"]) == ["autocast", "set_to_none"]
    assert int(frame["saving_bytes"][1]) == 1_184_768
    page: Any = advice._repr_html_()
    assert "<table>" in page and "set_to_none" in page


@pytest.mark.cuda
def test_each_saving_is_measured_on_a_real_gpu() -> None:
    """On a GPU: the saving of each change listed for the blocks' step, estimated, against
    max_memory_allocated of the real step without and with it."""

    def measured(changes: Changes) -> int:
        block_step(32, "cuda")
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with applied(changes):
            block_step(32, "cuda")
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    advice = torchmem.advise(block_step, 32, "cuda")
    plain = measured(Changes("cuda"))
    for change in advice.changes:
        changes = _changes_of(change.kind, change.modules, "cuda")
        assert plain - measured(changes) == change.saving_bytes
