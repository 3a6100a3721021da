"""``torchmem run`` on long training runs of ``examples/train_lm.py``, a transformer
language model with fused AdamW, on the CPU: at its default size (2 blocks, d_model 32,
batch 4 x 16 tokens: a few milliseconds a step on one CPU core, where per-step overhead
shows most) for 2,000 and for 20,000 steps, and at nanoGPT's CPU size (4 blocks of 4
heads, d_model 128, batch 12 x 64 tokens: the configuration nanoGPT's README gives for a
CPU) for 2,000 steps. Each contender is a whole command in a new process (Python's start
and ``import torch`` included), alternating, median of the rounds: plain ``python``;
``python`` with PyTorch's global module hooks and saved-tensor hooks installed, doing
nothing (the floor of any tool that watches modules and activations through PyTorch's
hooks); ``torchmem run -q`` with allocation sites (the default) and with
``--no-sites``. For each: the wall time and its ratio to plain; the peak RSS and how much
it is over plain's (a recording that keeps every event grows with the run); and how long
after the script's last line the process ended (for torchmem, the recording's stop and
its report; for plain, Python's shutdown). One thread (``OMP_NUM_THREADS=1``), GPUs
hidden. A contender still running at 5x plain's time (at least 60 s) is stopped and shown
as such (">": lower bounds). Targets, for each case, sites on and off: at most 1.2x
plain's time and at most 64 MiB more RSS."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path

from benchmarks import processes
from benchmarks.processes import Run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
NANOGPT_CPU = ("--d-model", "128", "--context", "64", "--batch-size", "12", "--layers", "4")
"""nanoGPT's CPU configuration (its README's ``--n_embd=128 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4``) as the example's options."""
CASES: tuple[tuple[int, tuple[str, ...]], ...] = ((2_000, ()), (20_000, ()), (2_000, NANOGPT_CPU))
"""The runs at full scale: steps, and the example's options beyond ``--steps``."""
RATIO = 1.2
"""Highest ratio to plain python either torchmem contender may reach."""
RSS_MIB = 64
"""Most MiB of peak RSS either torchmem contender may add to plain python's."""
WRAPPER = f"""
import runpy
import sys
import time

if sys.argv[1] == "--hooks":
    import torch
    from torch.autograd.graph import saved_tensors_hooks
    from torch.nn.modules import module

    def nothing(*args):
        return None

    module.register_module_forward_pre_hook(nothing)
    module.register_module_forward_hook(nothing, always_call=True)
    saved_tensors_hooks(torch.Tensor.detach, lambda tensor: tensor).__enter__()
    del sys.argv[1]
sys.argv[0] = {str(EXAMPLE)!r}
runpy.run_path(sys.argv[0], run_name="__main__")
print({processes.MARK!r}, time.monotonic(), flush=True)
"""
"""Runs the example as ``__main__`` (after installing hooks that do nothing, with a first
argument ``--hooks``), then prints the time of its last line."""
HOOKS = "python, PyTorch's hooks doing nothing"
CONTENDERS = ("python", HOOKS, "torchmem run --no-sites", "torchmem run")


def environ() -> dict[str, str]:
    """One thread, no GPU: a CPU training loop, the same for every contender."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def commands(wrapper: str, steps: int, options: tuple[str, ...]) -> dict[str, list[str]]:
    """Each contender's command line, running `wrapper` (:data:`WRAPPER`)."""
    script = [wrapper, "--steps", str(steps), *options, "--device", "cpu"]
    run = [sys.executable, "-m", "torchmem", "run", "-q"]
    return dict(
        zip(
            CONTENDERS,
            (
                [sys.executable, *script],
                [sys.executable, wrapper, "--hooks", *script[1:]],
                [*run, "--no-sites", *script],
                [*run, *script],
            ),
            strict=True,
        )
    )


def measure(repeat: int, scale: float, cases: Collection[int] | None = None) -> list[Run]:
    """A row per case and contender: medians of `repeat` rounds, contenders alternating;
    the lengths are those of :data:`CASES` times `scale`; only the `cases` (indices in
    :data:`CASES`) where given."""
    found: list[Run] = []
    with tempfile.TemporaryDirectory() as folder:
        wrapper = Path(folder, "train_lm_timed.py")
        wrapper.write_text(WRAPPER)
        for index, (full, options) in enumerate(CASES):
            if cases is not None and index not in cases:
                continue
            steps = max(1, round(full * scale))
            case = " ".join(("examples/train_lm.py", "--steps", str(steps), *options))
            found += processes.measure(
                case, commands(str(wrapper), steps, options), repeat, environ()
            )
    return found


def verdicts(runs: list[Run]) -> str:
    """A line per case and contender but plain: time ratio and RSS over plain, against
    the targets (the hooks that do nothing have none for time: they are the floor)."""
    targets = {name: RATIO for name in CONTENDERS[2:]}
    return processes.verdicts(runs, {HOOKS: float("inf"), **targets}, RSS_MIB)
