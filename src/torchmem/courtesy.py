"""Courtesy: move a device's tensors out of the way, in place, and bring them back.

pytorch_memlab's ``Courtesy``, with its defects fixed: parameters without a gradient do
not crash it, only the tensors of one device (or of the objects you name) move, tensors
that share memory still share it afterwards, each comes back to its exact device, and no
tensor is kept alive by it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch

from torchmem._compat import storage_key
from torchmem._objects import tracked
from torchmem.resolve import DeviceLike, parse_device, resolve_device
from torchmem.tensors import tensors_in


class Courtesy:
    """Move the tensors of one device elsewhere (CPU by default) and back, in place.

    ``yield_memory()`` moves them and gives the CUDA allocator's cache back to the device,
    so another process can use the memory; ``restore()`` brings each tensor back to its
    exact device with identical values. As a context manager, entering yields and leaving
    restores, also on an error. The tensors stay the same Python objects, so a model, its
    optimizer and every other reference keep working: ``param is model.weight`` and
    ``optimizer.state[param]`` still hold after a round trip.

    Args:
        *targets: what to move. Nothing (the default, as in pytorch_memlab) means every
            tensor the garbage collector can see, plus the gradients of leaf tensors.
            Otherwise modules (their parameters, buffers and gradients), optimizers (their
            parameters, gradients and state), tensors (and their gradients), and lists,
            tuples, sets or dicts of these.
        device: whose tensors move: only tensors on this device are touched. ``None``
            (the default) means the current CUDA device where CUDA is available, and
            nothing at all where it is not. Any PyTorch device (``"cuda:1"``, ``1``,
            ``"cpu"``, ``"meta"``).
        to: where they go while yielded, ``"cpu"`` by default. They are always copied, so
            ``device="cpu", to="cpu"`` gives each storage a fresh copy and back.

    Tensors that share memory (a view and its base, weights tied through one storage,
    tensors of different dtypes over the same bytes) are moved as one storage and share it
    again on either side. Tensors created between ``yield_memory()`` and ``restore()`` are
    left alone, even where they view a moved tensor. The objects named in `targets` are
    held; the tensors moved only through weak references: dropping one while it is
    yielded frees it, and after ``restore()`` nothing of it is held.

    Not moved: tensors held only by C++ (autograd's saved tensors, so call it between
    steps, not inside ``forward``/``backward``), sparse, quantized, nested and inference
    tensors, and tensor subclasses with their own ``__torch_dispatch__``. The CUDA context
    itself (a few hundred MB) stays on the GPU.

    Raises:
        ValueError: naming the value, for a device PyTorch does not know, or a `to` that
            is not available here (``"cuda"`` without CUDA, ``"cuda:3"`` with one GPU).
        TypeError: naming the type, for a target that is none of the above.
    """

    def __init__(
        self,
        *targets: Any,
        device: DeviceLike | None = None,
        to: DeviceLike = "cpu",
    ) -> None:
        self.targets = targets
        if device is not None:
            parse_device(device)  # a misspelt device fails here; a missing one on use
        self.device = device
        self.to = parse_device(to)
        resolve_device(to)  # where they go must exist here: "cuda" without CUDA fails now
        for target in targets:
            _check_target(target)
        self._moved: list[tuple[weakref.ref[torch.Tensor], torch.device]] = []

    def yield_memory(self) -> int:
        """Move the tensors off their device and, on CUDA, empty the allocator's cache.

        Returns:
            The bytes of the storages moved. Calling it again before ``restore()`` moves
            only tensors not moved yet.

        Raises:
            ValueError: naming the device, if it is not available here (``"cuda:3"`` on a
                machine with one GPU).
            RuntimeError: naming both devices, if PyTorch cannot swap a tensor's data
                between them; everything moved so far is restored first.
        """
        source = self._source()
        if source is None:
            return 0
        already = {id(t) for t in self._live()}
        candidates = self._candidates(source)
        tensors = [t for t in candidates if id(t) not in already and _movable(t, source)]
        moved = 0
        try:
            for group in _by_storage(tensors):
                _move_group(group, self.to)
                moved += group[0].untyped_storage().nbytes()
                self._moved.extend((weakref.ref(t), source) for t in group)
        except BaseException:
            self.restore()  # all or nothing: no tensor is left half-way
            raise
        del tensors, candidates
        if source.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    def restore(self) -> int:
        """Bring every moved tensor back to its exact original device, values unchanged.

        Harmless to call twice, or without ``yield_memory()``. A tensor that is no longer
        where ``yield_memory()`` put it (the caller moved it meanwhile) is left alone.

        Returns:
            The bytes of the storages moved back.
        """
        records, self._moved = self._moved, []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for ref, original in records:
            tensor = ref()
            if tensor is not None and _same_device(tensor.device, self.to):
                by_device.setdefault(original, []).append(tensor)
        del records
        moved = 0
        for original, tensors in by_device.items():
            for group in _by_storage(tensors):
                _move_group(group, original)
                moved += group[0].untyped_storage().nbytes()
        return moved

    def __enter__(self) -> Courtesy:
        self.yield_memory()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()

    def _source(self) -> torch.device | None:
        """The device whose tensors move, with its index, or None for nothing."""
        if self.device is None and not torch.cuda.is_available():
            return None
        return resolve_device(self.device)

    def _live(self) -> Iterator[torch.Tensor]:
        for ref, _ in self._moved:
            tensor = ref()
            if tensor is not None:
                yield tensor

    def _candidates(self, source: torch.device) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        if self.targets:
            _collect(self.targets, found, strict=True)
        else:
            for tensor in tensors_in(tracked(torch.Tensor)):
                _add(tensor, found)
        return [t for t in found.values() if _same_device(t.device, source)]


def _same_device(device: torch.device, wanted: torch.device) -> bool:
    if device.type != wanted.type:
        return False
    return wanted.index is None or device.index in (None, wanted.index)


def _check_target(target: Any) -> None:
    _collect([target], {}, strict=True)


def _collect(objects: Iterable[Any], found: dict[int, torch.Tensor], strict: bool) -> None:
    """Add the tensors of `objects` (and of what they contain) to `found`, by id."""
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            _add(obj, found)
        elif isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                _add(tensor, found)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                _collect(group["params"], found, strict=False)
            _collect(obj.state.values(), found, strict=False)
        elif isinstance(obj, Mapping):
            _collect(obj.values(), found, strict)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            _collect(obj, found, strict)
        elif strict:
            raise TypeError(
                f"Courtesy cannot move a {type(obj).__name__}: give modules, optimizers,"
                " tensors, or lists, tuples, sets or dicts of them"
            )


def _add(tensor: torch.Tensor, found: dict[int, torch.Tensor]) -> None:
    found[id(tensor)] = tensor
    # A gradient is visible to the garbage collector only once Python code has touched
    # it, so it is taken from its tensor. Reading ``.grad`` of a non-leaf warns.
    if tensor.is_leaf and tensor.grad is not None:
        found[id(tensor.grad)] = tensor.grad


def _movable(tensor: torch.Tensor, source: torch.device) -> bool:
    """Whether `tensor` is a plain strided tensor whose data can be swapped in place."""
    return (
        type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_inference()
        and _same_device(tensor.device, source)
        and _has_storage(tensor)
    )


def _has_storage(tensor: torch.Tensor) -> bool:
    """False for a torch.func wrapper (``grad``, ``vmap``), which has none: even one its
    transform has ended keeps failing to give one, and an exception raised inside the
    transform keeps such wrappers alive with its frames."""
    try:
        tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _by_storage(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by the storage they view (a storage's address while it is alive:
    the tensors keep it alive, so it cannot be reused; ``data_ptr`` alone would not do, as
    every meta tensor's is 0)."""
    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        groups.setdefault((str(storage.device), storage_key(storage)), []).append(tensor)
    return list(groups.values())


