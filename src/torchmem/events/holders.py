"""What holds some storages alive: a walk from a program's variables when a recording
stops, then the garbage collector's referrers, in words a report can print; and the
autograd graphs those variables keep across steps.

From each variable of the namespace the recording was given (a script's globals, a
block's locals), not starting with ``_``: a tensor is held by that variable; the items of
a list, tuple, set, deque or dictionary by it (``list `losses```), to :data:`DEPTH`
containers deep; an object's attributes by it (```trainer.cache```); a module's forward
and backward hooks (and pre-hooks), of it and its submodules, by that hook (what their
closures, defaults and bound objects hold). The tensors found so lead to autograd's
graph behind them (:mod:`torchmem.events.graphs`): the tensors its nodes saved for
backward are held by that graph (by the graph of the holder that chains the steps'
graphs, where one does). Storages the walk did not reach are looked for among the tensors
the garbage collector tracks, and their holders named where a module's globals or an
object's attributes hold them (``list `HISTORY` in module test_model``); a tensor nothing
it tracks refers to is held out of its sight (:data:`UNSEEN`: autograd's graph holds the
tensors it saved so). The walk is bounded (:data:`OBJECTS` objects,
:data:`~torchmem.events.graphs.NODES` graph nodes, :data:`TENSORS` tensors).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from torchmem._compat.autograd import Saved
from torchmem._objects import class_name, tracked
from torchmem.events.graphs import Walked, Walks, address, named
from torchmem.records.run import HeldGraph

DEPTH = 3
"""Containers and attributes followed from a variable, at most."""
OBJECTS = 1_000_000
"""Objects the walk looks at, at most."""
TENSORS = 100_000
"""Tensors whose holders are looked for among the garbage collector's objects, at most."""
GRAPH = "held by the autograd graph of "
"""How a storage an autograd graph saved is said to be held (then what holds the graph's
tensor: ``"held by the autograd graph of `total`"``)."""
UNSEEN = "held where the garbage collector cannot see"
"""What holds a tensor no object the garbage collector tracks refers to (autograd's graph
holds the tensors it saved so)."""
_CONTAINERS: dict[type, str] = {
    list: "list",
    tuple: "tuple",
    set: "set",
    dict: "dict",
    collections.deque: "deque",
}
_HOOKS = (
    ("_forward_hooks", "forward hook"),
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_backward_hooks", "backward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
)
_SKIPPED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)


class _Walk:
    def __init__(self, wanted: set[int]) -> None:
        self.wanted = wanted
        self.found: dict[int, str] = {}
        self.seen: set[int] = set()
        self.graphs: dict[str, list[torch.Tensor]] = {}
        """What holds tensors with a graph (``"list `losses`"``) -> those tensors."""
        self.queue: collections.deque[tuple[object, str, str | None, int]] = collections.deque()

    def visit(self, value: object, where: str, name: str | None, depth: int) -> None:
        """Look at `value` in its turn (nearer the variables first), which `where` holds
        (``"list `x`"``); `name` is its path from a variable (``trainer.cache``), None
        where it has none (in a hook's closure)."""
        self.queue.append((value, where, name, depth))

    def run(self) -> None:
        while self.queue and len(self.seen) < OBJECTS:
            value, where, name, depth = self.queue.popleft()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                # Each holder's, even where another holds it too: a list of losses has
                # the loop's last loss.
                self.graphs.setdefault(where, []).append(value)
            if id(value) in self.seen or isinstance(value, _SKIPPED):
                continue
            self.seen.add(id(value))
            if isinstance(value, torch.Tensor):
                self._tensor(value, where)
            elif depth < DEPTH:
                self._inside(value, where, name, depth)

    def _inside(self, value: object, where: str, name: str | None, depth: int) -> None:
        kind = _CONTAINERS.get(type(value))
        if kind is not None:
            items: Iterable[object] = value.values() if isinstance(value, dict) else value  # type: ignore[assignment]
            inner = f"{kind} `{name}`" if name else f"a {kind} in {where}"
            for item in items:
                self.visit(item, inner, None, depth + 1)
        elif isinstance(value, torch.nn.Module):
            self._module(value, name, depth)
        elif name and isinstance(attributes := getattr(value, "__dict__", None), dict):
            for key, item in list(attributes.items()):
                if isinstance(key, str) and not key.startswith("_"):
                    self.visit(item, f"`{name}.{key}`", f"{name}.{key}", depth + 1)

    def _tensor(self, tensor: torch.Tensor, where: str) -> None:
        ptr = address(tensor)
        if ptr in self.wanted:
            self.found.setdefault(ptr, f"held by {where}")

    def _module(self, module: torch.nn.Module, name: str | None, depth: int) -> None:
        for sub, child in module.named_modules():
            path = (f"{name}.{sub}" if sub else name) if name else sub or class_name(module)
            for attribute, kind in _HOOKS:
                for hook in list(getattr(child, attribute, {}).values()):
                    for item in _inside(hook):
                        self.visit(item, f"a {kind} of `{path}`", None, depth + 1)
            for key, item in list(vars(child).items()):
                if not key.startswith("_") and not isinstance(item, torch.nn.Module):
                    self.visit(item, f"`{path}.{key}`", f"{path}.{key}", depth + 1)

    def held_graphs(self, steps_of: Mapping[int, int]) -> list[Walked]:
        """Walk the graphs of the tensors found that the steps made (`steps_of`: storage
        address -> the step that made it), holder by holder; give the storages wanted that
        they saved to the graph of the holder that chains the steps' graphs first, then to
        the others in the walk's order. Saved tensors are read only where some wanted
        storage is still unexplained."""
        unexplained = bool(self.wanted - set(self.found))
        walks = Walks(steps_of if unexplained else None)
        walked = []
        for where, tensors in self.graphs.items():
            # Only those the steps made: a graph from before the recording is none of its
            # steps' (a list a notebook's earlier cell filled).
            mine = [t for t in tensors if address(t) in steps_of]
            if mine:
                walked.append(walks.walk(where, mine))
        listed = named(walked)
        for walk in listed + [w for w in walked if all(w is not n for n in listed)]:
            where = walk.holder if walk.holder[0] == "`" else f"a tensor in {walk.holder}"
            for ptr in walk.saved & self.wanted:
                self.found.setdefault(ptr, GRAPH + where)
        return listed


