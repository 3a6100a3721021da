"""What a recording learns from PyTorch's global hooks while the user's code runs.

Models and optimizers are discovered without the user naming them: a global module
forward hook sees every module called, a global optimizer step hook every optimizer
stepped, and saved-tensor hooks every tensor autograd keeps for the backward pass. Each
sighting is a mark: now, the storage at this address is a parameter, a gradient,
optimizer state, a module's buffer or an activation. The tally gives each allocation the
first category of :data:`~torchmem.records.run.CATEGORIES` it was marked with.

Each module's forward call is a probe that opens and closes; so is its backward, from the
moment the gradient of one of its outputs is ready to the last moment a gradient of one of
its inputs (or, where no input needs one, of its parameters) is. Marks and probes go, as
rows of :mod:`torchmem.events.tally`'s stream, to a :class:`Sink`: the counting
allocator's log for CPU tensors (in order with its allocations), a :class:`Notes` buffer
for the others. Nothing the watcher keeps grows with the run's length.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.graph
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from torchmem._compat import (
    autograd,
    disable_dynamo,
    fsdp,
    inner_tensors,
    is_traceable_wrapper_subclass,
    keep_dynamo_out,
    own_buffers,
    own_parameters,
    skip_dynamo_frames,
)
from torchmem._objects import class_name, models_and_optimizers, within
from torchmem.events import saved
from torchmem.events.notes import NameTable, Notes, Tree
from torchmem.events.phases import FORWARD, STEP, Phases
from torchmem.events.probes import Backward, numbers
from torchmem.events.tally import CLOSE, HIT, MARK, OPEN, STEP as STEP_ROW

if TYPE_CHECKING:
    from torchmem.meters.native import CpuAllocatorLibrary

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS, COMMUNICATION, ACTIVATIONS, OTHER = range(7)
"""Category indices, in the order of :data:`~torchmem.records.run.CATEGORIES`."""
PENDING = 8
"""Backward passes awaited per module at most (more forward calls drop the oldest)."""


CATCH_UP = 64
"""Module calls between two looks at how far the CPU log's draining lags."""


