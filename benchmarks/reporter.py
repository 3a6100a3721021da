"""Tensor reporter: the time to report 100,000 live tensors, and the sizes reported for a
known model, torchmem's ``MemReporter`` against pytorch_memlab's (which runs on CPU).

Time: with `n` small live CPU tensors (``torch.ones(4)`` each), each contender makes one
full report with a fresh reporter: torchmem's ``MemReporter().report()`` and
pytorch_memlab's ``MemReporter().report(device=torch.device("cpu"))``. Both scan
:func:`gc.get_objects` and both print; stdout goes to a buffer that is thrown away, so
each pays for its own formatting but not for a terminal. Contenders run in the same
process, alternating, repeated; the table shows the median time and its ratio to
torchmem's (there is no unwatched run to compare with here).

Sizes: a fixed model, ``Linear(1024, 1024), ReLU, Linear(1024, 10)`` after one Adam step
on CPU, so every parameter has a gradient and Adam's state. For each of those tensors the
truth is its storage's bytes (``untyped_storage().nbytes()``: 4,194,304 for a float32
(1024, 1024)), against the bytes each reporter attributes to that tensor. Rows are
matched by the tensor object, not by name: pytorch_memlab's report is taken from the
stats it computes (``collect_tensor()`` then ``get_stats()``, what its ``report()`` does
before printing), each stat lined up with the tensor it came from by walking its scan in
its own order. Its scan is the whole process's, so only the model's tensors are compared;
torchmem's is limited to the model and the optimizer (``objects=``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

import torchmem
from benchmarks import timing

Report = Callable[[], None]

BASE = "torchmem MemReporter().report()"
"""The contender the time ratios are relative to."""


def memlab() -> ModuleType:
    """pytorch_memlab, imported with the line its import prints on a machine without CUDA
    silenced; raises ImportError when it is not installed. Garbage is collected first: its
    reports read every tensor the garbage collector tracks, unreachable ones too, and fail
    on one whose data cannot be read (a fake tensor left in a cycle by an estimate that
    raised), so each starts from the live tensors only."""
    gc.collect()
    with contextlib.redirect_stdout(io.StringIO()):
        import pytorch_memlab
    return pytorch_memlab


# Time ---------------------------------------------------------------------------------


def live_tensors(n: int = 100_000) -> list[torch.Tensor]:
    """`n` small live CPU tensors, 16 bytes each."""
    return [torch.ones(4) for _ in range(n)]


def torchmem_report() -> Report:
    return lambda: torchmem.MemReporter().report()


def memlab_report() -> Report:
    reporter = memlab().MemReporter
    cpu = torch.device("cpu")
    return lambda: reporter().report(device=cpu)


CONTENDERS: dict[str, Callable[[], Report]] = {
    BASE: torchmem_report,
    'pytorch_memlab MemReporter().report(device="cpu")': memlab_report,
}
"""Contender -> a function making its full report; importing a missing package fails."""


def _reporting(
    report: Report, current: list[Report]
) -> Callable[[], contextlib.AbstractContextManager]:
    """A context in which `current` runs `report`, printing to a discarded buffer."""

    @contextlib.contextmanager
    def reporting() -> Iterator[None]:
        current[:] = [report]
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            # pytorch_memlab's isinstance() over every object trips deprecation warnings
            warnings.simplefilter("ignore")
            yield
        current.clear()

    return reporting


def case(n: int) -> str:
    return f"report {n:,} live CPU tensors"


def measure_time(n: int = 100_000, repeat: int = 5) -> list[timing.Row]:
    """(case, contender, median seconds of one full report, ratio to torchmem's) for each
    contender; None, None for one whose package is not installed."""
    tensors = live_tensors(n)
    current: list[Report] = []

    def work() -> None:
        current[0]()

    contexts = {}
    for name, make in CONTENDERS.items():
        with contextlib.suppress(ImportError):
            contexts[name] = _reporting(make(), current)
    found = timing.medians(work, contexts, repeat)
    del tensors
    return timing.rows(case(n), list(CONTENDERS), found, BASE)


def table_time(rows: list[timing.Row]) -> str:
    """The rows as a markdown table; the ratio column says it is to torchmem's time."""
    header, *rest = timing.table(rows).splitlines()
    return "\n".join([header.replace("| ratio |", "| ratio to torchmem |"), *rest])


# Sizes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeRow:
    """One tensor of the known model, and the bytes each reporter gives it."""

    name: str
    """torchmem's name for it: ``0.weight``, ``0.weight.grad``, ``Adam.0.weight.exp_avg``."""
    shape: tuple[int, ...]
    truth: int
    """Its storage's bytes: ``untyped_storage().nbytes()``."""
    torchmem: int
    """Bytes torchmem's report gives this tensor."""
    memlab: int | None
    """Bytes pytorch_memlab's report gives this tensor (summed over its rows for it);
    None when pytorch_memlab is not installed."""
    memlab_names: tuple[str, ...] = ()
    """The names of pytorch_memlab's rows for this tensor, as its verbose report shows
    them (``name(->owner)`` for a row it counts as sharing another's storage)."""


def known_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``Linear(1024, 1024), ReLU, Linear(1024, 10)`` on CPU after one Adam step on a batch
    of 64: every parameter has a gradient and Adam's ``step``, ``exp_avg``, ``exp_avg_sq``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return model, opt


def named_tensors(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and their gradients, then the optimizer's state tensors,
    named as torchmem names them."""
    names = {id(p): name for name, p in model.named_parameters()}
    found = []
    for name, param in model.named_parameters():
        found.append((name, param))
        if param.grad is not None:
            found.append((f"{name}.grad", param.grad))
    prefix = type(opt).__name__
    for group in opt.param_groups:
        for param in group["params"]:
            for key, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    found.append((f"{prefix}.{names[id(param)]}.{key}", value))
    return found


def torchmem_sizes(
    model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: list[torch.Tensor]
) -> list[int]:
    """Bytes torchmem's report gives each of `tensors`, scanning only the model and `opt`."""
    reporter = torchmem.MemReporter(model, objects=lambda: ())
    reporter.add_optimizer(opt)
    records = [(r.tensor() if r.tensor else None, r.nbytes) for r in reporter.snapshot("cpu")]
    return [sum(nbytes for t, nbytes in records if t is tensor) for tensor in tensors]


def _memlab_order(scanned: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensor behind each of pytorch_memlab's stats, in order: its ``get_stats()``
    skips empty tensors, makes a stat per strided tensor (two for a sparse one, its
    indices' and values'), and one more for a parameter's gradient."""

    def stat_tensors(t: torch.Tensor) -> list[torch.Tensor]:
        if t.is_sparse:
            return stat_tensors(t._indices()) + stat_tensors(t._values())
        return [t]

    order = []
    for t in scanned:
        if t.numel() == 0:
            continue
        order += stat_tensors(t)
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            order += stat_tensors(t.grad)
    return order


def memlab_sizes(
    model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: list[torch.Tensor]
) -> list[tuple[int, tuple[str, ...]]] | None:
    """(bytes, its row names) pytorch_memlab's report gives each of `tensors`, summed over
    its rows for that tensor; None when it is not installed."""
    try:
        reporter = memlab().MemReporter(model)
    except ImportError:
        return None
    reporter.add_optimizer(opt)
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reporter.collect_tensor()
    scanned = list(reporter.device_mapping.get(cpu, []))
    reporter.get_stats()
    stats = reporter.device_tensor_stat.get(cpu, [])
    order = _memlab_order(scanned)
    del scanned
    if len(order) != len(stats):
        raise RuntimeError(
            f"pytorch_memlab made {len(stats)} stats for {len(order)} tensors: its "
            "get_stats() no longer works as this benchmark expects"
        )
    found = []
    for tensor in tensors:
        rows = [
            (name, mem) for (name, _, _, mem), t in zip(stats, order, strict=True) if t is tensor
        ]
        found.append((sum(mem for _, mem in rows), tuple(name for name, _ in rows)))
    return found


def measure_sizes() -> list[SizeRow]:
    """A row per tensor of :func:`known_model` (parameters, gradients, Adam's state): its
    true bytes and the bytes torchmem and pytorch_memlab report for it."""
    model, opt = known_model()
    named = named_tensors(model, opt)
    tensors = [t for _, t in named]
    mine = torchmem_sizes(model, opt, tensors)
    theirs = memlab_sizes(model, opt, tensors)
    return [
        SizeRow(
            name=name,
            shape=tuple(t.shape),
            truth=t.untyped_storage().nbytes(),
            torchmem=mine[i],
            memlab=None if theirs is None else theirs[i][0],
            memlab_names=() if theirs is None else theirs[i][1],
        )
        for i, (name, t) in enumerate(named)
    ]


def _bytes(n: int | None) -> str:
    return "not installed" if n is None else f"{n:,}"


def _error(n: int | None, truth: int) -> str:
    if n is None:
        return "-"
    return f"{n - truth:+,}" if n != truth else "0"


def table_sizes(rows: list[SizeRow]) -> str:
    """The rows as a markdown table, in bytes, with each reporter's error (reported minus
    true bytes), and a last line totalling them."""
    lines = [
        "| tensor | shape | true bytes | torchmem | torchmem error | pytorch_memlab "
        "| pytorch_memlab error | pytorch_memlab rows |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        names = ", ".join(row.memlab_names) if row.memlab is not None else "-"
        lines.append(
            f"| {row.name} | {row.shape} | {row.truth:,} | {row.torchmem:,} "
            f"| {_error(row.torchmem, row.truth)} | {_bytes(row.memlab)} "
            f"| {_error(row.memlab, row.truth)} | {names or '(none)'} |"
        )
    truth = sum(row.truth for row in rows)
    mine = sum(row.torchmem for row in rows)
    installed = all(row.memlab is not None for row in rows)
    theirs = sum(row.memlab or 0 for row in rows) if installed else None
    lines.append(
        f"| total of these {len(rows)} | | {truth:,} | {mine:,} | {_error(mine, truth)} "
        f"| {_bytes(theirs)} | {_error(theirs, truth)} | |"
    )
    return "\n".join(lines)
