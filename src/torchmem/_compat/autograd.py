"""Saved-tensor hooks: this thread's stack of them, what an autograd node saved, and
autograd's in-place check on saved tensors, kept under saved-tensor hooks.

PyTorch checks that a tensor saved for the backward pass was not modified in place since
(its version counter) only where no saved-tensor hooks are set: hooks that see every saved
tensor would turn the program's ``RuntimeError`` into gradients silently computed from the
changed values. :func:`pack` keeps what the check needs and :func:`unpack` makes it,
raising the error PyTorch raises, with its message (read off one that this PyTorch raises,
see :func:`_form`).
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchmem._compat import backward_node, lookup, unsupported

_SEQUENCE = lookup("torch._C._autograd._get_sequence_nr")

_PUSH_SAVED = lookup("torch._C._autograd._push_saved_tensors_default_hooks")
_POP_SAVED = lookup("torch._C._autograd._pop_saved_tensors_default_hooks")
_TOP_SAVED = lookup("torch._C._autograd._top_saved_tensors_default_hooks")
_SAVED_ENABLED = lookup("torch._C._autograd._saved_tensors_hooks_is_enabled")


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be installed on this thread now (not inside a region
    that forbids them, such as a ``torch.func`` transform)."""
    return _SAVED_ENABLED is None or bool(_SAVED_ENABLED())


def push_saved_tensors_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]
) -> None:
    """Put (`pack`, `unpack`) on top of this thread's saved-tensor hook stack."""
    if _PUSH_SAVED is None:
        torch.autograd.graph.saved_tensors_hooks(pack, unpack).__enter__()
    else:
        _PUSH_SAVED(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Take the top hooks off this thread's saved-tensor hook stack."""
    if _POP_SAVED is None:
        unsupported("torch._C._autograd._pop_saved_tensors_default_hooks", "A recording")()
    _POP_SAVED()


def saved_tensors_hooks_readable() -> bool:
    """Whether this PyTorch can say which hooks are on the saved-tensor hook stack."""
    return _TOP_SAVED is not None


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The hooks on top of this thread's saved-tensor hook stack; None for none, or where
    this PyTorch cannot say."""
    return None if _TOP_SAVED is None else _TOP_SAVED(True)


_SAVED: dict[type, list[str]] = {}
"""Per autograd node class, its ``_saved_*`` attributes."""


def saved_tensors(node: Any) -> Iterator[torch.Tensor]:
    """The tensors autograd node `node` (a ``grad_fn``) saved for backward, through its
    ``_saved_<name>`` attributes (PyTorch's way to inspect them); none that a backward
    pass freed (it frees a node's all at once: the first that raises ends the look, each
    raise costing PyTorch about 13 microseconds). Those modified in place since they were
    saved too: this look is torchmem's, not the program's (:func:`unpack` lets it through)."""
    kind = type(node)
    names = _SAVED.get(kind)
    if names is None:
        names = _SAVED[kind] = [n for n in dir(node) if n.startswith("_saved_")]
    found = []
    _looking.on = True
    try:
        for name in names:
            try:
                value = getattr(node, name)
            except Exception:  # freed by a backward pass
                break
            if isinstance(value, torch.Tensor):
                found.append(value)
    finally:
        _looking.on = False
    return iter(found)


_looking = threading.local()
"""``on`` while torchmem reads what autograd saved (:func:`saved_tensors`)."""


class Saved(tuple[Any, ...]):
    """What a saved tensor is packed into: a detached alias (the same storage and version
    counter, without the tensor's graph), its version, its ``output_nr``, and a weak
    reference to the tensor itself (None for an output of the node that saves it). A class
    of its own, so that a look for what holds a tensor passes over it: autograd's graph
    holds it."""

    __slots__ = ()


_HEAD = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: "
)
_HINTS = {
    False: " Hint: enable anomaly detection to find the operation that failed to compute its "
    "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).",
    True: " Hint: the backtrace further above shows the operation that failed to compute its "
    "gradient. The variable in question was changed in there or anywhere later. Good luck!",
}
"""The text after the versions, without anomaly detection and with it (PyTorch 2.13's),
where :func:`_form` cannot read them."""


def pack(tensor: torch.Tensor) -> Saved:
    """What `tensor`, saved for backward, is kept as."""
    node = tensor.grad_fn
    # An output of the node being built (the newest node of this thread) is named by that
    # node, as PyTorch does, and is not held: it would hold its own graph.
    if node is not None and _SEQUENCE is not None and node._sequence_nr() == _SEQUENCE() - 1:
        origin = None
    else:
        origin = weakref.ref(tensor)
    return Saved((tensor.detach(), tensor._version, tensor.output_nr, origin))


def unpack(saved: Saved) -> torch.Tensor:
    """The saved tensor, where it was not modified in place since it was saved; else the
    ``RuntimeError`` autograd raises without hooks."""
    tensor: torch.Tensor = saved[0]
    if tensor._version != saved[1] and not getattr(_looking, "on", False):
        raise RuntimeError(_message(saved))
    return tensor


def _message(saved: Saved) -> str:
    """PyTorch's message for `saved`, modified in place: the node named is the one that
    saved it for its output, else the tensor's own node now (the in-place operation's)."""
    tensor, version, output_nr, origin = saved
    if origin is None:
        node = backward_node()
    else:
        original = origin()
        node = None if original is None else original.grad_fn
    head, by_forward_op, hints = _form()
    which = ""
    if node is not None:
        name = node.name()
        if by_forward_op:
            name = re.sub(r"Backward\d*$", "", name)
        which = f", which is output {output_nr} of {name},"
    sizes = ", ".join(str(size) for size in tensor.shape)
    return (
        f"{head}[{tensor.type()} [{sizes}]]{which} is at version {tensor._version}; "
        f"expected version {version} instead.{hints[torch.is_anomaly_enabled()]}"
    )


@functools.cache
def _form() -> tuple[str, bool, dict[bool, str]]:
    """How this PyTorch words the error: its head, whether it names a node by its forward
    operator (``Exp``) rather than by its own name (``ExpBackward0``), and its hints. Read
    off the error it raises for a probe saved without hooks, on first need, in a thread of
    its own (whose saved-tensor hook stack is empty; this one's has ours); PyTorch 2.13's
    wording where the probe does not give it."""
    found: list[str] = []

    def probe() -> None:
        try:
            with torch.enable_grad(), torch.inference_mode(False):
                x = torch.zeros(1, device="cpu", requires_grad=True)
                y = x.exp()
                node = y.grad_fn
                assert node is not None
                found.append(node.name())
                y.add_(1)
                getattr(node, "_saved_result")  # noqa: B009 (raises)
        except RuntimeError as error:
            found.append(str(error))

    worker = threading.Thread(target=probe, name="torchmem-autograd-probe")
    worker.start()
    worker.join()
    pattern = (
        r"(.*?)\[.*\], which is output 0 of (.+), is at version 1; expected version 0 "
        r"instead\.(.*)"
    )
    match = re.fullmatch(pattern, found[-1], re.DOTALL) if len(found) == 2 else None
    if match is None:
        return _HEAD, True, _HINTS
    head, name, hint = match.groups()
    return head, name != found[0], {**_HINTS, torch.is_anomaly_enabled(): hint}
