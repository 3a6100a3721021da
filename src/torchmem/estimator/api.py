"""Estimate a function's memory on a device without that device, and the largest batch
that fits.

The function runs once on fake tensors (:mod:`torchmem.estimator.fake`): nothing is
allocated, every allocation and free is logged. For the CPU that log is the answer; for
CUDA it is replayed through a model of PyTorch's caching allocator
(:mod:`torchmem.estimator.allocator`), with cuBLAS's workspaces added at the first matrix
product of the forward and of the backward pass.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from torchmem._compat.fake import data_dependent_operator
from torchmem.errors import EstimateError, OutOfMemory, UnknownValue
from torchmem.estimator import gpus
from torchmem.estimator.allocator import (
    SMALL_BUFFER as SEGMENT_GRANULE,
    CachingAllocator,
    expandable_segments,
)
from torchmem.estimator.fake import FakeRun, run_fake
from torchmem.estimator.ranks import checked_world_size, each_rank
from torchmem.events.analysis import Names, device_run, module_peaks
from torchmem.events.notes import Variable
from torchmem.events.sources import NO_SITE, Log
from torchmem.records import TOP
from torchmem.records.estimate import EstimateRecord
from torchmem.records.run import DeviceRun, ModulePeak
from torchmem.report import Report
from torchmem.resolve import parse_device

CONTEXT_BYTES = 512 * 2**20
"""The allowance for the CUDA context (the driver's and the kernels' memory, outside the
caching allocator) that :meth:`Estimate.fits` adds: about what CUDA 12 takes on an H100
with lazy module loading."""
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's workspace where ``CUBLAS_WORKSPACE_CONFIG`` is not set: PyTorch's default on
compute capability 9.0 (H100, H200), 32 MiB. Older GPUs default to ``:4096:2:16:8``."""
CUBLASLT_WORKSPACE_KIB = 1024
"""cuBLASLt's workspace in KiB where ``CUBLASLT_WORKSPACE_SIZE`` is not set (PyTorch's
default): allocated beside cuBLAS's at the first matrix product with a fused bias
(``addmm``, as ``nn.Linear`` with a bias runs), seen on an H100 with PyTorch 2.11."""
MODELLED = (
    "tensor storages of every operator, as the CPU run allocates them",
    "the caching allocator: 512-byte blocks, small and large pools, 2 MiB / 20 MiB /"
    " 2 MiB-rounded segments, best fit, splitting, merging, expandable segments",
    "cuBLAS workspaces (one per thread: forward and backward), and cuBLASLt's for products"
    " with a fused bias",
    "CUDA autocast's rules of what to cast (not CPU autocast's)",
    "dropout and scaled dot-product attention by CUDA's kernels (a bool mask; FlashAttention"
    " or memory-efficient attention where a GPU takes them)",
    "tensors made on the CPU stay off the GPU until moved (.cuda(), .to('cuda'))",
    "an allowance for the CUDA context (in fits())",
)
NOT_MODELLED = (
    "compiled graphs (torch.compile): the eager operators are estimated",
    "cuDNN and other kernels' own workspaces",
    "scratch tensors of CUDA kernels (reductions' staging buffers, index sorting)",
    "NCCL buffers",
    "backward operators whose CUDA kernels allocate other temporaries than their CPU kernels",
    "more than one stream",
)
CPU_MODELLED = (
    MODELLED[0],
    "tensors PyTorch makes besides the operators' results: Python numbers given for tensors"
    " (kept while autograd keeps them), the CPU kernels' casts to a common dtype, transposed"
    " copies' blocks, checkpoint's copies of the random generator's state",
)
CPU_NOT_MODELLED = (
    "memory kernels allocate without a tensor (oneDNN's scratch space)",
    "tensors some CPU kernels make inside themselves (a matrix product's copy of a"
    " broadcast operand; GELU's, LayerNorm's, embedding's, attention's and convolution's"
    " backward; MSE's and BCE with logits' forward)",
    "gradients autograd adds up in place (counted as a new tensor)",
    "the process group's own buffers (gloo copies what one rank scatters to the others)",
)
COMPILED = (
    "fn compiled code with torch.compile: compiled graphs are not modelled (their"
    " operators and buffers differ from eager ones); this estimate is of the eager"
    " operators, and a real compiled Transformer forward took 9.9% more."
)
MAX_BATCH = 2**40
"""The largest batch :func:`max_batch_size` tries."""


