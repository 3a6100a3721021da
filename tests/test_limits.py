"""The pytest plugin's pieces without pytest: reading limits, measuring a span, verdicts,
and their text, in exact bytes and exact lines."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

from torchmem.limits import Span, limit_leaks, limit_memory
from torchmem.meters import meter
from torchmem.records.frames import shown
from torchmem.records.limits import Elsewhere, Limit, Origin, Usage, Verdict
from torchmem.records.tensors import TensorRecord
from torchmem.render.limits import explanation, failure, summary

pytestmark = pytest.mark.integration

MiB = 2**20
KEPT: list[torch.Tensor] = []


def test_a_limit_reads_sizes_as_powers_of_1024_and_defaults_to_cpu_without_a_gpu(
    no_gpu: object,
) -> None:
    assert limit_memory("24 MB") == Limit("limit_memory", 24 * MiB, "cpu")
    assert limit_memory("1.5 GiB", device="ram") == Limit("limit_memory", 1536 * MiB, "ram")
    assert limit_leaks(4096, device="cpu:0", setup=True) == Limit("limit_leaks", 4096, "cpu", True)
    assert limit_memory(0, current_thread_only=True) == Limit("limit_memory", 0, "cpu", False, True)


@pytest.mark.parametrize(
    ("keywords", "error"),
    [
        ({"current_thread_only": 1}, "invalid current_thread_only 1: expected True or False"),
        (
            {"current_thread_only": True, "device": "ram"},
            "current_thread_only=True cannot measure device 'ram'",
        ),
    ],
)
def test_current_thread_only_is_a_flag_and_not_for_ram(keywords: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        limit_memory("1 MB", **keywords)


def test_a_span_measures_exact_bytes_and_judges_at_the_limit() -> None:
    limits = [
        Limit("limit_memory", 5 * MiB, "cpu"),  # at the limit: passes
        Limit("limit_memory", 5 * MiB - 1, "cpu"),
        Limit("limit_leaks", MiB, "cpu"),
        Limit("limit_leaks", MiB - 1, "cpu"),
    ]
    span = Span([meter("cpu")])
    span.start(collect=True)
    a = torch.zeros(1024, 1024)
    b = torch.zeros(256, 1024)
    del a
    KEPT.append(b)
    verdicts = span.stop(limits, collect=True)
    KEPT.clear()
    usage = span.usage["cpu"]
    assert (usage.rise, usage.kept) == (5 * MiB, MiB)
    assert [v.passed for v in verdicts] == [True, False, True, False]
    assert [v.measured_bytes for v in verdicts] == [5 * MiB, 5 * MiB, MiB, MiB]


def test_a_failed_verdict_carries_its_explanation_and_nothing_the_recording_kept() -> None:
    memory = Span([meter("cpu")], record="cpu")
    leaks = Span([meter("cpu")], tensors="cpu")
    leaks.start(collect=True)
    memory.start()
    model = torch.nn.Linear(256, 1024)  # 1 MiB + 4 KiB; the recording sees it run
    model(torch.zeros(1, 256))
    del model
    KEPT.append(torch.zeros(512, 1024))
    leaks.freeze()
    [peak] = memory.stop([Limit("limit_memory", 0, "cpu")])
    [leak] = leaks.stop([Limit("limit_leaks", 0, "cpu")], collect=True)
    KEPT.clear()
    assert peak.peak is not None
    # The model was freed at its del (the recording holds nothing alive): the peak is KEPT.
    assert max(h.bytes for h in peak.peak.largest_at_peak) == 2 * MiB
    assert MiB not in {h.bytes for h in peak.peak.largest_at_peak}
    assert [(r.shape, r.nbytes) for r in leak.stayed] == [((512, 1024), 2 * MiB)]
    # The span that ends after the recording is gone does not see its log.
    assert leaks.usage["cpu"].kept == 2 * MiB


def usage(device: str, start: int, peak: int, end: int, exact: bool = True) -> Usage:
    return Usage(device, start, peak, end, exact)


def test_failure_messages() -> None:
    peak = Verdict(Limit("limit_memory", MiB, "cpu"), usage("cpu", 512, 512 + 4 * MiB, 512))
    assert failure(peak) == (
        "Test was limited to 1.00M but peaked at 4.00M on cpu (4,194,304 bytes above the"
        " 512.00B in use when it started)"
    )
    sampled = Verdict(
        Limit("limit_memory", MiB, "ram", setup=True), usage("ram", 0, 3 * MiB, 0, exact=False)
    )
    assert failure(sampled) == (
        "Test was limited to 1.00M but peaked at ~3.00M on ram (3,145,728 bytes above the"
        " 0.00B in use when its setup started)"
    )
    leak = Verdict(Limit("limit_leaks", 0, "cuda:1", setup=True), usage("cuda:1", 0, 0, 1536))
    assert failure(leak) == (
        "Test was limited to leaking 0.00B but kept 1.50K on cuda:1 (1,536 bytes more in use"
        " after its teardown and gc.collect() than when its setup started)"
    )


def test_an_explanation_only_where_there_is_something_to_show() -> None:
    ram = Verdict(Limit("limit_memory", 0, "ram"), usage("ram", 0, MiB, 0))
    assert explanation(ram) is None
    assert explanation(Verdict(Limit("limit_leaks", 0, "ram"), usage("ram", 0, MiB, MiB))) is None
    unseen = Verdict(Limit("limit_leaks", 0, "cpu"), usage("cpu", 0, MiB, MiB))
    assert explanation(unseen) == (
        "torchmem: tensors that stayed on cpu",
        "No tensor Python can reach stayed: the memory is held where gc cannot see it"
        " (a C++ cache, a graph autograd keeps for a backward pass that never ran).\n",
    )


def test_the_summary_lists_the_highest_rises_per_device_gpus_first() -> None:
    tests = [
        ("t.py::a", {"cpu": usage("cpu", 0, MiB, 0), "ram": usage("ram", 100 * MiB, 120 * MiB, 0)}),
        ("t.py::b", {"cpu": usage("cpu", 8 * MiB, 12 * MiB, 0)}),
        ("t.py::c", {"cpu": usage("cpu", 0, 4 * MiB, 0), "cuda:0": usage("cuda:0", 0, 512, 0)}),
        ("t.py::d", {"cpu": usage("cpu", 2 * MiB, MiB, 0)}),  # fell: a rise of 0
    ]
    assert summary(tests, top=2) == (
        "cuda:0: the highest peak of 1 test\n"
        "     peak  start  test\n"
        "  512.00B  0.00B  t.py::c\n"
        "\n"
        "cpu: the 2 highest peaks of 4 tests\n"
        "   peak  start  test\n"
        "  4.00M  8.00M  t.py::b\n"
        "  4.00M  0.00B  t.py::c\n"
        "\n"
        "ram: the highest peak of 1 test\n"
        "    peak    start  test\n"
        "  20.00M  100.00M  t.py::a\n"
        "\n"
        "Peaks are bytes above what was in use when each test started.\n"
    )
    sampled = [("t.py::a", {"ram": usage("ram", 0, MiB, 0, exact=False)})]
    assert summary(sampled, top=5) == (
        "ram: the highest peak of 1 test\n"
        "    peak  start  test\n"
        "  ~1.00M  0.00B  t.py::a\n"
        "\n"
        "Peaks are bytes above what was in use when each test started; ~ marks a sampled"
        " peak (the true one may be higher).\n"
    )
    assert summary([], top=5) == "No test was measured.\n"


@pytest.mark.parametrize("bad", ["lots", -1, True])
def test_bad_limits_are_named(bad: object) -> None:
    with pytest.raises(ValueError, match=f"invalid size {bad!r}"):
        limit_memory(bad)  # type: ignore[arg-type]


def _held_elsewhere(span: Span, limits: list[Limit]) -> list[Verdict]:
    """Stop `span` while a thread named "holder" holds 16 MiB it allocated in it, after
    this thread allocated 4 KiB."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        x = torch.zeros(4 * MiB)
        held.set()
        done.wait()
        del x

    mine = torch.zeros(1024)
    thread = threading.Thread(target=hold, name="holder")
    thread.start()
    held.wait()
    try:
        span.freeze()
        return span.stop(limits)
    finally:
        done.set()
        thread.join()
        del mine


