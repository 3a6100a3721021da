"""Autograd computes and raises under every front of torchmem what it does under
``python``. Saved-tensor hooks switch off autograd's check that a tensor saved for backward
was not modified in place; torchmem's hooks make that check themselves and raise
autograd's own error (an LSTM keeping its hidden state across steps raised at step 1 under
``python`` and trained on wrong gradients under torchmem)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import autograd_cases as cases
import torchmem

pytestmark = pytest.mark.integration

IN_PLACE = "modified by an inplace operation"
NODE = re.compile(r", which is output \d+ of [^,]+,")


def test_the_cases_raise_where_autograd_raises() -> None:
    """The cases cover both outcomes (else the comparisons below could not fail)."""
    raised = {name for name, case in cases.CASES.items() if cases.outcome(case)[0] == "raised"}
    assert raised == set(cases.CASES) - {
        "retain_graph_twice",
        "double_backward",
        "checkpoint_reentrant",
        "checkpoint",
        "checkpoint_inplace",  # checkpointing's own hooks: no check under python either
        "user_hooks",  # the program's own hooks: no check under python either
    }


@pytest.mark.filterwarnings("ignore:Error detected in TanhBackward0")
@pytest.mark.parametrize("name", cases.CASES)
def test_a_recording_keeps_each_outcome_and_message(name: str) -> None:
    plain = cases.outcome(cases.CASES[name])
    with torchmem.record("cpu"):
        recorded = cases.outcome(cases.CASES[name])
    if name == "double_backward_inplace":
        # Saved by a backward pass (create_graph=True), the tensor autograd checks is one it
        # made when unpacking under hooks: the message cannot name the original's node.
        assert recorded == (plain[0], NODE.sub("", plain[1]))
    else:
        assert recorded == plain


def test_torchmem_run_prints_what_python_prints() -> None:
    script = Path(cases.__file__)
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True)
    command = [sys.executable, "-m", "torchmem", "run", "-q", script]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    expected = re.sub(
        r"^double_backward_inplace .*$",
        lambda line: NODE.sub("", line[0]),
        plain.stdout,
        flags=re.M,
    )
    assert run.stdout == expected


def in_place_step(n: int) -> None:
    x = torch.ones(n, requires_grad=True)
    y = x.exp()
    y.add_(1)
    y.sum().backward()


def test_an_estimate_raises_autograd_s_error() -> None:
    with pytest.raises(RuntimeError, match=IN_PLACE) as plain:
        in_place_step(3)
    with pytest.raises(RuntimeError, match=IN_PLACE) as estimated:
        torchmem.estimate(in_place_step, 3, device="cpu")
    assert str(estimated.value) == str(plain.value)


def test_the_line_profiler_keeps_autograd_s_error() -> None:
    with pytest.raises(RuntimeError, match=IN_PLACE) as plain:
        in_place_step(3)
    profiler = torchmem.LineProfiler(in_place_step, device="cpu")
    with pytest.raises(RuntimeError, match=IN_PLACE) as profiled, profiler:
        in_place_step(3)
    assert str(profiled.value) == str(plain.value)


def test_a_marked_test_expecting_the_error_passes(pytester: pytest.Pytester) -> None:
    """``pytest.raises(..., match="modified by an inplace operation")`` failed with DID NOT
    RAISE under the markers."""
    pytester.makepyfile(
        test_lstm=textwrap.dedent(
            f"""
            import pytest

            from autograd_cases import lstm_hidden_kept


            @pytest.mark.torchmem_limit_memory("1 GB")
            def test_peak():
                with pytest.raises(RuntimeError, match="{IN_PLACE}"):
                    lstm_hidden_kept()


            @pytest.mark.torchmem_limit_leaks("1 GB")
            def test_leaks():
                with pytest.raises(RuntimeError, match="{IN_PLACE}"):
                    lstm_hidden_kept()
            """
        )
    )
    pytester.makepyfile(autograd_cases=Path(cases.__file__).read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:memray")
    result.assert_outcomes(passed=2)


def test_torchmems_own_look_at_what_a_graph_saved_sees_what_was_modified_since() -> None:
    """Reading a node's saved tensors is torchmem's look (what holds a leak), not the
    program's: the in-place check made for the program must not stop it at a weight the
    optimizer changed, and a saved tensor is held by the graph, not by a tuple of ours."""
    from torchmem._compat.autograd import saved_tensors
    from torchmem.events.graphs import address
    from torchmem.events.holders import UNSEEN, _referrers

    with torchmem.record("cpu"):
        x, w = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
        y = (x * 2) * w  # MulBackward0 saves other (w), then self (x * 2)
    with torch.no_grad():
        w.add_(1)  # as an optimizer's step does
    saved = {address(t) for t in saved_tensors(y.grad_fn)}
    assert saved == {address(w), address(y.grad_fn._saved_self)} and len(saved) == 2
    assert _referrers({address(y.grad_fn._saved_self)}, set()) == {
        address(y.grad_fn._saved_self): UNSEEN
    }
