"""The pytest plugin, in real pytest runs (``pytester``): limits, their messages and
sections, fixtures, the summary, the JSON, pytest-xdist, bad markers, and doing nothing
when not asked.

Subprocess runs see no GPU, and in-process runs hide it, so the default device is CPU
tensors on every machine. In-process runs share this process's CPU meter: they assert
rises and bytes kept, which are exact whatever else is alive.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from standins import (
    CudaStandIn,
    GiB,
    HistoryStandIn,
    StandInGpu,
    environ_without_gpu,
    gpu_uuid,
)

pytestmark = pytest.mark.integration

MiB = 2**20

SIZES = """
import pytest
import torch

KEPT = []


@pytest.mark.limit_memory("1 MB")
def test_four_over_one():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.limit_memory("8 MB")
def test_four_under_eight():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.limit_leaks("1 MB")
def test_keeps_four():
    KEPT.append(torch.zeros(1024, 1024))


@pytest.mark.limit_leaks("1 MB")
def test_keeps_nothing():
    x = torch.zeros(1024, 1024)
    del x


def test_plain():
    KEPT.append(torch.zeros(2048, 1024))
"""
"""The issue's cases in one file: 4 MiB peaks and leaks under 1 MB and 8 MB limits."""

OUTCOMES = {
    "test_sizes.py::test_four_over_one": "FAILED",
    "test_sizes.py::test_four_under_eight": "PASSED",
    "test_sizes.py::test_keeps_four": "FAILED",
    "test_sizes.py::test_keeps_nothing": "PASSED",
    "test_sizes.py::test_plain": "PASSED",
}


@pytest.fixture(autouse=True, scope="module")
def imported_here_first() -> None:
    """An in-process run drops the modules first imported during it (pytester restores
    ``sys.modules``), and some cannot be imported twice (``torch._dynamo``'s operators,
    which a recording imports): import them in this process first."""
    from torchmem.limits import Span
    from torchmem.meters import meter
    from torchmem.records.limits import Limit

    span = Span([meter("cpu")], record="cpu", tensors="cpu")
    span.start()
    torch.nn.Linear(2, 2)(torch.zeros(1, 2))
    span.stop([Limit("limit_memory", 0, "cpu"), Limit("limit_leaks", 0, "cpu")])
    gc.collect()


@pytest.fixture
def no_gpu_anywhere(monkeypatch: pytest.MonkeyPatch, no_gpu: object) -> None:
    """No GPU in this process (in-process runs) or in subprocesses (subprocess runs)."""
    for name, value in environ_without_gpu().items():
        monkeypatch.setenv(name, value)


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """Each test's outcome, from the short summary of a run with ``-rA``."""
    found = {}
    for line in result.outlines:
        match = re.match(r"(PASSED|FAILED|ERROR) (\S+::\S+)", line)
        if match:
            found[match[2]] = match[1]
    return found


# pytest-memray (installed for the benchmarks) acts on the same markers: not here.
QUIET = ("-p", "no:cacheprovider", "-p", "no:memray", "-rA")


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*QUIET, *args)