def test_every_thread_counts_and_the_others_are_named() -> None:
    limit = Limit("limit_memory", 0, "cpu")
    span = Span.of(limit)
    span.start()
    [verdict] = _held_elsewhere(span, [limit])
    assert verdict.measured_bytes == 16 * MiB + 4096
    assert verdict.elsewhere == (Elsewhere(("holder",), 16 * MiB),)


def test_current_thread_only_counts_the_test_thread_alone() -> None:
    limit = Limit("limit_memory", 0, "cpu", current_thread_only=True)
    span = Span.of(limit)
    span.start()
    [verdict] = _held_elsewhere(span, [limit])
    assert verdict.measured_bytes == 4096
    assert verdict.elsewhere == ()


def test_a_tensor_that_stayed_is_named_after_the_line_that_made_it() -> None:
    limit = Limit("limit_leaks", 0, "cpu")
    span = Span.of(limit)
    span.start(collect=True)
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    KEPT.append(torch.zeros(512, 1024))
    [verdict] = span.stop([limit], collect=True)
    KEPT.clear()
    [stayed] = verdict.stayed
    assert (stayed.name, stayed.nbytes) == (f"Tensor@test_limits.py:{line}", 2 * MiB)
    assert verdict.origins == (
        Origin(
            shown(__file__),
            line,
            "test_a_tensor_that_stayed_is_named_after_the_line_that_made_it",
            "KEPT.append(torch.zeros(512, 1024))",
            2 * MiB,
        ),
    )


