"""Courtesy: the in-place move, identity, sharing and values, moving between ``cpu`` and
``cpu`` (every storage gets a fresh copy there and back); CUDA's part, the allocator's
cache, through the CUDA stand-in. The real GPU round trip is in ``test_cuda_real.py``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from standins import StandInGpu, gpu_uuid, hide_gpus, install_gpus
from torchmem import Courtesy

GiB = 2**30


pytestmark = pytest.mark.usefixtures("isolated_meters")


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one Adam step: every parameter has a gradient and state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def snapshot(
    tensors: list[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor, torch.UntypedStorage]]:
    """Each tensor with a copy of its values and its storage now (held, so that no new
    storage can take its address)."""
    return [(t, t.detach().clone(), t.untyped_storage()) for t in tensors]


def model_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*params, *(p.grad for p in params), *model.buffers(), *state]


# The in-place move -----------------------------------------------------------------------


def test_model_grads_and_optimizer_state_move_in_place_and_back() -> None:
    model, optimizer = trained()
    before = snapshot(model_tensors(model, optimizer))
    weight = model[0].weight
    grad = weight.grad
    state = optimizer.state[weight]["exp_avg"]

    courtesy = Courtesy(model, optimizer, device="cpu", to="cpu")
    moved = courtesy.yield_memory()

    assert moved == sum(t.untyped_storage().nbytes() for t, _, _ in before)
    for tensor, values, storage in before:
        assert storage_of(tensor) != storage._cdata, "every storage is a fresh copy while yielded"
        assert torch.equal(tensor, values)
    assert courtesy.restore() == moved
    for tensor, values, storage in before:
        assert storage_of(tensor) != storage._cdata
        assert torch.equal(tensor, values)
        assert tensor.device == torch.device("cpu")
    assert model[0].weight is weight and weight.grad is grad
    assert optimizer.state[weight]["exp_avg"] is state
    assert weight.is_leaf and weight.requires_grad and isinstance(weight, torch.nn.Parameter)


def test_the_model_still_trains_after_a_round_trip() -> None:
    model, optimizer = trained()
    with Courtesy(model, optimizer, device="cpu", to="cpu"):
        pass
    optimizer.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    assert all(p.grad is not None for p in model.parameters())


def test_a_non_leaf_keeps_its_grad_fn() -> None:
    leaf = torch.ones(3, requires_grad=True)
    product = leaf * 2
    function = product.grad_fn
    with Courtesy(product, leaf, device="cpu", to="cpu"):
        pass
    assert product.grad_fn is function and not product.is_leaf
    product.sum().backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_parameters_without_a_gradient() -> None:
    """pytorch_memlab raised AttributeError: 'NoneType' object has no attribute 'cpu'."""
    model = torch.nn.Linear(3, 2)
    values = [p.detach().clone() for p in model.parameters()]
    with Courtesy(model, device="cpu", to="cpu"):
        assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))


# Storage sharing ---------------------------------------------------------------------------


def test_a_view_and_its_base_share_one_copy_on_either_side() -> None:
    base = torch.arange(12.0)
    view = base[2:8].view(2, 3).t()  # offset and strides, not contiguous
    as_bytes = base.view(torch.uint8)  # another dtype over the same bytes
    courtesy = Courtesy([base, view, as_bytes], device="cpu", to="cpu")

    assert courtesy.yield_memory() == 48, "one storage, moved once"
    assert storage_of(base) == storage_of(view) == storage_of(as_bytes)
    base[3] = 100.0
    assert view[1, 0] == 100.0
    courtesy.restore()

    assert storage_of(base) == storage_of(view) == storage_of(as_bytes)
    assert view.data_ptr() - base.data_ptr() == 8
    assert view.stride() == (1, 3) and view._base is base
    base[4] = -1.0
    assert view[2, 0] == -1.0 and as_bytes.view(torch.float32)[4] == -1.0


def test_tied_weights_stay_tied() -> None:
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # one Parameter in two modules
    alias = torch.nn.Parameter(embedding.weight.data)  # another Parameter, same storage
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})

    with Courtesy(model, alias, device="cpu", to="cpu") as courtesy:
        assert courtesy is not None
        assert storage_of(alias) == storage_of(embedding.weight)
    assert head.weight is embedding.weight
    assert storage_of(alias) == storage_of(embedding.weight)
    with torch.no_grad():
        alias[0, 0] = 42.0
    assert head.weight[0, 0] == 42.0


# What is left alone ------------------------------------------------------------------------


def test_tensors_created_in_between_are_left_alone() -> None:
    kept = torch.ones(4)
    courtesy = Courtesy(device="cpu", to="cpu")
    courtesy.yield_memory()
    new = torch.zeros(4)
    new_storage = storage_of(new)
    courtesy.restore()
    assert storage_of(new) == new_storage and torch.equal(new, torch.zeros(4))
    assert torch.equal(kept, torch.ones(4))


def test_only_the_chosen_device_moves() -> None:
    on_cpu = torch.ones(2)
    on_meta = torch.empty(3, device="meta")
    cpu_storage, meta_storage = storage_of(on_cpu), storage_of(on_meta)
    courtesy = Courtesy([on_cpu, on_meta], device="meta", to="meta")
    assert courtesy.yield_memory() == 12
    assert storage_of(on_cpu) == cpu_storage and storage_of(on_meta) != meta_storage
    courtesy.restore()
    assert on_meta.device == torch.device("meta") and on_meta.shape == (3,)


def test_meta_tensors_are_not_taken_for_one_storage() -> None:
    """Every meta tensor's data_ptr is 0; each still has its own storage."""
    first, second = torch.empty(2, device="meta"), torch.empty(2, device="meta")
    with Courtesy([first, second], device="meta", to="meta"):
        assert storage_of(first) != storage_of(second)


