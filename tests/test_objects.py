"""Picking objects by class out of many."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

from torchmem._objects import (
    class_name,
    holders,
    instances_of,
    of_classes,
    of_types,
    subclasses,
    tracked,
)
from tuple_builder import building_tuples_beside


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


# Every object of the process -----------------------------------------------------------


class Marker:
    """An object of a class nothing else in the process has."""


class Marked(Marker):
    """A subclass."""


def test_tracked_finds_every_instance_of_the_bases_and_their_subclasses_once() -> None:
    plain, sub, other = Marker(), Marked(), object()
    found = tracked(Marker)
    assert sorted(map(id, found)) == sorted((id(plain), id(sub)))
    assert not any(o is other for o in found)


@pytest.mark.parametrize("collecting", [True, False])
def test_tracked_holds_nothing_after_it_returns_and_leaves_collection_as_it_was(collecting):
    """The list of every object is gone when it returns: no object gained a reference,
    and no cycle waits for a collection to free it."""
    chosen, passed_over = Marker(), torch.zeros(4)
    counts = sys.getrefcount(chosen), sys.getrefcount(passed_over)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        found = tracked(Marker)
        assert gc.isenabled() is collecting
    finally:
        (gc.enable if was else gc.disable)()
    assert found == [chosen]
    del found
    assert (sys.getrefcount(chosen), sys.getrefcount(passed_over)) == counts
    assert [r for r in gc.get_referrers(passed_over) if type(r) is list] == []


def test_holders_are_the_tensors_modules_and_optimizers() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = set(map(id, holders()))
    assert {id(model), id(optimizer), id(model.weight), id(model.bias)} <= ids
    assert id(model.weight.grad) not in ids  # None
    assert not any(type(o) in (dict, list, Marker) for o in holders())


def test_holders_leave_out_fake_tensors_which_hold_no_memory() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(1024, 1024)
    real = torch.zeros(1)
    assert id(fake) in set(map(id, tracked(torch.Tensor)))
    ids = set(map(id, holders()))
    assert id(real) in ids and id(fake) not in ids


def test_a_walk_of_every_object_never_shares_a_tuple_another_thread_is_building() -> None:
    """A walk that held ``gc.get_objects()`` across a bytecode broke the builder's tuple
    (``SystemError: Objects/tupleobject.c: bad argument to internal function``) on the
    first of these walks."""
    assert building_tuples_beside(lambda: tracked(torch.Tensor), 20) == []


@pytest.mark.integration  # a fresh process, since an audit hook stays for its life
def test_a_walk_in_a_process_with_an_audit_hook_never_shares_a_tuple(tmp_path) -> None:
    """``id()`` raises an audit event: a walk that called it ran the process's audit hooks
    (Python) while it held every object, and broke the builder's tuple."""
    script = tmp_path / "audited.py"
    script.write_text(
        "import sys, torch\n"
        "from torchmem._objects import tracked\n"
        "from tuple_builder import building_tuples_beside\n"
        "sys.addaudithook(lambda event, args: None)\n"
        "print(building_tuples_beside(lambda: tracked(torch.Tensor), 20))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


def test_the_builder_fails_beside_a_walk_that_holds_every_object() -> None:
    """The test above can fail: the same builder beside a walk that keeps the list of
    every object across bytecodes."""

    def holding() -> None:
        everything = gc.get_objects()
        time.sleep(0.001)  # the builder runs on, paused mid-tuple when the list was made
        del everything

    assert building_tuples_beside(holding, 200) != []


class Logged:
    """A mixin of the user's own."""


class LoggedLinear(Logged, torch.nn.Linear):
    pass


def test_a_modules_class_name_is_the_users_even_where_torch_distributed_subclassed_it() -> None:
    from torch.distributed.fsdp import FSDPModule

    sharded = torch.nn.Linear(2, 2)  # as fully_shard changes its class
    sharded.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    assert class_name(sharded) == "Linear"
    assert class_name(LoggedLinear(2, 2)) == "LoggedLinear"  # two bases, none torch's
    assert class_name(torch.nn.Linear(2, 2)) == "Linear"
