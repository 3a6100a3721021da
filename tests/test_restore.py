"""The out-of-memory traceback helpers, in a real IPython shell."""

import gc
import re
import traceback
import weakref

import pytest
import torch

from standins import MiB
from torchmem import get_ref_free_exc_info, gpu_mem_restore, gpu_mem_restore_ctx, meter

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    monkeypatch.delenv("TORCHMEM_TB_CLEAR_FRAMES", raising=False)
    monkeypatch.delenv("FASTAI_TB_CLEAR_FRAMES", raising=False)


def call_failing(wrapped, error):
    """Call a function that holds a tensor in a local and raises `error`; return the
    caught error (held, as IPython holds it) and a weak reference to the tensor's storage."""
    refs = []

    def hold_and_fail():
        big = torch.ones(1024)
        refs.append(weakref.ref(big.untyped_storage()))
        raise error

    with pytest.raises(type(error)) as info:
        wrapped(hold_and_fail)()
    return info.value, refs[0]


def cpu_oom() -> RuntimeError:
    try:
        torch.empty(2**45)
    except RuntimeError as exc:
        return exc
    raise AssertionError("expected the CPU allocator to refuse 128 TiB")


SETUP = """
import weakref, torch
refs = []
def hold_and_fail():
    big = torch.ones(50 * 2**20)  # 200 MiB, every page touched
    refs.append(weakref.ref(big.untyped_storage()))
    torch.empty(2**45)  # a real out-of-memory error from the CPU allocator
"""


@pytest.mark.parametrize(
    ("cell", "freed"),
    [
        ("hold_and_fail()", False),
        ("from torchmem import gpu_mem_restore\ngpu_mem_restore(hold_and_fail)()", True),
        (
            "from torchmem import gpu_mem_restore_ctx\n"
            "with gpu_mem_restore_ctx():\n    hold_and_fail()",
            True,
        ),
    ],
    ids=["plain", "decorator", "context manager"],
)
def test_out_of_memory_in_a_cell_gives_the_memory_back(ipython, cell, freed):
    ipython.run_cell(SETUP)
    ram = meter("ram")
    before = ram.used()
    result = ipython.run_cell(cell)
    assert "can't allocate memory" in str(result.error_in_exec)
    del result
    gc.collect()
    alive = ipython.user_ns["refs"][0]() is not None
    grown = ram.used() - before
    if freed:
        assert not alive
        assert grown < 100 * MiB
    else:  # IPython's stored traceback keeps the 200 MiB tensor alive
        assert alive
        assert grown >= 200 * MiB - MiB


def test_outside_ipython_the_decorator_only_calls():
    error, ref = call_failing(gpu_mem_restore, cpu_oom())
    assert ref() is not None
    assert error.__traceback__ is not None


@pytest.mark.parametrize(
    ("error", "setting", "cleared"),
    [
        (cpu_oom(), None, True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), None, True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), None, True),
        (KeyboardInterrupt(), None, True),
        (ValueError("not about memory"), None, False),
        (ValueError("not about memory"), "1", True),
        (cpu_oom(), "0", False),
        (KeyboardInterrupt(), "0", False),
    ],
)
def test_when_the_decorator_clears(ipython, monkeypatch, error, setting, cleared):
    if setting is not None:
        monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", setting)
    caught, ref = call_failing(gpu_mem_restore, error)
    assert caught is error  # the same object, re-raised
    assert (ref() is None) is cleared


def test_fastai_variable_is_honoured_and_ours_wins(ipython, monkeypatch):
    monkeypatch.setenv("FASTAI_TB_CLEAR_FRAMES", "1")
    assert call_failing(gpu_mem_restore, ValueError("x"))[1]() is None
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", "0")
    assert call_failing(gpu_mem_restore, cpu_oom())[1]() is not None


def test_device_side_assert_warns_to_restart(ipython):
    error = RuntimeError("CUDA error: device-side assert triggered")
    with pytest.warns(UserWarning, match="must restart the kernel"):
        _, ref = call_failing(gpu_mem_restore, error)
    assert ref() is None


def test_the_context_manager_clears_on_any_error_unless_turned_off(monkeypatch):
    ctx = lambda f: lambda: _run_in(gpu_mem_restore_ctx, f)  # noqa: E731
    assert call_failing(ctx, ValueError("x"))[1]() is None
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", "0")
    assert call_failing(ctx, ValueError("x"))[1]() is not None


def _run_in(context, function):
    with context():
        function()