def test_what_other_threads_held_and_where_what_stayed_was_made_read_as_text() -> None:
    limit = Limit("limit_memory", MiB, "cpu")
    peak = Verdict(
        limit,
        usage("cpu", 0, 18 * MiB, 0),
        elsewhere=(Elsewhere(("worker",), 16 * MiB), Elsewhere(("a", "b"), MiB)),
    )
    assert failure(peak) == (
        "Test was limited to 1.00M but peaked at 18.00M on cpu (18,874,368 bytes above the"
        " 0.00B in use when it started), of which 16.00M from thread 'worker' and 1.00M from"
        " threads 'a', 'b' (not the test's)\n"
        "Every thread's allocations count: current_thread_only=True counts the test's thread"
        " alone."
    )
    ended = Verdict(limit, usage("cpu", 0, 2 * MiB, 0), elsewhere=(Elsewhere((), MiB),))
    assert (
        failure(ended)
        .splitlines()[0]
        .endswith("of which 1.00M from a thread that has ended (not the test's)")
    )
    record = TensorRecord(
        "Tensor@t.py:3", "cpu", (1024,), "torch.float32", "torch.strided", "Tensor", 1024, 4096
    )
    leak = Verdict(
        Limit("limit_leaks", 0, "cpu"),
        usage("cpu", 0, 4096, 4096),
        stayed=(record,),
        origins=(Origin("/p/t.py", 3, "test_keeps", "KEPT.append(x)", 4096),),
    )
    title, text = explanation(leak)  # type: ignore[misc]
    assert title == "torchmem: tensors that stayed on cpu"
    assert text.splitlines()[-2:] == [
        "Allocated at:",
        "  4.00K  /p/t.py:3  test_keeps  KEPT.append(x)",
    ]


GROWS = """
import pytest
import torch
from torch import nn

HISTORY = []


@pytest.mark.limit_leaks(0, device="cpu")
def test_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        out = model(torch.randn(64, 256))
        HISTORY.append(out)
        optimizer.zero_grad()
        out.square().mean().backward()
        optimizer.step()
"""


@pytest.mark.counting
def test_a_leak_in_a_training_loop_names_its_growth_per_step(
    pytester: pytest.Pytester, no_gpu: object
) -> None:
    """Each step keeps its output, 64 x 256 float32 (65,536 bytes), in a module's list:
    the explanation says by how much each step grows, from which line, and what holds it,
    found among the garbage collector's objects (the test's module is not among the
    variables the recording was given). The test keeps 917,504 bytes: the six outputs
    (6 x 65,536) and, through their graphs, the weight and its gradient (2 x 262,144)."""
    pytester.makepyfile(test_grows=GROWS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:memray", "-rA")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to leaking 0.00B but kept 896.00K on cpu (917,504 bytes more *",
            "*- torchmem: tensors that stayed on cpu -*",
            "cpu grows 64.00K per step from step 1, exactly at each of 5 steps (RAM * per step):",
            "  64.00K each step from */test_grows.py:14 (`out = model(torch.randn(64, 256))`),"
            " held by list `HISTORY` in module test_grows",
        ]
    )
