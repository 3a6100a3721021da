"""Autograd graphs a program's variables keep alive: how many steps' graphs each keeps,
whether it chains them (each step's graph reaching the one before through it), and what
tensors they saved.

A walk from each holder's tensors (a variable's, a container's, an attribute's: see
:mod:`torchmem.events.holders`) down ``grad_fn.next_functions``, with a stack, not
recursion, each node once per holder, at most :data:`NODES` nodes over all holders. The
steps a holder keeps are told, where its graphs saved tensors that are still alive (no
backward pass freed them), by the steps that made those tensors; else by its parameters'
gradient accumulators: each step's forward pass makes new nodes that reach every
parameter it used, so the parameter the graphs reach the fewest times is reached once per
step (counted where a parameter is used once a step: a model's last layer, a loss's).
A holder chains where a tensor of it alone keeps more than one step's graph (its most
recent: a list's last item); where several do and their graphs share nodes (a loss
computed from a hidden state that chains), the one an object's attribute holds is named
(state a model keeps across steps), else the one with the fewest nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchmem._compat.autograd import saved_tensors
from torchmem.records.run import HeldGraph

NODES = 1_000_000
"""Autograd nodes the walks look at, over all holders, at most (a few microseconds each:
the 160,004 nodes of 20,000 small steps' graphs take 0.45 s)."""
LOOKED = 100_000
"""Nodes whose saved tensors are read, at most: reading those a backward pass freed
costs PyTorch an exception each (about 13 microseconds)."""
_ACCUMULATOR = "AccumulateGrad"


@dataclass(eq=False)
class Walked:
    """One holder's graphs, as walked."""

    holder: str
    nodes: int = 0
    steps: int = 0
    """Steps whose graphs it keeps; 0 where that cannot be told."""
    chained: bool = False
    complete: bool = True
    seen: set[Any] = field(default_factory=set)
    """The nodes walked (held, so that no other node takes an id of theirs meanwhile)."""
    saved: set[int] = field(default_factory=set)
    """Addresses of the saved tensors found among those asked for."""

    def record(self) -> HeldGraph:
        return HeldGraph(self.holder, self.steps, self.nodes, self.chained, self.complete)


class Walks:
    """The walks of a recording's holders, sharing one bound.

    Args:
        steps_of: address of a storage made in a step -> that step; the saved tensors found
            among them tell the steps a graph keeps. None: saved tensors are not read.
    """

    def __init__(self, steps_of: Mapping[int, int] | None) -> None:
        self.steps_of = steps_of
        self.left = NODES
        self.looked = LOOKED
        self._params: dict[Any, bool] = {}

    def walk(self, holder: str, tensors: Sequence[torch.Tensor]) -> Walked:
        """The graphs of `tensors` (what `holder` holds), the last tensor first: what it
        alone keeps tells whether the holder chains."""
        found = Walked(holder)
        reached: dict[Any, int] = {}  # a parameter's gradient accumulator -> edges into it
        steps: set[int] = set()
        for index, tensor in enumerate(reversed(tensors)):
            found.complete &= self._walk(tensor.grad_fn, found, reached, steps)
            if index == 0:
                found.chained = _steps(reached, steps) > 1
        found.steps = _steps(reached, steps)
        return found

    def _walk(self, top: Any, found: Walked, reached: dict[Any, int], steps: set[int]) -> bool:
        """Walk from node `top`; False where the bound stopped it."""
        todo = [top]
        seen = found.seen
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            if self.left <= 0:
                return False
            self.left -= 1
            seen.add(node)
            found.nodes += 1
            if self.steps_of is not None and self.looked > 0:
                self.looked -= 1
                self._saved(node, found, steps)
            for child, _ in node.next_functions:
                if child is not None and self._parameter(child):
                    reached[child] = reached.get(child, 0) + 1
                todo.append(child)
        return True

    def _saved(self, node: Any, found: Walked, steps: set[int]) -> None:
        assert self.steps_of is not None
        for tensor in saved_tensors(node):
            ptr = address(tensor)
            step = self.steps_of.get(ptr)
            if step is not None:
                steps.add(step)
                found.saved.add(ptr)

    def _parameter(self, node: Any) -> bool:
        """Whether `node` accumulates a parameter's gradient."""
        known = self._params.get(node)
        if known is None:
            known = self._params[node] = type(node).__name__ == _ACCUMULATOR and isinstance(
                getattr(node, "variable", None), torch.nn.Parameter
            )
        return known


def _steps(reached: dict[Any, int], steps: set[int]) -> int:
    """The steps a graph keeps: those of its saved tensors where it has some, else the
    fewest edges into one of its parameters' gradient accumulators (0: none)."""
    if steps:
        return len(steps)
    return min(reached.values(), default=0)


def named(walked: list[Walked]) -> list[Walked]:
    """The holders to name, those that chain first: of the holders that chain and share
    nodes, one (an attribute's, else the fewest nodes); the others where they keep more
    than one step's graphs (a list of losses, each with its graph)."""
    chains = [w for w in walked if w.chained]
    groups: list[list[Walked]] = []
    for walk in chains:
        joined = [g for g in groups if any(_share(walk, other) for other in g)]
        merged = [walk] + [w for g in joined for w in g]
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    chosen = [min(group, key=lambda w: (not _attribute(w.holder), w.nodes)) for group in groups]
    chosen.sort(key=lambda w: next(i for i, c in enumerate(chains) if c is w))
    return chosen + [w for w in walked if not w.chained and w.steps > 1]


def _share(one: Walked, other: Walked) -> bool:
    """Whether two holders' graphs share a node (not a gradient accumulator: those of the
    parameters are in every graph)."""
    small, large = sorted((one.seen, other.seen), key=len)
    return any(node in large and type(node).__name__ != _ACCUMULATOR for node in small)


def _attribute(holder: str) -> bool:
    """Whether `holder` (``"tuple `model.hidden`"``) is an object's attribute."""
    parts = holder.split("`")
    return len(parts) > 2 and "." in parts[1]


def address(tensor: torch.Tensor) -> int:
    """Where `tensor`'s storage is (its ``data_ptr()``, the address the event logs have);
    0 where it has none."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # no storage (sparse, a wrapper subclass)
        return 0