def test_a_refused_move_leaves_everything_as_it_was() -> None:
    """CPU tensors cannot take meta data: nothing stays half-way."""
    first, second = torch.ones(2), torch.zeros(3)
    storages = [storage_of(first), storage_of(second)]
    courtesy = Courtesy([first, second], device="cpu", to="meta")
    with pytest.raises(RuntimeError, match="from cpu to meta"):
        courtesy.yield_memory()
    assert [storage_of(first), storage_of(second)] == storages
    assert first.device == second.device == torch.device("cpu")
    assert torch.equal(first, torch.ones(2)) and torch.equal(second, torch.zeros(3))
    assert courtesy.restore() == 0


def test_every_gc_visible_tensor_by_default() -> None:
    """No targets: every tensor on the device, and the gradients of leaves (which the
    garbage collector does not see until Python touches them)."""
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    holder = {"nested": [torch.empty(3, device="meta")]}
    meta_storage, weight_storage = storage_of(holder["nested"][0]), storage_of(model.weight)
    courtesy = Courtesy(device="meta", to="meta")
    assert courtesy.yield_memory() >= 12
    assert storage_of(holder["nested"][0]) != meta_storage
    assert storage_of(model.weight) == weight_storage, "CPU tensors are not on the device"
    courtesy.restore()
    assert holder["nested"][0].shape == (3,)


def test_grads_are_found_without_targets() -> None:
    weight = torch.nn.Parameter(torch.ones(3, device="meta"))
    weight.grad = torch.empty(3, device="meta")
    grad = weight.grad
    storage = storage_of(grad)
    del grad  # only the parameter refers to it now
    with Courtesy(device="meta", to="meta"):
        assert storage_of(weight.grad) != storage


# Lifetimes ---------------------------------------------------------------------------------


def test_no_reference_is_kept() -> None:
    tensor = torch.ones(1000)
    ref = weakref.ref(tensor)
    courtesy = Courtesy(device="cpu", to="cpu")  # the objects named are held; not these
    courtesy.yield_memory()
    courtesy.restore()
    del tensor
    gc.collect()
    assert ref() is None


def test_a_tensor_dropped_while_yielded_is_freed_and_skipped() -> None:
    tensor, other = torch.ones(10), torch.zeros(10)
    ref = weakref.ref(tensor)
    courtesy = Courtesy(device="cpu", to="cpu")
    courtesy.yield_memory()
    del tensor
    gc.collect()
    assert ref() is None
    assert courtesy.restore() >= 40
    assert torch.equal(other, torch.zeros(10))


def test_restore_twice_and_without_yield_is_harmless() -> None:
    tensor = torch.arange(4.0)
    courtesy = Courtesy(tensor, device="cpu", to="cpu")
    assert courtesy.restore() == 0
    courtesy.yield_memory()
    assert courtesy.restore() == 16
    storage = storage_of(tensor)
    assert courtesy.restore() == 0
    assert storage_of(tensor) == storage and torch.equal(tensor, torch.arange(4.0))


