"""Picking objects by class out of many."""

from __future__ import annotations

import weakref

import torch

from torchmem._objects import instances_of, of_classes, of_types, subclasses


class Held(torch.Tensor):
    """A tensor subclass."""


def test_objects_of_the_wanted_classes_in_order_subclasses_too_proxies_not() -> None:
    plain, sub = torch.zeros(1), torch.zeros(1).as_subclass(Held)
    proxy = weakref.proxy(plain)
    objects = [1, plain, "x", proxy, sub, plain]
    asked: list[type] = []

    def wanted(kind: type) -> bool:
        asked.append(kind)
        return issubclass(kind, torch.Tensor)

    found = of_classes(iter(objects), wanted)
    assert [id(o) for o in found] == [id(plain), id(sub), id(plain)]
    assert sorted(map(str, asked)) == sorted(map(str, {int, str, torch.Tensor, Held, type(proxy)}))
    assert of_classes(objects, lambda kind: False) == []


class Inner(Held):
    """A subclass of a subclass."""


def test_subclasses_are_every_class_deriving_from_the_bases_transitively() -> None:
    found = subclasses(torch.Tensor, torch.optim.Optimizer)
    assert {torch.Tensor, torch.nn.Parameter, Held, Inner, torch.optim.SGD} <= found
    assert torch.nn.Module not in found and object not in found

    class Later(Inner):
        pass

    assert Later not in found  # made after: as its docstring says
    assert Later in subclasses(torch.Tensor)


def test_instances_of_picks_what_of_classes_picks_with_issubclass() -> None:
    plain, sub, inner = torch.zeros(1), torch.zeros(1).as_subclass(Held), torch.zeros(1)
    inner = inner.as_subclass(Inner)
    proxy = weakref.proxy(plain)
    model = torch.nn.Linear(1, 1)
    objects = [1, plain, "x", proxy, sub, model, inner, plain, torch.optim.SGD(model.parameters())]
    for bases in [(torch.Tensor,), (torch.nn.Module, torch.optim.Optimizer), (Held,), (str, int)]:
        expected = of_classes(objects, lambda kind, bases=bases: issubclass(kind, bases))
        assert [id(o) for o in instances_of(iter(objects), *bases)] == [id(o) for o in expected]
    assert [id(o) for o in of_types(objects, {Held, int})] == [id(1), id(sub)]