def test_the_error_keeps_its_type_message_and_traceback_lines(ipython, monkeypatch):
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", "1")
    error = ValueError("kept as it was")
    with pytest.raises(ValueError) as info:
        gpu_mem_restore(_raise)(error)
    assert info.value is error
    assert info.value.args == ("kept as it was",)
    text = "".join(traceback.format_exception(error))
    assert "raise error" in text and "in _raise" in text
    assert text.endswith("ValueError: kept as it was\n")


def _raise(error):
    raise error


def test_get_ref_free_exc_info_clears_the_frames():
    refs = []

    def fails():
        big = torch.ones(1024)
        refs.append(weakref.ref(big.untyped_storage()))
        raise ValueError("x")

    try:
        fails()
    except ValueError:
        exc_type, exc, tb = get_ref_free_exc_info()
    assert exc_type is ValueError
    assert tb is exc.__traceback__
    gc.collect()
    assert refs[0]() is None


# Generators in the traceback -------------------------------------------------------------


def test_a_suspended_generator_in_the_traceback_can_still_be_resumed(capsys):
    """A generator that caught an out-of-memory error and handed it out is still paused
    inside the error's traceback: clearing its frame would finalize it."""
    finalized = []

    def steps():
        try:
            try:
                torch.empty(2**45)
            except RuntimeError as exc:
                error = exc
            yield error
            yield "resumed"
        finally:
            finalized.append(True)

    paused = steps()
    error = next(paused)
    with pytest.raises(RuntimeError) as info, gpu_mem_restore_ctx():
        raise error
    assert info.value is error
    assert paused.gi_frame in [entry.tb_frame for entry in _entries(error.__traceback__)]
    assert finalized == []
    assert next(paused) == "resumed"
    paused.close()
    assert finalized == [True]
    assert capsys.readouterr().err.startswith("Out of memory on cpu")


def test_a_finished_generators_frame_is_still_cleared():
    refs = []

    def fails():
        big = torch.ones(1024)
        refs.append(weakref.ref(big.untyped_storage()))
        raise ValueError("x")
        yield

    with pytest.raises(ValueError), gpu_mem_restore_ctx():
        next(fails())
    gc.collect()
    assert refs[0]() is None


def test_get_ref_free_exc_info_leaves_a_suspended_generator_alone():
    def steps():
        try:
            raise ValueError("x")
        except ValueError as exc:
            yield exc
        yield "resumed"

    paused = steps()
    error = next(paused)
    try:
        raise error
    except ValueError:
        get_ref_free_exc_info()
    assert next(paused) == "resumed"


def _entries(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


# The settings, as written by hand ----------------------------------------------------------


@pytest.mark.parametrize("value", [" 0", "0 ", "\t0\n", "false", "False", "NO", "off"])
def test_never_clear_spelt_with_spaces_or_in_words(monkeypatch, value):
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", value)
    ctx = lambda f: lambda: _run_in(gpu_mem_restore_ctx, f)  # noqa: E731
    assert call_failing(ctx, ValueError("x"))[1]() is not None


@pytest.mark.parametrize("value", [" 1", "1\n", "true", "Yes", "ON"])
def test_always_clear_spelt_with_spaces_or_in_words(ipython, monkeypatch, value):
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", value)
    assert call_failing(gpu_mem_restore, ValueError("x"))[1]() is None


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_setting_is_unset_and_fastais_is_read(ipython, monkeypatch, empty):
    monkeypatch.setenv("TORCHMEM_TB_CLEAR_FRAMES", empty)
    assert call_failing(gpu_mem_restore, cpu_oom())[1]() is None  # the default
    monkeypatch.setenv("FASTAI_TB_CLEAR_FRAMES", "0")
    assert call_failing(gpu_mem_restore, cpu_oom())[1]() is not None
    ctx = lambda f: lambda: _run_in(gpu_mem_restore_ctx, f)  # noqa: E731
    assert call_failing(ctx, ValueError("x"))[1]() is not None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCHMEM_TB_CLEAR_FRAMES", "2"),
        ("TORCHMEM_TB_CLEAR_FRAMES", "maybe"),
        ("TORCHMEM_TB_CLEAR_FRAMES", "0 1"),
        ("FASTAI_TB_CLEAR_FRAMES", "never"),
    ],
)
def test_an_unknown_setting_is_named_before_the_block_runs(ipython, monkeypatch, name, value):
    monkeypatch.setenv(name, value)  # after the import: read as the block starts
    ran = []
    expected = f"{name}={value!r} is not a valid setting"
    with pytest.raises(ValueError, match=re.escape(expected)), gpu_mem_restore_ctx():
        ran.append(True)
    with pytest.raises(ValueError, match=re.escape(expected)):
        gpu_mem_restore(ran.append)(True)
    assert ran == []