def test_yield_twice_moves_each_tensor_once() -> None:
    tensor = torch.arange(4.0)
    courtesy = Courtesy(device="cpu", to="cpu")
    courtesy.yield_memory()
    storage = storage_of(tensor)
    later = torch.ones(2)
    courtesy.yield_memory()
    assert storage_of(tensor) == storage, "already moved"
    assert courtesy.restore() >= 16 + 8
    assert torch.equal(tensor, torch.arange(4.0)) and torch.equal(later, torch.ones(2))


def test_the_context_manager_restores_on_an_exception_and_lets_it_through() -> None:
    tensor = torch.arange(3.0)
    error = KeyError("boom")
    storage = tensor.untyped_storage()  # held, so that no new storage takes its address
    with pytest.raises(KeyError) as raised, Courtesy(tensor, device="cpu", to="cpu") as c:
        assert storage_of(tensor) != storage._cdata
        raise error
    assert raised.value is error and raised.value.__context__ is None
    assert c.restore() == 0, "already restored"
    assert torch.equal(tensor, torch.arange(3.0))


# CUDA through the stand-in, and bad input ---------------------------------------------------


def test_without_a_gpu_the_default_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = hide_gpus(monkeypatch)
    tensor = torch.ones(2)
    storage = storage_of(tensor)
    with Courtesy() as courtesy:
        assert storage_of(tensor) == storage
    assert courtesy.restore() == 0
    assert cuda.count("empty_cache") == 0


def test_cuda_empties_the_allocators_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = install_gpus(monkeypatch, [StandInGpu(gpu_uuid(0), total=8 * GiB)]).cuda
    stand_in.alloc(0, 4096)
    stand_in.free(0, 4096)  # 4 KiB stays in the cache
    assert stand_in.memory_reserved(0) > 0
    Courtesy().yield_memory()  # the current CUDA device; no real CUDA tensor to move here
    assert stand_in.count("empty_cache") == 1
    assert stand_in.memory_reserved(0) == 0


def test_other_devices_leave_the_cache_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = install_gpus(monkeypatch, [StandInGpu(gpu_uuid(0), total=8 * GiB)]).cuda
    with Courtesy(torch.ones(1), device="cpu", to="cpu"):
        pass
    assert stand_in.count("empty_cache") == 0


def test_a_cuda_device_that_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    install_gpus(monkeypatch, [StandInGpu(gpu_uuid(0), total=8 * GiB)])
    with pytest.raises(ValueError, match="cuda:3"):
        Courtesy(device="cuda:3").yield_memory()


@pytest.mark.parametrize("keyword", ["device", "to"])
def test_an_unknown_device_is_named(keyword: str) -> None:
    with pytest.raises(ValueError, match="'gpu0'"):
        Courtesy(**{keyword: "gpu0"})


# An id of "cuda" alone would read as the `cuda` marker, and skip the test without a GPU.
@pytest.mark.parametrize("to", ["cuda", "cuda:0", "cuda:1"], ids=["index-less", "0", "1"])
def test_a_destination_without_cuda_is_named_when_made(
    monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    hide_gpus(monkeypatch)
    with pytest.raises(ValueError, match=f"device '{to}' is not available"):
        Courtesy(torch.ones(1), device="cpu", to=to)


def test_a_destination_gpu_that_is_not_there_is_named_when_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_gpus(monkeypatch, [StandInGpu(gpu_uuid(0), total=8 * GiB)])
    with pytest.raises(ValueError, match="no device 'cuda:3'"):
        Courtesy(torch.ones(1), device="cpu", to="cuda:3")
    Courtesy(torch.ones(1), device="cpu", to="cuda:0")  # there: no error


def test_an_unknown_target_is_named() -> None:
    with pytest.raises(TypeError, match="str"):
        Courtesy("model")


def test_a_torch_func_wrapper_left_alive_is_skipped() -> None:
    kept = []
    torch.func.grad(lambda x: (kept.append(x), (x * 2).sum())[1])(torch.ones(3))
    plain = torch.ones(2)
    courtesy = Courtesy([kept[0], plain], device="cpu", to="cpu")
    assert courtesy.yield_memory() == 8
    courtesy.restore()
    held = plain.untyped_storage()  # kept: no new storage can take its address
    courtesy = Courtesy(device="cpu", to="cpu")  # the default scan, too
    courtesy.yield_memory()
    moved = plain.untyped_storage()._cdata != held._cdata
    courtesy.restore()
    assert moved and torch.equal(plain, torch.ones(2))


def test_tensor_subclasses_with_their_own_dispatch_are_skipped() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    plain = torch.ones(2)
    assert Courtesy([fake, plain], device="cpu", to="cpu").yield_memory() == 8