def _move_group(group: list[torch.Tensor], device: torch.device) -> None:
    """Copy the storage `group` shares to `device` once, and point every tensor of the
    group at the copy with its own dtype, offset, size and strides. Where PyTorch refuses
    (``cpu`` and ``meta`` tensors cannot take each other's data), the group is left as it
    was and a RuntimeError names both devices.

    ``tensor.data = new`` swaps the data under the same Python object, as ``Module.to``
    long did: identity, ``requires_grad``, leaf status, ``grad_fn`` of a non-leaf, hooks
    and the object's place as a key in ``optimizer.state`` all stay. ``swap_tensors`` would
    also keep identity, but it refuses tensors autograd still refers to, and copying each
    tensor on its own (``t.data = t.data.to(...)``) would split a view from its base.
    Building every tensor over one copied storage keeps them sharing memory.
    """
    with torch.no_grad():
        storage = group[0].untyped_storage()
        as_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        copied = as_bytes.to(device, copy=True).untyped_storage()
        del as_bytes
        new = [
            torch.empty(0, dtype=t.dtype, device=device).set_(
                copied, t.storage_offset(), t.size(), t.stride()
            )
            for t in group
        ]
        old: list[torch.Tensor] = []
        try:
            for tensor, data in zip(group, new, strict=True):
                previous = tensor.data
                tensor.data = data
                old.append(previous)
        except RuntimeError as exc:
            for tensor, previous in zip(group, old, strict=False):
                tensor.data = previous
            raise RuntimeError(
                f"Courtesy cannot move a tensor from {group[0].device} to {device}: {exc}"
            ) from exc
