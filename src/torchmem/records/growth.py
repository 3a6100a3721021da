"""A recording's training steps and, where memory rises from step to step, the growth and
what it comes from: parts of :class:`~torchmem.records.run.DeviceRun` (``torchmem run``,
``torchmem.record()``), read by :mod:`torchmem.render.run`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    """One training step on one device (see :attr:`~torchmem.records.run.RunRecord.steps_by`
    for where a step ends), or, in a long run, :attr:`count` steps in a row taken
    together."""

    index: int
    """The step's number, from 0 (the first, where the optimizer's state appears)."""
    start_bytes: int
    """Bytes in use when it began (the end of the step before; the recording's start)."""
    peak_bytes: int
    """The highest bytes in use during it (exact: every allocation counted)."""
    end_bytes: int
    """Bytes in use when it ended."""
    start: float
    """Seconds from the start of the recording to its beginning."""
    end: float
    """Seconds from the start of the recording to its end."""
    count: int = 1
    """How many steps in a row this entry stands for (more than 1 only past
    :data:`STEPS_LISTED` steps): from :attr:`index`, their first start, highest peak and
    last end."""
    ram_bytes: int | None = None
    """The process's resident memory (RSS, bytes) when it ended (the last of
    :attr:`count`); None where it was not read."""

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "count": self.count,
            "start_bytes": self.start_bytes,
            "peak_bytes": self.peak_bytes,
            "end_bytes": self.end_bytes,
            "ram_bytes": self.ram_bytes,
            "start_s": self.start,
            "end_s": self.end,
        }


STEPS_LISTED = 500
"""Entries of :attr:`~torchmem.records.run.DeviceRun.steps` at most: the first step alone,
the others in groups of as many steps in a row as it takes."""


@dataclass(frozen=True)
class GrowthSite:
    """A line whose allocations outlive each step of a growth."""

    file: str
    """As :attr:`~torchmem.records.run.Site.file`; ``<N more lines>`` for the lines past
    those listed, together."""
    line: int
    function: str
    bytes_per_step: int
    """What each step adds there: the bytes its allocations made in the last steps of the
    growth and alive at the last step's end, less those made before and freed in them,
    over the steps (never 0). The sites of a growth sum to its
    :attr:`Growth.bytes_per_step`."""
    source: str | None = None
    """The text of the line, stripped; None where it cannot be read."""
    reason: str | None = None
    """Why they outlive their step, where it was found: ``"held by list `losses`"``,
    ``"kept with its autograd graph (saved for backward by fc1, fc2)"``, ...; None where
    nothing was found."""

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "bytes_per_step": self.bytes_per_step,
            "source": self.source,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class HeldGraph:
    """A variable (an attribute, a container) that keeps autograd graphs of several steps
    alive: their nodes are the process's memory (RAM), and their saved tensors too where no
    backward pass freed them."""

    holder: str
    """What holds it, as the program names it: ```total_loss```, ``list `train_losses```,
    ``tuple `model.hidden```."""
    steps: int
    """How many steps' graphs it keeps (at least that many where not :attr:`complete`)."""
    nodes: int
    """The autograd nodes of those graphs (its parameters' gradient accumulators too)."""
    chained: bool
    """Whether it chains each step's graph to the one before: a tensor it holds has a
    graph that reaches back through the earlier steps (``total_loss += loss``, a hidden
    state kept without ``detach()``), and not one graph per step (a list of losses)."""
    complete: bool = True
    """Whether the walk saw the whole graph (it stops at a bound)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "steps": self.steps,
            "nodes": self.nodes,
            "chained": self.chained,
            "complete": self.complete,
        }


@dataclass(frozen=True)
class Growth:
    """Memory that rises at the end of (nearly) every step after the first: tensor bytes,
    or the process's RAM where a variable keeps autograd graphs of every step."""

    device: str
    bytes_per_step: int
    """The rise of the bytes in use from the end of the step before :attr:`first_step` to
    the end of the last, over the steps: exactly each step's where :attr:`exact`; 0 where
    the tensors do not rise and the growth is the graphs of :attr:`graphs`."""
    first_step: int
    """The first step of the rise (1 or later: the first step's optimizer state is not a
    rise)."""
    steps: int
    """Steps from :attr:`first_step` to the last."""
    exact: bool
    """Whether each of those steps rose by exactly :attr:`bytes_per_step` (False where
    the tensors do not rise)."""
    sites: tuple[GrowthSite, ...] = ()
    """The lines whose allocations outlive their step, most bytes first; their
    :attr:`~GrowthSite.bytes_per_step` sum to :attr:`bytes_per_step`."""
    ram_bytes_per_step: int | None = None
    """The rise of the process's resident memory (RSS) over the same steps, per step (its
    mean: RSS rises by pages, not at every step); None where it was not read."""
    graphs: tuple[HeldGraph, ...] = ()
    """The variables that keep autograd graphs of (nearly) every step: the one that chains
    them first."""

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "bytes_per_step": self.bytes_per_step,
            "first_step": self.first_step,
            "steps": self.steps,
            "exact": self.exact,
            "sites": [s.to_json() for s in self.sites],
            "ram_bytes_per_step": self.ram_bytes_per_step,
            "graphs": [g.to_json() for g in self.graphs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Growth:
        sites = tuple(GrowthSite(**site) for site in data["sites"])
        return cls(
            data["device"],
            data["bytes_per_step"],
            data["first_step"],
            data["steps"],
            data["exact"],
            sites,
            data.get("ram_bytes_per_step"),  # older reports: none
            tuple(HeldGraph(**graph) for graph in data.get("graphs", ())),
        )
