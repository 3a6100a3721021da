"""Picking objects by class out of many."""

from __future__ import annotations

import weakref

import torch

from torchmem._objects import of_classes


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