def run_here(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess(*QUIET, *args)


@pytest.mark.slow
def test_the_issue_cases_in_a_subprocess_alone_and_under_xdist(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(test_sizes=SIZES)
    alone = run(pytester, "--torchmem")
    assert outcomes(alone) == OUTCOMES
    alone.stdout.fnmatch_lines(
        [
            "*_ test_four_over_one _*",
            "Test was limited to 1.00M but peaked at 4.00M on cpu (4,194,304 bytes above the"
            " 0.00B in use when it started)",
            "*_ test_keeps_four _*",
            "Test was limited to leaking 1.00M but kept 4.00M on cpu (4,194,304 bytes more in"
            " use after it returned and gc.collect() than when it started)",
            "*= torchmem: highest peaks =*",
            "cpu: the 5 highest peaks of 5 tests",
            "   peak  start  test",
            "  8.00M  4.00M  test_sizes.py::test_plain",
            "  4.00M  0.00B  test_sizes.py::test_four_over_one",
            "  4.00M  0.00B  test_sizes.py::test_four_under_eight",
            "  4.00M  0.00B  test_sizes.py::test_keeps_four",
            "  4.00M  4.00M  test_sizes.py::test_keeps_nothing",
            "ram: the 5 highest peaks of 5 tests",
        ]
    )
    two = run(pytester, "--torchmem", "-n", "2")
    assert outcomes(two) == OUTCOMES
    two.stdout.fnmatch_lines(
        [
            "Test was limited to 1.00M but peaked at 4.00M on cpu (4,194,304 bytes above the"
            " * in use when it started)",
            "Test was limited to leaking 1.00M but kept 4.00M on cpu *",
            "*= torchmem: highest peaks =*",
            "cpu: the 5 highest peaks of 5 tests",
            "   peak  start  test",
            "  8.00M  *  test_sizes.py::test_plain",
            "  4.00M  *  test_sizes.py::test_four_over_one",
        ]
    )


@pytest.mark.slow
def test_without_a_marker_or_option_nothing_is_imported_or_measured(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(
        """
        import sys

        def test_plain():
            assert "torch" not in sys.modules
            assert "torchmem.limits" not in sys.modules
        """
    )
    result = run(pytester)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["plugins:*torchmem-*"])  # loaded, and silent:
    result.stdout.no_fnmatch_line("*torchmem:*")


def test_a_failure_says_what_held_memory_at_the_peak(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(
        test_peak="""
        import pytest
        import torch

        @pytest.mark.limit_memory("5 MB")
        def test_two_tensors():
            a = torch.zeros(1024, 1024)
            b = torch.zeros(512, 1024)
            del a, b
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to 5.00M but peaked at 6.00M on cpu (6,291,456 bytes above the"
            " * in use when it started)",
            "*- torchmem: what held memory at the peak on cpu -*",
            "Allocation sites alive at the peak on cpu:",
            "*4.00M  */test_peak.py:6  test_two_tensors*",
            "*2.00M  */test_peak.py:7  test_two_tensors*",
            "Largest allocations alive at the peak on cpu:",
            "*4.00M  Tensor@test_peak.py:6  other*",
            "*2.00M  Tensor@test_peak.py:7  other*",
        ]
    )


def test_a_leak_lists_the_tensors_that_stayed_named_after_the_line_that_made_them(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(
        test_leak="""
        import pytest
        import torch

        CACHE = {}

        @pytest.mark.limit_leaks(0)
        def test_caches():
            CACHE["weights"] = torch.zeros(256, 1024)
            torch.zeros(1024, 1024)  # freed at once: not a leak
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to leaking 0.00B but kept 1.00M on cpu (1,048,576 bytes more *",
            "*- torchmem: tensors that stayed on cpu -*",
            "Element type*Size*Used MEM",
            "+ Tensor@test_leak.py:8 ?cpu?*(256, 1024)*1.00M",
            "Appeared: 1 (1.00M) *",
            "*",
            "Allocated at:",
            '  1.00M  */test_leak.py:8  test_caches  CACHE?"weights"? = torch.zeros(256, 1024)',
        ]
    )


def test_a_leak_of_dataloader_workers_batches_is_named_after_the_loop(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    """The batches arrive in shared memory, which the CPU allocator does not make."""
    pytester.makepyfile(
        test_batches="""
        import pytest
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        SEEN = []

        @pytest.mark.limit_leaks(0)
        def test_keeps_every_batch():
            data = TensorDataset(torch.zeros(256, 256))
            loader = DataLoader(data, batch_size=64, num_workers=2, multiprocessing_context="fork")
            for (x,) in loader:
                SEEN.append(x)
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to leaking 0.00B but kept 256.00K on cpu (262,144 bytes more *",
            "*",
            "Allocated at:",
            "  256.00K  */test_batches.py:11  test_keeps_every_batch  for (x,) in loader:",
        ]
    )


FIXTURES = """
import pytest
import torch

LEAKED = []


@pytest.fixture
def weights():
    return torch.zeros(1024, 1024)


@pytest.fixture
def leaky():
    LEAKED.append(torch.zeros(1024, 1024))


@pytest.mark.limit_memory("1 MB")
def test_body_only(weights):
    assert weights.sum() == 0


@pytest.mark.limit_memory("1 MB", setup=True)
def test_with_setup(weights):
    pass


@pytest.mark.limit_leaks("1 MB")
def test_fixture_is_no_leak(weights):
    pass


@pytest.mark.limit_leaks("1 MB", setup=True)
def test_leaky_fixture(leaky):
    pass
"""


def test_fixtures_are_charged_only_when_asked(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(test_fixtures=FIXTURES)
    result = run_here(pytester)
    assert outcomes(result) == {
        "test_fixtures.py::test_body_only": "PASSED",
        "test_fixtures.py::test_with_setup": "FAILED",
        "test_fixtures.py::test_fixture_is_no_leak": "PASSED",
        # The body passed; the teardown errs: the leak is known only after it.
        "test_fixtures.py::test_leaky_fixture": "ERROR",
    }
    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaky_fixture*",
            "Test was limited to leaking 1.00M but kept 4.00M on cpu (4,194,304 bytes more in"
            " use after its teardown and gc.collect() than when its setup started)",
            "*_ test_with_setup _*",
            "Test was limited to 1.00M but peaked at 4.00M on cpu (* above the * in use when"
            " its setup started)",
        ]
    )


def test_a_test_that_fails_by_itself_keeps_its_own_failure(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(
        test_own="""
        import pytest
        import torch

        @pytest.mark.limit_memory(0)
        @pytest.mark.limit_leaks(0)
        def test_raises():
            x = torch.zeros(1024)
            raise ValueError("the test's own")
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E * ValueError: the test's own"])
    result.stdout.no_fnmatch_line("*Test was limited*")


@pytest.mark.parametrize(
    ("marker", "error"),
    [
        ('limit_memory("lots")', "@pytest.mark.limit_memory: invalid size 'lots': *"),
        ("limit_memory(-1)", "@pytest.mark.limit_memory: invalid size -1: *"),
        (
            "limit_leaks()",
            "@pytest.mark.limit_leaks: limit_leaks() missing 1 required positional argument:"
            " 'limit'",
        ),
        ('limit_memory("1 MB", device="tpu")', "@pytest.mark.limit_memory: invalid device 'tpu'*"),
        ('limit_memory("1 MB", setup="yes")', "@pytest.mark.limit_memory: invalid setup 'yes'*"),
        (
            'limit_memory("1 MB", devcie="cpu")',
            "*limit_memory() got an unexpected keyword argument 'devcie'",
        ),
    ],
)
def test_a_bad_marker_errs_with_its_value_named(
    pytester: pytest.Pytester, marker: str, error: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_marked():
            pass
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([error])
    result.stdout.no_fnmatch_line("*Traceback*")


def test_the_json_file_has_every_test_in_bytes(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(test_sizes=SIZES)
    result = run_here(pytester, "--torchmem-json", "memory.json")
    assert outcomes(result) == OUTCOMES
    result.stdout.no_fnmatch_line("*torchmem: highest peaks*")  # --torchmem prints it
    document = json.loads((pytester.path / "memory.json").read_text())
    assert document["version"] == 1
    tests = {test["nodeid"]: test for test in document["tests"]}
    assert list(tests) == list(OUTCOMES)
    over = tests["test_sizes.py::test_four_over_one"]
    assert over["outcome"] == "failed"
    assert set(over["devices"]) == {"cpu", "ram"}
    cpu = over["devices"]["cpu"]
    assert (cpu["peak_bytes"] - cpu["start_bytes"], cpu["end_bytes"] - cpu["start_bytes"]) == (
        4 * MiB,
        0,
    )
    assert over["limits"] == [
        {
            "marker": "limit_memory",
            "device": "cpu",
            "limit_bytes": MiB,
            "measured_bytes": 4 * MiB,
            "setup": False,
            "current_thread_only": False,
            "passed": False,
        }
    ]
    plain = tests["test_sizes.py::test_plain"]
    assert plain["outcome"] == "passed" and plain["limits"] == []
    cpu = plain["devices"]["cpu"]
    assert cpu["end_bytes"] - cpu["start_bytes"] == 8 * MiB
    assert tests["test_sizes.py::test_keeps_nothing"]["limits"][0]["measured_bytes"] == 0


def test_summary_top_n_and_a_bad_n(pytester: pytest.Pytester, no_gpu_anywhere: None) -> None:
    pytester.makepyfile(test_sizes=SIZES)
    result = run_here(pytester, "--torchmem", "--torchmem-top", "1")
    result.stdout.fnmatch_lines(
        [
            "cpu: the highest peak of 5 tests",
            "*peak*start  test",
            "  8.00M  *  test_sizes.py::test_plain",
            "",
            "ram: the highest peak of 5 tests",
        ]
    )
    bad = run_here(pytester, "--torchmem", "--torchmem-top", "0")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--torchmem-top must be at least 1, not 0*"])


def test_process_ram_is_a_device(pytester: pytest.Pytester, no_gpu_anywhere: None) -> None:
    pytester.makepyfile(
        test_ram="""
        import numpy
        import pytest

        @pytest.mark.limit_memory("1 MB", device="ram")
        def test_touches_64_mib():
            buffer = numpy.ones(64 * 2**20, dtype=numpy.uint8)
            del buffer

        @pytest.mark.limit_memory("1 GB", device="ram")
        def test_small():
            bytearray(2**20)
        """
    )
    result = run_here(pytester)
    assert outcomes(result) == {
        "test_ram.py::test_touches_64_mib": "FAILED",
        "test_ram.py::test_small": "PASSED",
    }
    result.stdout.fnmatch_lines(["Test was limited to 1.00M but peaked at 6*M on ram (*"])
    result.stdout.no_fnmatch_line("*torchmem: what held memory*")


LEFT_OPEN = """
import torch
from torchmem.meters import meter


def pytest_unconfigure(config):
    windows = [r for d in ("cpu", "ram") for r in meter(d)._windows.values() if r() is not None]
    hooks = torch.nn.modules.module._global_forward_hooks
    print(f"left open: {len(windows)} windows, {len(hooks)} forward hooks")
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["call", "setup"])
def test_an_interrupt_leaves_no_window_or_hook_behind(
    pytester: pytest.Pytester, no_gpu_anywhere: None, where: str
) -> None:
    pytester.makeconftest(LEFT_OPEN)
    pytester.makepyfile(
        f"""
        import pytest
        import torch

        @pytest.fixture
        def fixture():
            if "{where}" == "setup":
                raise KeyboardInterrupt
            return torch.zeros(1024)

        @pytest.mark.limit_memory("1 MB", setup=True)
        @pytest.mark.limit_leaks("1 MB", setup=True)
        def test_interrupted(fixture):
            torch.nn.Linear(2, 2)(torch.zeros(1, 2))
            raise KeyboardInterrupt
        """
    )
    result = run(pytester, "--torchmem")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["left open: 0 windows, 0 forward hooks"])


GPU_TESTS = """
import pytest
from the_gpu import cuda

KEPT = 4 * 2**20


@pytest.mark.limit_leaks("1 MB")
def test_keeps_four_on_the_gpu():
    cuda.alloc(0, KEPT)


def test_spikes_eight():
    cuda.spike(0, 8 * 2**20)
"""


def test_the_default_device_is_the_current_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, isolated_meters: None
) -> None:
    """Wiring, through the stand-in for ``torch.cuda``: no marker names a device, and the
    limit and the summary measure cuda:0 (the leak's explanation finds no tensor: the
    stand-in's memory has none)."""
    gpus = [StandInGpu(gpu_uuid(0), total=16 * GiB)]
    cuda = CudaStandIn(gpus).install(monkeypatch, environ=False)
    HistoryStandIn().install(monkeypatch)  # the leak's recording: no allocation site
    monkeypatch.setitem(sys.modules, "the_gpu", types.SimpleNamespace(cuda=cuda))
    pytester.makepyfile(test_gpu=GPU_TESTS)
    result = run_here(pytester, "--torchmem")
    assert outcomes(result) == {
        "test_gpu.py::test_keeps_four_on_the_gpu": "FAILED",
        "test_gpu.py::test_spikes_eight": "PASSED",
    }
    result.stdout.fnmatch_lines(
        [
            "Test was limited to leaking 1.00M but kept 4.00M on cuda:0 (4,194,304 bytes *",
            "*- torchmem: tensors that stayed on cuda:0 -*",
            "No tensor Python can reach stayed*",
            "*= torchmem: highest peaks =*",
            "cuda:0: the 2 highest peaks of 2 tests",
            "   peak  start  test",
            "  8.00M  4.00M  test_gpu.py::test_spikes_eight",
            "  4.00M  0.00B  test_gpu.py::test_keeps_four_on_the_gpu",
            "",
            "cpu: the 2 highest peaks of 2 tests",
        ]
    )


@pytest.mark.cuda
def test_a_real_gpu_limit_names_the_line_that_allocated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_real="""
        import pytest
        import torch

        @pytest.mark.limit_memory("1 MB")
        def test_four_mib():
            x = torch.zeros(1024, 1024, device="cuda")
            del x
        """
    )
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to 1.00M but peaked at 4.00M on cuda:0 (4,194,304 bytes *",
            "*- torchmem: what held memory at the peak on cuda:0 -*",
            "*test_real.py:6*",
        ]
    )


def test_both_limits_on_a_model_run_and_no_false_leak(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    """The peak's recording keeps the models it saw and makes a log: neither may count
    as a leak, nor in the summary's end."""
    pytester.makepyfile(
        test_model="""
        import pytest
        import torch

        @pytest.mark.limit_memory("1 GB")
        @pytest.mark.limit_leaks(0)
        def test_forward():
            model = torch.nn.Linear(1024, 1024)
            y = model(torch.randn(4096, 1024)).relu()
            assert y.shape == (4096, 1024)
        """
    )
    result = run_here(pytester, "--torchmem-json", "memory.json")
    result.assert_outcomes(passed=1)
    [test] = json.loads((pytester.path / "memory.json").read_text())["tests"]
    cpu = test["devices"]["cpu"]
    assert cpu["end_bytes"] - cpu["start_bytes"] == 0
    assert [limit["measured_bytes"] for limit in test["limits"]] == [52 * MiB + 4096, 0]


def test_a_test_that_records_itself_is_explained_all_the_same(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(
        test_nested="""
        import pytest
        import torch
        import torchmem

        @pytest.mark.limit_memory("1 MB")
        def test_records():
            with torchmem.record("cpu") as rec:
                x = torch.zeros(1024, 1024)
                del x
            assert rec.report().devices["cpu"].peak_bytes >= 4 * 2**20
        """
    )
    result = run_here(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "Test was limited to 1.00M but peaked at 4.00M on cpu *",
            "Allocation sites alive at the peak on cpu:",
            "*4.00M  */test_nested.py:8  test_records*",
        ]
    )


@pytest.mark.slow
def test_the_readme_failure_is_what_pytest_prints(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    section = (Path(__file__).resolve().parent.parent / "docs" / "pytest.md").read_text()
    code, shown = re.findall(r"```(?:python|text)\n(.*?)```", section, re.S)[:2]
    pytester.makepyfile(test_model=code)
    # pytest-memray loaded too where it is installed: the example is torchmem's all the same.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.no_fnmatch_line("*PytestWarning*")
    printed = "\n".join(result.outlines).replace(str(pytester.path), "/home/me/project")
    start = printed.index("=" * 35 + " FAILURES")
    failures = printed[start : printed.index("\n" + "=" * 27 + " short", start)]
    expected = shown[: shown.index("\n" + "=" * 27 + " short")]
    assert failures == expected


BESIDE_MEMRAY = """
import pytest
import torch


@pytest.mark.limit_memory("1 MB", device="cpu")
def test_ours_by_its_device():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.torchmem_limit_memory("1 MB")
def test_ours_by_its_name():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.limit_memory("1.5 GiB")  # a size pytest-memray cannot read
def test_ours_by_its_size():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.torchmem_limit_leaks(0)
@pytest.mark.limit_memory("1 MB")
def test_both():
    bytearray(4 * 2**20)


class TestShared:
    pytestmark = pytest.mark.limit_leaks(0, device="cpu")

    def test_one(self):
        torch.zeros(256)

    def test_two(self):
        KEPT.append(torch.zeros(256))


KEPT = []
"""


@pytest.mark.parametrize("flag", [(), ("--memray",)], ids=["markers", "--memray"])
def test_beside_pytest_memray_each_plugin_judges_its_own_markers(
    pytester: pytest.Pytester, no_gpu_anywhere: None, flag: tuple[str, ...]
) -> None:
    """pytest-memray acts on markers of its names with or without ``--memray``, and ends
    the whole run with an INTERNALERROR on arguments its functions do not take: it
    never sees torchmem's. A marker with only its arguments is its, with a warning."""
    pytest.importorskip("pytest_memray")
    pytester.makepyfile(test_beside=BESIDE_MEMRAY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *flag)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    assert outcomes(result) == {
        "test_beside.py::test_ours_by_its_device": "FAILED",
        "test_beside.py::test_ours_by_its_name": "FAILED",
        "test_beside.py::test_ours_by_its_size": "PASSED",
        "test_beside.py::TestShared::test_one": "PASSED",
        "test_beside.py::TestShared::test_two": "FAILED",
    }
    ours = (
        "Test was limited to 1.00M but peaked at 4.00M on cpu (4,194,304 bytes above the"
        " * in use when it started)"
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_ours_by_its_device _*",
            ours,
            "*_ test_ours_by_its_name _*",
            ours,
            "*_ test_both _*",
            "Test was limited to 1.0MiB but allocated 4.0MiB",  # pytest-memray's
            "*_ TestShared.test_two _*",
            "Test was limited to leaking 0.00B but kept 1.00K on cpu (1,024 bytes more in use"
            " after it returned and gc.collect() than when it started)",
            "*PytestWarning: pytest-memray is loaded and judges the limit_memory and"
            " limit_leaks markers that it can read*torchmem_limit_memory*-p no:memray*",
            "MEMORY PROBLEMS test_beside.py::test_both*",
        ]
    )
    assert result.stdout.str().count("PytestWarning: pytest-memray is loaded") == 1


def test_torch_func_runs_in_a_limited_test(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    """torch.func refuses to run while saved-tensor hooks are installed: ours step aside."""
    pytester.makepyfile(
        test_func="""
        import pytest
        import torch

        @pytest.mark.limit_memory("64 MB", device="cpu")
        def test_per_sample_gradients():
            def loss(w, x):
                return ((x @ w).tanh() ** 2).sum()

            w, x = torch.randn(256, 256), torch.randn(64, 1, 256)
            grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
            assert grads.shape == (64, 256, 256)

        @pytest.mark.limit_leaks("64 MB", device="cpu")
        def test_per_sample_gradients_of_a_module():
            model = torch.nn.Linear(256, 1)
            params = {k: v.detach() for k, v in model.named_parameters()}

            def loss(p, x):
                return torch.func.functional_call(model, p, (x,)).sum()

            x = torch.randn(64, 1, 256)
            grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
            assert grads["weight"].shape == (64, 1, 256)
        """
    )
    result = run(pytester, "--torchmem")
    result.assert_outcomes(passed=2)


XFAIL = """
import pytest
import torch


@pytest.mark.xfail(reason="over its limit")
@pytest.mark.limit_memory("1 MB")
def test_over():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.xfail(reason="over its limit", strict=True)
@pytest.mark.limit_memory("1 MB")
def test_over_strict():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.xfail(reason="over its limit", strict=True)
@pytest.mark.limit_memory("8 MB")
def test_within_strict():
    x = torch.zeros(1024, 1024)
    del x


@pytest.mark.xfail(reason="over its limit")
@pytest.mark.limit_leaks("1 MB")
def test_within():
    x = torch.zeros(1024, 1024)
    del x
"""


def test_a_limit_gone_over_is_a_failure_xfail_expects(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    pytester.makepyfile(test_xfail=XFAIL)
    result = run_here(pytester, "--torchmem-json", "memory.json")
    result.assert_outcomes(xfailed=2, failed=1, xpassed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the strict XPASS alone
    result.stdout.fnmatch_lines(
        [
            "*_ test_within_strict _*",
            "[XPASS(strict)] over its limit",
            "*short test summary info*",
            "XFAIL test_xfail.py::test_over - over its limit",
            "XFAIL test_xfail.py::test_over_strict - over its limit",
            "XPASS test_xfail.py::test_within - over its limit",
            "FAILED test_xfail.py::test_within_strict - [XPASS(strict)] over its limit",
        ]
    )
    result.stdout.no_fnmatch_line("*torchmem: what held memory*")
    tests = json.loads((pytester.path / "memory.json").read_text())["tests"]
    assert [(t["outcome"], [v["measured_bytes"] for v in t["limits"]]) for t in tests] == [
        ("skipped", [4 * MiB]),
        ("skipped", [4 * MiB]),
        ("failed", [4 * MiB]),
        ("passed", [0]),
    ]


HELD = """
import gc

import pytest
import torch
from torchmem.meters import meter

START = []


def test_first():
    gc.disable()  # whatever outlives a test, the way only gc.collect() frees it
    START.append(meter("cpu").used())


@pytest.mark.limit_memory("64 MB")
def test_raises():
    model = torch.nn.Linear(1024, 1024)
    model(torch.zeros(4, 1024))
    raise ValueError("the test's own")


@pytest.mark.limit_memory("1 MB")
def test_over():
    model = torch.nn.Linear(1024, 1024)
    model(torch.zeros(4, 1024))


def test_next():
    used = meter("cpu").used()
    gc.enable()
    print(f"in use after the others: {used - START[0]:,} bytes")
"""


def test_a_failed_test_keeps_nothing_alive_after_it(
    pytester: pytest.Pytester, no_gpu_anywhere: None
) -> None:
    """A failure, the test's own or a limit's, holds the test's frame (its model) in its
    traceback: nothing of the plugin's may hold that traceback in a reference cycle."""
    pytester.makepyfile(test_held=HELD)
    result = run_here(pytester, "-s")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*in use after the others: 0 bytes*"])


THREADS = """
import threading

import pytest
import torch

GO, HELD, FREE, FREED = (threading.Event() for _ in range(4))
STOP = threading.Event()


def churn():
    while True:
        GO.wait()
        GO.clear()
        if STOP.is_set():
            return
        x = torch.zeros(4 * 2**20)
        HELD.set()
        FREE.wait()
        FREE.clear()
        del x
        FREED.set()


def elsewhere():
    # The worker allocates 16 MiB while this thread waits, and frees it.
    HELD.clear()
    FREED.clear()
    GO.set()
    HELD.wait()
    FREE.set()
    FREED.wait()


def test_starts_a_worker():
    threading.Thread(target=churn, name="worker", daemon=True).start()


@pytest.mark.limit_memory("2 MB", device="cpu")
def test_every_thread():
    x = torch.zeros(1024)
    elsewhere()


@pytest.mark.limit_memory("2 MB", device="cpu", current_thread_only=True)
def test_this_thread():
    x = torch.zeros(1024)
    elsewhere()


@pytest.mark.limit_leaks(0, device="cpu", current_thread_only=True)
def test_this_thread_keeps_nothing():
    elsewhere()


def test_stops_the_worker():
    STOP.set()
    GO.set()
"""


@pytest.mark.parametrize("summary", [(), ("--torchmem",)], ids=["limits", "--torchmem"])
def test_a_thread_of_another_test_is_counted_named_or_left_out(
    pytester: pytest.Pytester, no_gpu_anywhere: None, summary: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_threads=THREADS)
    result = run_here(pytester, "--torchmem-json", "memory.json", *summary)
    assert outcomes(result) == {
        "test_threads.py::test_starts_a_worker": "PASSED",
        "test_threads.py::test_every_thread": "FAILED",
        "test_threads.py::test_this_thread": "PASSED",
        "test_threads.py::test_this_thread_keeps_nothing": "PASSED",
        "test_threads.py::test_stops_the_worker": "PASSED",
    }
    result.stdout.fnmatch_lines(
        [
            "Test was limited to 2.00M but peaked at 16.00M on cpu (16,781,312 bytes above the"
            " * in use when it started), of which 16.00M from thread 'worker' (not the test's)",
            "Every thread's allocations count: current_thread_only=True counts the test's"
            " thread alone.",
            "*- torchmem: what held memory at the peak on cpu -*",
        ]
    )
    document = json.loads((pytester.path / "memory.json").read_text())
    tests = {t["nodeid"]: t for t in document["tests"]}
    measured = {
        name.split("::")[1]: [(v["current_thread_only"], v["measured_bytes"]) for v in t["limits"]]
        for name, t in tests.items()
        if t["limits"]
    }
    assert measured == {
        "test_every_thread": [(False, 16 * MiB + 4096)],
        "test_this_thread": [(True, 4096)],
        "test_this_thread_keeps_nothing": [(True, 0)],
    }