def _inside(hook: Any) -> Iterator[object]:
    """What a hook holds: its closure's cells, its defaults, its bound object."""
    target = getattr(hook, "__func__", hook)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    yield from getattr(target, "__defaults__", None) or ()
    bound = getattr(hook, "__self__", None)
    if bound is not None:
        yield bound


def holders(
    namespace: Mapping[str, object], wanted: set[int], steps_of: Mapping[int, int]
) -> tuple[dict[int, str], list[HeldGraph]]:
    """For each address of `wanted` (a storage's ``data_ptr()``) that a walk from the
    variables of `namespace` reaches, what holds it: ``"held by list `losses`"``, ``"held
    by a forward hook of `model.fc1`"``, ``"held by the autograd graph of `total`"``, ...
    (the first path found; a variable's own tensors and containers before graphs); and
    the holders that keep autograd graphs of more than one step, those that chain them
    first (`steps_of`: address -> step, of the storages made in steps: see
    :class:`~torchmem.events.graphs.Walks`)."""
    walk = _Walk(wanted)
    graphs: list[Walked] = []
    # The program's objects may do anything when looked at (a property, a __getattr__):
    # what was found before one raises is kept, and the program goes on.
    with contextlib.suppress(Exception):
        for name, value in list(namespace.items()):
            if not name.startswith("_"):
                walk.visit(value, f"`{name}`", name, 0)
        walk.run()
        graphs = walk.held_graphs(steps_of)
        missing = wanted - set(walk.found)
        if missing:
            ours = {id(namespace), id(walk.graphs), id(walk.queue)}
            walk.found.update(_referrers(missing, ours))
    return walk.found, [g.record() for g in graphs]


def _referrers(wanted: set[int], ours: set[int]) -> dict[int, str]:
    """For storages `wanted` the walk from the variables did not reach: what holds the
    tensors that use them, from the garbage collector's referrers (a module's global, a
    list or dictionary one holds, an object's attribute); ``UNSEEN`` where a tensor has
    none that the collector sees (autograd's graph holds what it saved so)."""
    tensors = [
        t for t in tracked(torch.Tensor) if isinstance(t, torch.Tensor) and address(t) in wanted
    ][:TENSORS]
    ours = ours | {id(tensors)}
    by_tensor: dict[int, list[object]] = {id(t): [] for t in tensors}
    for referrer in gc.get_referrers(*tensors):
        if id(referrer) in ours or isinstance(referrer, (types.FrameType, Saved)):
            continue  # a frame of ours, or autograd's graph holding what it saved
        for held in gc.get_referents(referrer):
            if id(held) in by_tensor:
                by_tensor[id(held)].append(referrer)
    found: dict[int, str] = {}
    for tensor in tensors:
        ptr, holders_of = address(tensor), by_tensor[id(tensor)]
        if holders_of:
            found[ptr] = f"held by {_describe(holders_of[0], ours | {id(holders_of)})}"
        else:
            found.setdefault(ptr, UNSEEN)
    return found


def _describe(container: object, ours: set[int]) -> str:
    """A container in words, named by what holds it where that is a module's globals or
    an object's attributes: ``list `HISTORY` in module test_leak``."""
    kind = _CONTAINERS.get(type(container), type(container).__name__)
    modules = {id(vars(m)): m.__name__ for m in list(sys.modules.values()) if m is not None}
    if id(container) in modules:
        return f"a global of module {modules[id(container)]}"
    for owner in gc.get_referrers(container):
        if id(owner) in ours or not isinstance(owner, dict):
            continue
        key = next((k for k, v in owner.items() if v is container), None)
        if key is None:
            continue
        if id(owner) in modules:
            return f"{kind} `{key}` in module {modules[id(owner)]}"
        for obj in gc.get_referrers(owner):
            if getattr(obj, "__dict__", None) is owner:
                return f"{kind} `{type(obj).__name__}.{key}`"
    return f"a {kind}"
