"""The memory reporter refuses what is not a model or an optimizer at the call, naming it,
instead of failing with an AttributeError at the first report."""

from __future__ import annotations

import pytest
import torch

from torchmem import MemReporter

MODEL = "model must be a torch.nn.Module or None, not "
OPTIMIZER = "optimizer must be a torch.optim.Optimizer, not "


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (3, "3 (int)"),
        ("model", "'model' (str)"),
        ([torch.nn.Linear(2, 2)], "[Linear(in_fea...=2, bias=True)] (list)"),
        (torch.optim.SGD, "<class 'torch.optim.sgd.SGD'> (type)"),
    ],
)
def test_a_model_that_is_not_a_module_is_a_type_error(model: object, named: str) -> None:
    with pytest.raises(TypeError) as raised:
        MemReporter(model)  # type: ignore[arg-type]
    assert str(raised.value) == MODEL + named


def test_a_module_or_none_is_a_model() -> None:
    linear = torch.nn.Linear(4, 4, bias=False)
    assert MemReporter(None, objects=list).model is None
    (record,) = MemReporter(linear, objects=list).snapshot()
    assert (record.name, record.nbytes) == ("weight", 64)


@pytest.mark.parametrize(
    ("optimizer", "named"),
    [
        (None, "None (NoneType)"),
        (torch.nn.Linear(2, 2), "Linear(in_fea...=2, bias=True) (Linear)"),
        ([], "[] (list)"),
    ],
)
def test_an_optimizer_that_is_not_one_is_a_type_error(optimizer: object, named: str) -> None:
    reporter = MemReporter(objects=list)
    with pytest.raises(TypeError) as raised:
        reporter.add_optimizer(optimizer)  # type: ignore[arg-type]
    assert str(raised.value) == OPTIMIZER + named
    assert reporter.optimizers == []
    assert reporter.snapshot() == []  # the reporter still works


def test_an_optimizer_is_added_once() -> None:
    linear = torch.nn.Linear(4, 4, bias=False)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    reporter = MemReporter(linear, objects=list)
    reporter.add_optimizer(optimizer)
    reporter.add_optimizer(optimizer)
    assert reporter.optimizers == [optimizer]


def test_objects_that_are_not_a_function_are_a_type_error() -> None:
    kept = [torch.zeros(4)]
    with pytest.raises(TypeError) as raised:
        MemReporter(objects=kept)  # type: ignore[arg-type]
    assert str(raised.value) == "objects must be a function or None, not [tensor([0., 0., 0., 0.])]"
    assert [r.nbytes for r in MemReporter(objects=lambda: kept).snapshot()] == [16]
