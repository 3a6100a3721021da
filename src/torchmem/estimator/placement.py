"""Where the fake CPU tensors of a CUDA estimate would be: the GPU or the CPU.

The estimate of a CUDA step runs on fake CPU tensors (see :mod:`torchmem.estimator.fake`),
and only the storages that would be on the GPU count. :class:`OnFakeCpu` runs every call
on the fake CPU and says where its storages go; :func:`mark` gives each fake tensor on the
GPU the device :data:`GPU_AS_CPU`, so that a call given ``x.device`` is known to name the
GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from torchmem._compat import storage_key
from torchmem._compat.fake import mark_fake_device
from torchmem.estimator.cuda_paths import PATHS


class Placement(Protocol):
    """What :class:`OnFakeCpu` reads and sets (the estimator's meter)."""

    on_gpu: set[int]
    """Keys of the live storages that stand for GPU memory."""
    forced: bool | None
    """While a call names its device: whether that device is the GPU."""


def any_on(keys: set[int], values: Iterable[Any]) -> bool:
    """Whether a tensor among `values` (or in a list among them) has a storage in `keys`."""
    for value in values:
        if isinstance(value, (list, tuple)):
            if any_on(keys, value):
                return True
        elif (
            isinstance(value, torch.Tensor)
            and value.layout is torch.strided
            and storage_key(value.untyped_storage()) in keys
        ):
            return True
    return False


def real_tensor(func: Any, values: Iterable[Any]) -> torch.Tensor | None:
    """The first tensor among `values` (or in a list among them), the arguments of `func`,
    that is not fake, if any, where `func` may not take one."""
    if func in _LIFTS:
        return None
    for value in values:
        if isinstance(value, (list, tuple)):
            found = real_tensor(func, value)
            if found is not None:
                return found
        elif type(value) in _REAL:
            return value  # type: ignore[no-any-return]
    return None


_REAL = (torch.Tensor, torch.nn.Parameter)
"""The types of real tensors (a subclass's own dispatch decides what it holds)."""
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
"""The operators that make a fake tensor of a real one just made (``torch.tensor([...])``,
``torch.from_numpy``): the only ones a real tensor may reach."""


GPU_AS_CPU = torch.device("cpu")
"""The device of every fake tensor on the GPU: the CPU (where it runs), but this very
object, so that a call given it (``device=x.device``) is known to name the GPU."""


def mark(out: Any) -> None:
    """Give the fake tensors in `out` (one, or a list) the device :data:`GPU_AS_CPU`."""
    if isinstance(out, (list, tuple)):
        for value in out:
            mark(value)
    elif isinstance(out, torch.Tensor):
        mark_fake_device(out, GPU_AS_CPU)


def device_kind(value: object) -> str | None:
    """The device type `value` names (a device, a string, or a CUDA index), or None."""
    if value is GPU_AS_CPU:
        return "cuda"
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        return value.split(":")[0]
    if isinstance(value, int) and not isinstance(value, bool):
        return "cuda"
    return None


_GETTERS: dict[Any, Callable[[bool], Any]] = {
    torch.Tensor.is_cuda.__get__: lambda gpu: gpu,  # type: ignore[attr-defined]
    torch.Tensor.is_cpu.__get__: lambda gpu: not gpu,  # type: ignore[attr-defined]
    torch.Tensor.get_device: lambda gpu: 0 if gpu else -1,
}
"""What a tensor says of its device, by whether its storage is on the GPU."""


class OnFakeCpu(TorchFunctionMode):
    """For a CUDA target (a `meter` that logs GPU storages only), runs every call on the
    fake CPU and tells the meter where its storages live: a call that names a CUDA device
    makes GPU storages, ``.cuda()`` and ``.to("cuda")`` copy a CPU tensor to the GPU
    (``.cpu()`` back), a tensor on the GPU says so (``.is_cuda``), and its ``.device``,
    :data:`GPU_AS_CPU`, names the GPU where it is given (``device=x.device``). Dropout
    and attention on the GPU run as CUDA runs them (:mod:`~torchmem.estimator.cuda_paths`)."""

    def __init__(self, meter: Placement | None) -> None:
        super().__init__()
        self.meter = meter

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        meter = self.meter
        if meter is None:
            return func(*args, **kwargs)
        getter = _GETTERS.get(func)
        if getter is not None:
            return getter(self._on_gpu(args[0]))
        path = PATHS.get(func)
        if path is not None and args and self._on_gpu(args[0]):
            found = path(args, kwargs)
            if found is not NotImplemented:
                return found
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda:
            return self._moved(
                args[0], True, (), {k: v for k, v in kwargs.items() if k != "device"}
            )
        if func is torch.Tensor.cpu:
            return self._moved(args[0], False, (), kwargs)
        if func is torch.Tensor.to:
            rest = list(args[1:])
            if rest and isinstance(rest[0], torch.Tensor):  # to(other): its device and dtype
                other = rest.pop(0)
                return self._moved(args[0], self._on_gpu(other), (other.dtype, *rest), kwargs)
            if rest and device_kind(rest[0]) is not None:
                return self._moved(args[0], device_kind(rest[0]) == "cuda", rest[1:], kwargs)
            kind = device_kind(kwargs.get("device"))
            if kind is not None:
                kwargs = {k: v for k, v in kwargs.items() if k != "device"}
                return self._moved(args[0], kind == "cuda", rest, kwargs)
            return func(*args, **kwargs)
        kind = device_kind(kwargs.get("device"))
        if kind not in ("cuda", "cpu"):  # none, or one a fake tensor cannot be on
            return func(*args, **kwargs)
        return self._named(kind == "cuda", func, args, {**kwargs, "device": "cpu"})

    def _on_gpu(self, tensor: torch.Tensor) -> bool:
        assert self.meter is not None
        return storage_key(tensor.untyped_storage()) in self.meter.on_gpu

    def _named(self, gpu: bool, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, its new storages on the GPU if `gpu`, else the CPU."""
        assert self.meter is not None
        outer, self.meter.forced = self.meter.forced, gpu
        try:
            return func(*args, **kwargs)
        finally:
            self.meter.forced = outer

    def _moved(
        self, tensor: torch.Tensor, gpu: bool, rest: Any, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """``tensor.to(device, *rest, **kwargs)`` to the GPU (`gpu`) or the CPU: a copy
        where it is on the other one."""
        if self._on_gpu(tensor) == gpu:
            return tensor.to("cpu", *rest, **kwargs)
        rest = list(rest)
        if len(rest) >= 3:  # dtype, non_blocking, copy
            rest[2] = True
        else:
            kwargs = {**kwargs, "copy": True}
        moved: torch.Tensor = self._named(gpu, torch.Tensor.to, (tensor, "cpu", *rest), kwargs)
        return moved