@dataclass(frozen=True)
class Estimate(EstimateRecord, Report):
    """What :func:`estimate` returns (the fields are
    :class:`~torchmem.records.estimate.EstimateRecord`'s): prints as a table, shows as HTML
    in Jupyter, and says whether it :meth:`fits` a device's memory."""

    renderer = "estimate"
    requests: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """The allocations and frees, in order, for :attr:`needed_bytes` to replay: bytes of an
    allocation, or ``-(k + 1)`` for the free of the k-th allocation."""

    def fits(self, capacity: int | float | str) -> bool:
        """Whether the step fits in `capacity` (bytes, a size string like ``"80 GiB"``, or
        a GPU's name of :data:`~torchmem.estimator.gpus.GPUS`, ``"H100-80GB"``): whether
        it is at least :attr:`needed_bytes`."""
        return gpus.capacity(capacity) >= self.needed_bytes

    @cached_property
    def needed_bytes(self) -> int:
        """The least memory the device must have for the step to run: on the CPU the peak;
        on CUDA the least the allocator model needs to reserve (a multiple of 2 MiB), plus
        :attr:`context_bytes`. Like PyTorch before it raises an out-of-memory error, the
        model releases wholly free cached segments when a new one would not fit, so this
        can be less than :attr:`reserved_bytes` (reached with no limit) plus the context."""
        if self.device == "cpu":
            return self.peak_bytes
        # The reserve needed lies between the bytes allocated at the peak and the reserve
        # reached without a limit; segments are whole multiples of 2 MiB.
        low = -(-self.peak_bytes // SEGMENT_GRANULE) - 1  # in granules; known not to do
        high = -(-self.reserved_bytes // SEGMENT_GRANULE)  # known to do
        while high - low > 1:
            middle = (low + high) // 2
            allocator = CachingAllocator(
                middle * SEGMENT_GRANULE, expandable=self.expandable_segments
            )
            if _replay(self.requests, allocator):
                high = middle
            else:
                low = middle
        return high * SEGMENT_GRANULE + self.context_bytes


def estimate(
    fn: Callable[..., Any],
    *args: Any,
    device: str = "cuda",
    world_size: int = 1,
    **kwargs: Any,
) -> Estimate:
    """The memory ``fn(*args, **kwargs)`` needs on `device`, from one run in which every
    tensor it makes is fake: nothing is allocated, so a batch of any size takes no memory
    here. `fn` builds what it needs (the model, the optimizer, the inputs), as a
    training script does; pass it sizes, not tensors.

    Args:
        device: ``"cuda"`` (PyTorch's caching allocator on a GPU: the default, and no GPU
            is needed) or ``"cpu"`` (CPU tensors: the same peak a real CPU run measures).
            For ``"cuda"``, only what would be on the GPU counts: tensors made with
            ``device="cuda"``, copied there with ``.cuda()`` or ``.to("cuda")``, and made
            from GPU tensors (a model built on the CPU costs its copy only), and
            ``torch.autocast("cuda", dtype=...)`` casts by CUDA's rules.
        world_size: ranks of a distributed job: above 1, `fn` runs as each rank in turn on
            PyTorch's fake process group (:mod:`~torchmem.estimator.ranks`; CPU tensors
            only, for now), and the rank with the highest peak is returned, every rank's
            in its ``ranks``.

    Operators whose result depends on tensor values cannot run on fake tensors: a read
    of one value (``loss.item()``) gives 1, or False (a note says so), while those whose output's
    shape depends on values (``nonzero``, boolean masks) raise :class:`EstimateError`
    naming the operator.
    """
    target = _target(device)
    if checked_world_size(world_size) > 1:
        return each_rank(lambda: estimate(fn, *args, device=device, **kwargs), world_size)
    cuda = target == "cuda"
    workspace = _workspace_bytes() if cuda else 0  # its setting read first
    _check_arguments((*args, *kwargs.values()))
    started = time.perf_counter()
    fake = _run(fn, args, kwargs, cuda=cuda)
    notes = _notes(fake, cuda=cuda)
    log, reserved, expandable = fake.log, None, False
    requests: tuple[int, ...] = ()
    if cuda:
        log, reserved, expandable, requests = _replayed(fake, workspace)
    run, modules = _tallied(fake, log, target, reserved)
    return Estimate(
        device=target,
        peak_bytes=run.peak_bytes,
        reserved_bytes=run.peak_bytes if reserved is None else reserved,
        categories=dict(run.categories_at_peak or {}),
        modules=modules,
        run=run,
        context_bytes=CONTEXT_BYTES if cuda else 0,
        workspace_bytes=workspace,
        expandable_segments=expandable,
        modelled=MODELLED if cuda else CPU_MODELLED,
        not_modelled=NOT_MODELLED if cuda else CPU_NOT_MODELLED,
        notes=tuple(notes),
        seconds=time.perf_counter() - started,
        function=getattr(fn, "__qualname__", repr(fn)),
        requests=requests,
    )


def _replayed(fake: FakeRun, workspace: int) -> tuple[Log, int, bool, tuple[int, ...]]:
    """The fake run's log replayed through the caching allocator's model (see
    :func:`_on_cuda`), the highest bytes it reserved, whether its segments were
    expandable, and the requests for :attr:`Estimate.needed_bytes`."""
    expandable = expandable_segments()
    allocator = CachingAllocator(expandable=expandable)
    log, requests = _on_cuda(fake, allocator, workspace)
    return log, allocator.reserved_peak, expandable, requests


def _check_arguments(values: Sequence[Any]) -> None:
    """A TypeError for a tensor, a model or an optimizer among `values`: fn must make
    them, to make them fake."""
    for value in values:
        if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            raise TypeError(
                f"estimate() got a {type(value).__name__}: it fakes only what fn makes, so"
                " build tensors, models and optimizers inside fn and pass it sizes"
            )


def _run(fn: Callable[..., Any], args: Any, kwargs: Any, *, cuda: bool) -> FakeRun:
    """``fn(*args, **kwargs)`` run on fake tensors; an :class:`EstimateError` where it needs
    a tensor's values."""
    try:
        return run_fake(fn, args, kwargs, cuda=cuda)
    except UnknownValue as exc:
        raise EstimateError(str(exc)) from None
    except Exception as exc:
        operator = data_dependent_operator(exc)
        if operator is None:
            raise
        raise EstimateError(
            f"{operator} cannot run on fake tensors: its output's shape depends on the"
            " values of a tensor, which an estimate does not have. Give the shape a"
            " fixed size (e.g. a mask multiplied in instead of indexed with)."
        ) from None


def _tallied(
    fake: FakeRun, log: Log, target: str, reserved: int | None
) -> tuple[DeviceRun, tuple[ModulePeak, ...]]:
    """The run of `log` (the fake run's, or its replay on CUDA) on device `target`, with
    `reserved` the allocator's highest reserve in bytes (None on the CPU), and each
    module's peak."""
    names = Names(fake.watcher)
    variables = {
        -1: Variable("cuBLAS workspace (forward)", None, None),
        -2: Variable("cuBLAS workspace (backward)", None, None),
        -3: Variable("cuBLASLt workspace (forward)", None, None),
        -4: Variable("cuBLASLt workspace (backward)", None, None),
    }
    found = log.tally(fake.watcher.notes, every_device=True)
    run = device_run(found, fake.stop, names, fake.watcher.names, variables, TOP)
    run = dataclasses.replace(run, device=target, reserved_peak_bytes=reserved)
    modules = module_peaks(
        found.tally, target, fake.watcher.modules, names.modules, fake.watcher.calls
    )
    return run, modules


def _notes(fake: FakeRun, *, cuda: bool) -> list[str]:
    """What a reader of the estimate must know of its fake run: what it assumed, and what
    ran otherwise than on a GPU."""
    notes = []
    if cuda and not len(fake.log.events):
        notes.append(
            "No tensor was on the GPU: fn made its tensors on the CPU. Build them with"
            " device='cuda' or move them (.cuda(), .to('cuda')), as on a GPU."
        )
    if fake.compiled:
        notes.append(COMPILED)
    if fake.loaders:
        notes.append(
            f"DataLoader workers: {fake.loaders} pass(es) over a DataLoader with num_workers > 0"
            " made their batches in this process (an estimate follows one process); the"
            " batches, and the memory they take in the step, are the same."
        )
    if fake.spread:
        notes.append(
            f"Assumed: the choices of {fake.spread} topk call(s) on values the estimate does"
            " not know (a mixture of experts' router) are spread evenly, each candidate"
            " (expert) chosen as often as the others."
        )
    if fake.reads:
        notes.append(
            f"{fake.reads} value(s) read from tensors (.item(), bool(t)) were taken as 1"
            " (False for booleans): fake tensors have no values."
        )
    return notes


def max_batch_size(
    fn: Callable[..., Any],
    capacity: int | float | str,
    *args: Any,
    device: str = "cuda",
    world_size: int = 1,
    **kwargs: Any,
) -> int:
    """The largest batch size b for which ``estimate(fn, b, *args, device=device,
    **kwargs)`` :meth:`~Estimate.fits` `capacity` (bytes, a size string like ``"80 GiB"``,
    or a GPU's name, ``"H100-80GB"``); 0 if not even a batch of 1 fits. With a
    `world_size`, every rank's memory must fit (the batch is each rank's).

    `fn` takes the batch size first. Memory is assumed to grow with the batch: two
    estimates (batch 1, and 2 or the first doubling whose memory differs) give the bytes
    per sample, secant steps move from there toward the edge, and a few more estimates
    around it find the exact batch, so a search costs about ten estimates however large
    the answer.
    """
    limit = gpus.capacity(capacity)
    _target(device)
    search = _Search(
        lambda batch: estimate(fn, batch, *args, device=device, world_size=world_size, **kwargs),
        limit,
        capacity,
    )
    if not search.fits(1):
        return 0
    x0, x1 = search.growing()
    search.secant(x0, x1)
    return search.edge()


class _Search:
    """:func:`max_batch_size`'s estimates, each batch's made once, and its steps."""

    def __init__(self, run: Callable[[int], Estimate], limit: int, capacity: object) -> None:
        self.run = run
        """The estimate of a batch size."""
        self.limit = limit
        """Bytes the batch must fit in."""
        self.capacity = capacity
        """The capacity as given, for messages."""
        self.found: dict[int, Estimate] = {}
        self.verdicts: dict[int, bool] = {}

    def fits(self, batch: int) -> bool:
        if batch > MAX_BATCH:
            raise EstimateError(f"no batch up to {MAX_BATCH} fills {self.capacity!r}")
        if batch not in self.verdicts:
            self.found[batch] = self.run(batch)
            self.verdicts[batch] = self.found[batch].fits(self.limit)
        return self.verdicts[batch]

    def bracket(self) -> tuple[int, int]:
        """The largest batch known to fit, and the smallest known not to."""
        low = max(b for b, ok in self.verdicts.items() if ok)
        high = min((b for b, ok in self.verdicts.items() if not ok), default=MAX_BATCH + 1)
        return low, high

    def growing(self) -> tuple[int, int]:
        """Batch 1 and the first doubling whose estimate is larger (small batches may
        share one segment), or the first that does not fit."""
        found = self.found
        x0, x1 = 1, 2
        while self.fits(x1) and found[x1].peak_bytes <= found[x0].peak_bytes:
            if x1 >= 2**16:
                raise EstimateError(
                    f"{found[1].function}'s estimate does not grow with the batch size"
                    f" ({found[1].peak_bytes} bytes at 1 and at {x1}): is the batch size"
                    " its first argument?"
                )
            x1 *= 2
        return x0, x1

    def secant(self, x0: int, x1: int) -> None:
        """Secant steps on the peak toward the capacity less the overhead (segments,
        context) seen at the last batch: memory grows about linearly with the batch, so
        they land within a few batches of the edge."""
        found = self.found
        for _ in range(6):
            low, high = self.bracket()
            y0, y1 = found[x0].peak_bytes, found[x1].peak_bytes
            if y1 == y0 or high - low <= 1:
                break
            room = self.limit - (found[x1].needed_bytes - y1)
            guess = min(max(x1 + (room - y1) * (x1 - x0) // (y1 - y0), low + 1), high - 1)
            if guess in self.verdicts:
                break
            self.fits(guess)
            x0, x1 = x1, guess

    def edge(self) -> int:
        """The largest batch that fits: where no batch tried failed yet, the step doubles
        up until one does; then the bracket is halved."""
        low, high = self.bracket()
        step = 1
        while high > MAX_BATCH and self.fits(low + step):
            low, step = low + step, step * 2
            low, high = self.bracket()
        low, high = self.bracket()
        while high - low > 1:
            middle = (low + high) // 2
            if self.fits(middle):
                low = middle
            else:
                high = middle
        return low


def _target(device: str) -> str:
    """The device type an estimate is for: spelled as PyTorch spells devices, but not
    looked for on this machine (an estimate is for a GPU one may not have)."""
    try:
        kind = parse_device(device).type
    except ValueError:  # PyTorch's list of every device type says less than ours
        kind = None
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"cannot estimate for device {device!r}: use 'cuda' or 'cpu'")
    return kind


def _workspace_bytes(config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace by ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
    pairs), by default :data:`CUBLAS_WORKSPACE_CONFIG`."""
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") or CUBLAS_WORKSPACE_CONFIG
    numbers = [int(n) for n in config.split(":") if n.strip().isdigit()]
    if not numbers or len(numbers) % 2:
        raise ValueError(f"cannot read CUBLAS_WORKSPACE_CONFIG {config!r}: expected ':4096:8'")
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2], strict=True))


def _on_cuda(
    fake: FakeRun, allocator: CachingAllocator, workspace: int
) -> tuple[Log, tuple[int, ...]]:
    """The fake run's log as the caching allocator would serve it: each allocation the
    size of its block, and the workspaces added, never freed: cuBLAS's (`workspace` bytes,
    at addresses -1 and -2 for the forward and the backward thread) and cuBLASLt's (-3,
    -4); and the requests for :meth:`Estimate.fits`."""
    rows = fake.log.events.tolist()
    lt = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE") or CUBLASLT_WORKSPACE_KIB) * 1024
    workspaces: dict[int, list[tuple[int, int]]] = {}
    for index, backward, fused in fake.matmuls:
        address = -(1 + backward + 2 * fused)
        workspaces.setdefault(index, []).append((address, lt if fused else workspace))
    out: list[list[int]] = []
    requests: list[int] = []
    moved: dict[int, int] = {}  # allocation row in the fake log -> its row here
    blocks: dict[int, tuple[Any, int]] = {}  # row here -> (block, k: the k-th allocation)
    allocations = 0

    def allocate(when: int, address: int, nbytes: int, site: int) -> int:
        nonlocal allocations
        block = allocator.malloc(nbytes)
        blocks[len(out)] = (block, allocations)
        allocations += 1
        requests.append(nbytes)
        out.append([when, address, block.size, site, -1])
        return len(out) - 1

    for index in range(len(rows) + 1):
        for address, nbytes in workspaces.get(index, ()):
            when = rows[index][0] if index < len(rows) else fake.stop
            allocate(when, address, nbytes, NO_SITE)
        if index == len(rows):
            break
        when, address, nbytes, site, other = rows[index]
        if nbytes > 0:
            moved[index] = allocate(when, address, nbytes, site)
            continue
        block, request = blocks.pop(moved[other])
        size = block.size  # free() merges the block with its free neighbours
        allocator.free(block)
        out[moved[other]][4] = len(out)
        requests.append(-(request + 1))
        out.append([when, address, -size, NO_SITE, moved[other]])
    events = torch.tensor(out, dtype=torch.int64).reshape(-1, 5)
    log = Log("cpu", 0, fake.log.start, events, fake.log.sites)  # marks name "cpu"
    return log, tuple(requests)


def _replay(requests: Sequence[int], allocator: CachingAllocator) -> bool:
    """Whether `allocator` serves every request without running out of memory."""
    blocks = []
    try:
        for request in requests:
            if request >= 0:
                blocks.append(allocator.malloc(request))
            else:
                allocator.free(blocks[-request - 1])
    except OutOfMemory:
        return False
    return True