class Watcher:
    """Installs the global hooks on :meth:`start` and removes every one on :meth:`stop`.

    Use from the thread that will run the user's code: saved-tensor hooks are per thread.

    Args:
        address: what a mark's ``ptr`` is for a tensor (default: its storage's
            ``data_ptr()``, the address an allocator's log has).
    """

    def __init__(self, address: Callable[[torch.Tensor], int] | None = None) -> None:
        self._address = address or _data_ptr
        # Whether a parameter moved, read at every module call: a tensor's own data_ptr()
        # where it has one (no storage object made), else the given address (fake tensors).
        self._where = address or torch.Tensor.data_ptr
        self._log: CpuAllocatorLibrary | None = None
        self._catch_up: Callable[[], None] | None = None
        self._since = 0
        self.notes: Notes | None = None
        self.names = NameTable()
        # Nothing here holds the user's modules, optimizers or tensors alive: a model the
        # program drops is freed as it would be without us.
        self.modules: dict[int, str] = {}
        """Every module called, by id, in the order of first call: its class's name."""
        self.roots: list[int] = []
        """The ids of modules called while no other module's forward ran (and of those
        :meth:`stop` found held), in order."""
        self.trees: dict[int, Tree] = {}
        """Each root's modules and parameters, by id: as when last seen alive."""
        self.optimizers: weakref.WeakValueDictionary[int, torch.optim.Optimizer] = (
            weakref.WeakValueDictionary()
        )
        self.calls: dict[int, int] = {}
        self.phases = Phases()
        """The forward calls of the roots, the backward passes through them, the steps."""
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        self._pending: dict[int, list[Backward]] = {}
        self._saved = False
        """Whether this watcher's saved-tensor hooks are on this thread's stack."""
        self._roots: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._known: weakref.WeakValueDictionary[int, torch.nn.Module] = (
            weakref.WeakValueDictionary()
        )  # modules seen, or alive at the end
        self._params: dict[int, list[int]] = {}
        self._param_hooks: dict[int, RemovableHandle] = {}
        self._waiting: dict[int, set[Backward]] = {}
        """id() of a parameter -> the backward passes waiting for its gradient."""
        self._marked: dict[int, tuple[Any, ...]] = {}
        """id() of a module or optimizer -> where its tensors were when last marked."""
        self._fsdp: dict[int, weakref.ref[Any]] = {}
        """id() of a module ``fully_shard`` made -> its parameter group."""
        self._gathered: set[int] = set()
        """id() of the modules whose parameters FSDP2 shards: a plain tensor among them is
        an unsharded parameter, all-gathered for a forward or backward pass."""
        self._hooks = [
            _eager_only(h) for h in (self._forward_pre, self._forward, self._step_pre, self._step)
        ]
        self._saved_hooks = (_opaque(self._pack), _opaque(autograd.unpack))
        self._accumulated_hook = _opaque(self._accumulated)

    # Installing ------------------------------------------------------------------------

    def use(
        self,
        log: CpuAllocatorLibrary | None = None,
        notes: Notes | None = None,
        names: NameTable | None = None,
        catch_up: Callable[[], None] | None = None,
    ) -> None:
        """Where marks and probes go, before :meth:`start`.

        Args:
            log: the counting CPU allocator, recording: CPU tensors' marks, and the probes,
                go into its log.
            notes: where the other marks go, and the probes too.
            names: the table marks' names go to (shared by the recordings a log serves).
            catch_up: called every :data:`CATCH_UP` module calls, to tally the log where
                its thread fell behind.
        """
        if log is not None:
            self._log = log
        if catch_up is not None:
            self._catch_up = catch_up
        if notes is not None:
            self.notes = notes
        if names is not None:
            self.names = names

    def start(self) -> None:
        modules = torch.nn.modules.module
        forward_pre, forward, step_pre, step = self._hooks
        self._handles = [
            modules.register_module_forward_pre_hook(forward_pre),
            modules.register_module_forward_hook(forward, always_call=True),
            register_optimizer_step_pre_hook(step_pre),
            register_optimizer_step_post_hook(step),
        ]
        # Not inside a region that forbids saved-tensor hooks (a torch.func transform):
        # activations go unseen there, as in every region where ours step aside.
        if autograd.saved_tensors_hooks_enabled():
            autograd.push_saved_tensors_hooks(*self._saved_hooks)
            self._saved = True
            saved.step_aside.watch(self._saved_hooks[0])

    def stop(self, held: Iterable[object] = ()) -> None:
        """Remove every hook, then mark what the modules and optimizers hold: those seen,
        and those among `held` (the recorded code's variables, and what their lists,
        tuples, dictionaries and attributes hold) that never ran while the hooks watched;
        the outermost of those modules name their parameters, as those that ran do. No walk
        over every object of the process: a model that never ran and that no variable
        holds is not looked for."""
        if self._saved:
            saved.step_aside.forget(self._saved_hooks[0])
            saved.remove(self._saved_hooks[0])
            self._saved = False
        for handle in self._handles:
            handle.remove()
        for pending in self._pending.values():
            for backward in pending:
                self._close(backward)
        for handle in self._param_hooks.values():
            handle.remove()
        self._handles, self._pending, self._param_hooks, self._waiting = [], {}, {}, {}
        roots, optimizers = models_and_optimizers(within(held))
        for root in roots:
            self._found_root(root)
            for module in root.modules():
                self._known.setdefault(id(module), module)
        for key, ref in self._roots.items():  # their trees now, where they are alive
            if (alive := ref()) is not None:
                self.trees[key] = Tree.of(alive)
        for optimizer in optimizers:
            self.optimizers.setdefault(id(optimizer), optimizer)
        self._marked.clear()  # all of it once more: the notes of a long run may have lost some
        for module in list(self._known.values()):
            self._mark_module(module)
        for optimizer in list(self.optimizers.values()):
            self._mark_optimizer(optimizer, grads=True)

    # Marks -----------------------------------------------------------------------------

    def mark(self, tensor: torch.Tensor, category: int, name: tuple[Any, ...] | None) -> None:
        inner = inner_tensors(tensor)  # a wrapper subclass's bytes (a DTensor's local shard)
        for part in inner:
            self.mark(part, category, name)
        try:
            ptr = 0 if inner else self._address(tensor)
        except Exception:  # no storage of its own (sparse tensors)
            ptr = 0
        if not ptr:
            return
        log = self._log
        if log is not None and tensor.is_cpu:
            seq = log.mark(ptr, category)
            if seq == -1:
                return
            storage = tensor.untyped_storage()
            if seq == -2:  # made before the log started: adopted if PyTorch's allocator made it
                if not storage.resizable() or storage.is_shared():
                    return
                log.adopt_row(ptr, storage.nbytes())
                seq = log.mark(ptr, category)
            if seq >= 0:
                payload = self.names.intern(name, tensor) << 3 | category
                log.note(MARK, ptr, storage.nbytes(), payload, seq)
        elif self.notes is not None:
            payload = self.names.intern(name, tensor) << 3 | category
            self.notes.mark(ptr, payload, str(tensor.device))

    def _inner_places(self, tensors: Iterable[torch.Tensor | None]) -> tuple[int, ...]:
        """Where the inner tensors of the wrapper subclasses among `tensors` (and of their
        gradients) are."""
        found: list[int] = []
        for tensor in tensors:
            for outer in (tensor, None if tensor is None else tensor.grad):
                if outer is not None:
                    found += [self._where(inner) for inner in inner_tensors(outer)]
        return tuple(found)

    def _mark_collectives(self, key: int) -> None:
        """Mark the buffers of the collectives of the FSDP2 module of id `key`."""
        for buffer, owner in fsdp.buffers(self._fsdp[key]()):
            name = ("collectives", key) if owner is None else (owner[2], id(owner[0]), owner[1])
            self.mark(buffer, COMMUNICATION, name)

    def _probe(self, kind: int, number: int, module: int, ref: int) -> None:
        if (
            kind != OPEN and module in self._fsdp
        ):  # a forward's end, a backward's: before FSDP reshards
            self._mark_collectives(module)
        if ref == 1:  # a root's backward pass (depth 0)
            if kind == OPEN:
                self.phases.opened(number)
            elif kind == HIT:
                self.phases.hit(number)
            else:
                self.phases.closed(number)
        if self._log is not None:
            self._log.note(kind, number, 0, module, ref)
        if self.notes is not None:
            self.notes.probe(kind, number, module, ref)

    def _mark_module(self, module: torch.nn.Module) -> None:
        """Mark `module`'s own parameters, their gradients and its buffers."""
        params, buffers = own_parameters(module), own_buffers(module)
        # Marked again only where one of them is not where it was last time.
        try:
            where = tuple(
                (self._where(p), -1 if p.grad is None else self._where(p.grad))
                for p in params.values()
                if p is not None
            ) + tuple(self._where(b) for b in buffers.values() if b is not None)
        except RuntimeError:  # no storage to see: torch.func's tensors (functional_call)
            return
        if (0, -1) in where or (0, 0) in where or 0 in where:  # a DTensor's address: 0
            where += self._inner_places([*params.values(), *buffers.values()])
        if self._marked.get(id(module)) == where:
            return
        self._marked[id(module)] = where
        gathered = id(module) in self._gathered
        for attribute, param in params.items():
            if param is not None:
                if gathered and not is_traceable_wrapper_subclass(param):
                    self.mark(param, COMMUNICATION, ("gathered", id(module), attribute))
                else:
                    self.mark(param, PARAMETERS, ("param", id(module), attribute))
                if param.grad is not None:
                    self.mark(param.grad, GRADIENTS, ("grad", id(module), attribute))
        for attribute, buffer in buffers.items():
            if buffer is not None:
                self.mark(buffer, BUFFERS, ("buffer", id(module), attribute))

    def _mark_optimizer(self, optimizer: torch.optim.Optimizer, grads: bool) -> None:
        if grads:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self.mark(param.grad, GRADIENTS, ("grad-of", id(param)))
        state = [
            (param, key, value)
            for param, values in optimizer.state.items()
            for key, value in values.items()
            if isinstance(value, torch.Tensor)
        ]
        try:
            where = tuple(self._where(value) for _, _, value in state)
        except RuntimeError:  # no storage to see: torch.func's tensors
            return
        if 0 in where:
            where += self._inner_places([value for _, _, value in state])
        if self._marked.get(id(optimizer)) == where:
            return
        self._marked[id(optimizer)] = where
        kind = type(optimizer).__name__
        for param, key, value in state:
            self.mark(value, OPTIMIZER_STATE, ("state", kind, id(param), key))

    # Hooks ---------------------------------------------------------------------------

    def _stack(self) -> list[tuple[int, int]]:
        """This thread's modules in their forward calls: (id, probe number)."""
        stack: list[tuple[int, int]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        key = id(module)
        if key not in self.modules:
            self.modules[key] = class_name(module)
            self._known[key] = module
            self.calls[key] = 0
            group = fsdp.param_group(module)
            if group is not None:
                self._fsdp[key] = weakref.ref(group)
                self._gathered.update(map(id, fsdp.managed_modules(group)))
        self.calls[key] += 1
        stack = self._stack()
        if not stack and key not in self._roots:
            self._found_root(module)
        self._mark_module(module)
        pending = self._pending.get(key)
        if pending:  # the backward passes done since its last call (never inside autograd)
            for backward in [b for b in pending if b.ended]:
                pending.remove(backward)
                self._close(backward)
        number = next(numbers)
        if not stack:
            self.phases.begin(FORWARD, number)
        self._probe(OPEN, number, key, len(stack) << 1)
        stack.append((key, number))
        self._since += 1
        if self._since >= CATCH_UP and self._catch_up is not None:
            self._since = 0
            self._catch_up()

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if not stack or stack[-1][0] != id(module):
            return
        key, number = stack.pop()
        if not stack:
            self.phases.end(FORWARD, number)
        self._probe(CLOSE, number, key, len(stack) << 1)
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):  # the common case, without a generator
            outputs = [output] if output.requires_grad else []
        else:
            outputs = [t for t in _tensors(output) if t.requires_grad]
        if not outputs:
            return
        ends = [t for t in _tensors(args) if t.requires_grad]
        params: list[int] = []
        if not ends:
            params = self._params_of(module)
            if not params:
                return
        backward = Backward(key, len(stack), self._probe)
        if not stack:
            self.phases.awaits(backward.number)
        if len(outputs) == 1:  # the same as a multi-grad hook on one tensor, at less cost
            backward.handles = [outputs[0].register_hook(backward.begin)]  # type: ignore[no-untyped-call]
        else:
            backward.handles = [register_multi_grad_hook(outputs, backward.begin, mode="any")]
        # One hook per tensor, not a multi-grad hook in mode "all": that one raises inside
        # torch.autograd.grad() for leaf tensors (parameters, inputs).
        backward.handles += [t.register_hook(backward.end) for t in ends]  # type: ignore[no-untyped-call]
        for param in params:  # their hooks stay: a whole model's, per call, would cost much
            self._waiting.setdefault(param, set()).add(backward)
        backward.params = params
        pending = self._pending.setdefault(key, [])
        pending.append(backward)
        if len(pending) > PENDING:
            self._close(pending.pop(0))

    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for key in self._fsdp:  # the reduce-scatter inputs FSDP keeps
            self._mark_collectives(key)
        self.optimizers.setdefault(id(optimizer), optimizer)
        self._mark_optimizer(optimizer, grads=True)
        self.phases.begin(STEP, id(optimizer))  # the step's own work: after our marks

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.phases.end(STEP, id(optimizer))
        self._probe(STEP_ROW, id(optimizer), 0, 0)  # a row of the stream: where a step ends
        self._mark_optimizer(optimizer, grads=False)

    def _pack(self, tensor: torch.Tensor) -> autograd.Saved:
        stack = getattr(self._local, "stack", None)
        self.mark(tensor, ACTIVATIONS, ("saved", stack[-1][0]) if stack else None)
        # Autograd's in-place check is ours to make now that hooks are set (unpack).
        return autograd.pack(tensor)

    def _found_root(self, module: torch.nn.Module) -> None:
        """`module` is a root: its tree is taken now, in case it dies before the end."""
        key = id(module)
        ref = self._roots.get(key)
        if ref is not None and ref() is module:
            return
        if ref is None:
            self.roots.append(key)
        self._roots[key] = weakref.ref(module)  # anew where a dead root's id was reused
        self.trees[key] = Tree.of(module)

    def _params_of(self, module: torch.nn.Module) -> list[int]:
        """The parameters needing gradients of `module` (a module whose inputs need none
        ends its backward with their gradients), each with a hook that lasts until
        :meth:`stop` and hits the backward passes waiting for it."""
        params = self._params.get(id(module))
        if params is None:
            found = [p for p in module.parameters() if p.requires_grad]
            params = self._params[id(module)] = [id(p) for p in found]
            for param in found:
                if id(param) not in self._param_hooks:
                    self._param_hooks[id(param)] = param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        self._accumulated_hook
                    )
        return params

    def _accumulated(self, param: torch.Tensor) -> None:
        for backward in list(self._waiting.get(id(param), ())):
            backward.end(None)

    def _close(self, backward: Backward) -> None:
        """Remove `backward`'s hooks; close its probe if it began."""
        for handle in backward.handles:
            handle.remove()
        for param in backward.params:
            self._waiting[param].discard(backward)
        backward.close()
        self.phases.closed(backward.number)  # one that never began is no longer awaited


def _opaque(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` in a function Dynamo never traces (a bound method cannot carry the mark),
    marked without importing Dynamo where PyTorch allows (its import is not the program's
    memory)."""

    def call(*args: Any) -> Any:
        return hook(*args)

    return call if keep_dynamo_out(call) else disable_dynamo(call)


def _eager_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` where the program runs eagerly, and nothing where Dynamo traces it: Dynamo
    reads the test as a constant and leaves the call out, so a compiled region keeps its
    graph whole (an opaque hook broke it at each module), and is measured from the
    outside: its allocations counted, its modules not seen one by one."""
    opaque = _opaque(hook)

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return opaque(*args)

    skip_dynamo_frames(call)  # called by a compiled module's eager wrapper: not a frame to compile
    return call


def _data_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's arguments or output: tensors, tuples, lists, dict values."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
