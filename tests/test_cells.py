"""The per-cell memory logger, in a real IPython shell.

The GPU row is CPU tensors here (:func:`standins.hide_gpus`), exact to the byte on any
machine; the GPU wiring is checked through the CUDA and NVML stand-ins, and process RAM
in a fresh process, where no other thread moves the resident size.

The CPU meter counts every CPU tensor of the process, so *Used Total* includes what was
alive before a test: earlier tests' shells among it (IPython's ``atexit`` hook keeps
every shell, and its cells' tensors, alive). Tests read that base with :func:`alive`.
"""

from __future__ import annotations

import gc
import inspect
import re
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("IPython")  # the notebook extra

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from standins import (
    GiB,
    MiB,
    StandInGpu,
    call_in_fresh_process_without_gpu,
    gpu_uuid,
    install_gpus,
)
from torchmem import CellLogger, CellRecord, IPyGPULogger, meter
from torchmem.notebook.memlog import register
from torchmem.records.cells import Data

HEADER = re.compile(r"^RAM:\s+Consumed Peaked  Used Total  in \d+\.\d{3}s( \(In \[\d+\]\))?$")
GEN_ROW = re.compile(r"^Gen: +-?\d+ +\d+ +\d+ MB$")


pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("isolated_meters")]


@pytest.fixture
def logger(ipython: InteractiveShell, no_gpu: None) -> Iterator[CellLogger]:
    """A logger on the shell, GPUs hidden, with torch imported in the shell already."""
    ipython.run_cell("import torch")
    ipython.user_ns["torch"] = sys.modules["torch"]
    logger = CellLogger(shell=ipython)
    ipython.user_ns["logger"] = logger
    yield logger
    logger.stop()


def run(shell: InteractiveShell, cell: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run `cell` as a numbered cell; return the report lines printed (header on)."""
    capsys.readouterr()
    shell.run_cell(cell, store_history=True)
    out = capsys.readouterr().out.splitlines()
    starts = [i for i, line in enumerate(out) if line.startswith(("RAM:", "Gen:"))]
    return out[starts[0] :] if starts else []


def alive() -> int:
    """Bytes of CPU tensors alive in the process now, as the logger's CPU meter counts."""
    gc.collect()
    return meter("cpu").used()


def cpu_row(consumed: int, peaked: int, used: int) -> str:
    """The report's CPU tensors row for whole MB `consumed` and `peaked`, `used` bytes."""
    return f"CPU tensors:    {consumed:5d}  {peaked:5d}  {used // MiB:5d} MB"


def our_callbacks(shell: InteractiveShell, logger: CellLogger) -> list[object]:
    return [
        callback
        for event in ("pre_run_cell", "post_run_cell")
        for callback in shell.events.callbacks[event]
        if getattr(callback, "__self__", None) is logger
    ]


# Exact numbers ---------------------------------------------------------------------------


def test_a_cell_that_keeps_a_tensor_consumed_exactly_its_bytes(ipython, logger, capsys):
    logger.start()
    base = alive()
    lines = run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    record = logger.history[-1]
    assert (record.gpu_used_delta, record.gpu_peaked, record.gpu_used) == (
        4 * MiB,
        0,
        base + 4 * MiB,
    )
    assert record.gpu_device == "cpu"
    assert record.execution_count == ipython.execution_count - 1
    assert len(lines) == 3
    assert HEADER.match(lines[0]), lines[0]
    assert lines[0].startswith("RAM:         Consumed Peaked  Used Total  in ")
    assert lines[0].endswith(f" (In [{record.execution_count}])")
    assert GEN_ROW.match(lines[1]), lines[1]
    assert lines[2] == cpu_row(4, 0, base + 4 * MiB)
    assert logger.data.gpu_mem_used_delta == 4
    assert logger.data.gpu_mem_used == (base + 4 * MiB) // MiB


def test_a_temporary_freed_inside_one_call_shows_as_peaked(ipython, logger, capsys):
    logger.start()
    base = alive()
    run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    # norm, not sum: a large sum also allocates a partial sum per thread (machine-dependent)
    lines = run(ipython, "torch.zeros(2048, 1024).norm()", capsys)
    record = logger.history[-1]
    # the 4-byte norm is kept as Out[n]; the 8 MiB of zeros died inside the cell
    assert record.gpu_used_delta == 4
    assert record.gpu_peaked == 8 * MiB
    assert record.gpu_used == base + 4 * MiB + 4
    assert lines[2] == cpu_row(0, 8, base + 4 * MiB + 4)


def test_freeing_reports_a_negative_consumed_and_no_peak(ipython, logger, capsys):
    logger.start()
    base = alive()
    run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    lines = run(ipython, "del x", capsys)
    record = logger.history[-1]
    assert (record.gpu_used_delta, record.gpu_peaked, record.gpu_used) == (-4 * MiB, 0, base)
    assert lines[2] == cpu_row(-4, 0, base)


def test_data_is_seed_shaped_whole_mb_and_unpacks_into_seven(ipython, logger, capsys):
    assert logger.data == Data(0, 0, 0, 0, 0, 0, 0.0)
    logger.start()
    base = alive()
    run(ipython, "x = torch.zeros(3 * 1024 * 1024 // 4 + 1)", capsys)  # 3 MiB + 4 bytes
    (
        _gen_mem_used_delta,
        _gen_mem_peaked,
        gen_mem_used,
        gpu_mem_used_delta,
        gpu_mem_peaked,
        gpu_mem_used,
        time_delta,
    ) = logger.data
    assert (gpu_mem_used_delta, gpu_mem_peaked, gpu_mem_used) == (3, 0, (base + 3 * MiB + 4) // MiB)
    assert logger.history[-1].gpu_used_delta == 3 * MiB + 4
    assert gen_mem_used == logger.history[-1].gen_used // MiB
    assert isinstance(time_delta, float) and time_delta >= 0
    assert logger.data._fields == (
        "gen_mem_used_delta",
        "gen_mem_peaked",
        "gen_mem_used",
        "gpu_mem_used_delta",
        "gpu_mem_peaked",
        "gpu_mem_used",
        "time_delta",
    )


def test_time_is_the_cells_run_time(ipython, logger, capsys):
    logger.start()
    run(ipython, "import time; time.sleep(0.05)", capsys)
    assert 0.05 <= logger.history[-1].time_delta < 5


def test_one_garbage_collection_per_cell(ipython, logger, capsys, monkeypatch):
    # A full collection costs ~75 ms with torch loaded: the cell's reading needs one, the
    # next cell's start can reuse it.
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(args) or 0)
    logger.start()
    assert len(calls) == 1
    for cell in ("a = 1", "b = 2", "c = 3"):
        run(ipython, cell, capsys)
    assert len(calls) == 1 + 3
    logger.gc_collect = False
    run(ipython, "d = 4", capsys)
    assert len(calls) == 4


# Cells of every kind ---------------------------------------------------------------------


def test_an_empty_cell_gets_no_report(ipython, logger, capsys):
    logger.start()
    run(ipython, "a = 1", capsys)
    for cell in ("", "   \n"):
        assert run(ipython, cell, capsys) == []
    assert len(logger.history) == 1


def test_a_cell_that_raises_gets_one_report(ipython, logger, capsys):
    logger.start()
    capsys.readouterr()
    ipython.run_cell("x = torch.zeros(1024, 1024)\n1 / 0", store_history=True)
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out
    assert out.count("RAM:") == 1
    record = logger.history[-1]
    assert record.failed
    assert record.gpu_used_delta == 4 * MiB
    run(ipython, "a = (", capsys)  # a syntax error
    assert logger.history[-1].failed
    run(ipython, "a = 1", capsys)
    assert not logger.history[-1].failed


def test_a_capture_cell_gets_one_report(ipython, logger, capsys):
    logger.start()
    capsys.readouterr()
    ipython.run_cell(
        "%%capture captured\ny = torch.zeros(1024, 1024)\nprint('hidden')", store_history=True
    )
    out = capsys.readouterr().out
    assert out.count("RAM:") == 1
    assert "hidden" not in out
    assert ipython.user_ns["captured"].stdout == "hidden\n"
    assert len(logger.history) == 1
    assert logger.history[0].gpu_used_delta == 4 * MiB
    assert logger.history[0].execution_count is not None


def test_a_cell_that_starts_the_logger_is_reported_from_there(ipython, logger, capsys):
    lines = run(ipython, "a = torch.ones(16)\nlogger.start()\nx = torch.zeros(1024, 1024)", capsys)
    assert len(lines) == 3
    assert logger.history[-1].gpu_used_delta == 4 * MiB  # the 64 bytes before start missed
    run(ipython, "logger.start()", capsys)  # starting again changes nothing
    assert len(our_callbacks(ipython, logger)) == 2


def test_a_cell_that_stops_the_logger_is_not_reported(ipython, logger, capsys):
    logger.start()
    run(ipython, "a = 1", capsys)
    assert run(ipython, "x = torch.zeros(8)\nlogger.stop()", capsys) == []
    assert run(ipython, "b = 2", capsys) == []
    assert len(logger.history) == 1
    assert our_callbacks(ipython, logger) == []


def test_compact_mode_prints_one_line(ipython, logger, capsys):
    logger.compact = True
    logger.start()
    base = alive()
    lines = run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    assert len(lines) == 1
    used = (base + 4 * MiB) // MiB
    assert re.fullmatch(
        rf"Gen: -?\d+/\d+/\d+ MB \| CPU tensors: 4/0/{used} MB \| Time \d+\.\d{{3}}s"
        r" \| \(Consumed/Peaked/Used Total\)",
        lines[0],
    ), lines[0]


def test_reports_render_exactly() -> None:
    def record(**kw: object) -> CellRecord:
        fields = dict(
            execution_count=4,
            gen_used_delta=45 * MiB,
            gen_peaked=0,
            gen_used=170 * MiB + 5,
            gpu_used_delta=2467 * MiB,
            gpu_peaked=0,
            gpu_used=1465 * MiB,
            time_delta=0.0001,
            gpu_device="cuda:0",
        )
        return CellRecord(**{**fields, **kw})  # type: ignore[arg-type]

    full, compact = CellLogger(), CellLogger(compact=True)
    assert full.report(record()) == (
        "RAM: Consumed Peaked  Used Total  in 0.000s (In [4])\n"
        "Gen:       45      0    170 MB\n"
        "GPU:     2467      0   1465 MB"
    )
    assert compact.report(record()) == (
        "Gen: 45/0/170 MB | GPU: 2467/0/1465 MB | Time 0.000s | (Consumed/Peaked/Used Total)"
    )
    assert full.report(record(gpu_device="cpu", execution_count=None, gpu_used=12345 * MiB)) == (
        "RAM:         Consumed Peaked  Used Total  in 0.000s\n"
        "Gen:               45      0    170 MB\n"
        "CPU tensors:     2467      0  12345 MB"
    )
    with pytest.raises(Exception, match="no cell has been logged"):
        full.report()


# Results ---------------------------------------------------------------------------------


def test_history_to_dataframe(ipython, logger, capsys):
    logger.start()
    run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    run(ipython, "del x", capsys)
    frame = logger.to_dataframe()
    assert list(frame.columns) == list(CellRecord.__dataclass_fields__)
    assert list(frame["gpu_used_delta"]) == [4 * MiB, -4 * MiB]
    assert list(frame["execution_count"]) == [r.execution_count for r in logger.history]
    assert len(CellLogger().to_dataframe()) == 0


def test_plot_returns_a_figure(ipython, logger, capsys):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    logger.start()
    base = alive()
    run(ipython, "x = torch.zeros(1024, 1024)", capsys)
    run(ipython, "torch.zeros(2048, 1024).norm()", capsys)
    figure = logger.plot()
    assert isinstance(figure, Figure)
    _, bottom = figure.axes
    assert bottom.get_title() == "CPU tensors"
    used, peak = bottom.get_lines()
    assert list(used.get_ydata()) == [(base + 4 * MiB) / MiB, (base + 4 * MiB + 4) / MiB]
    assert list(peak.get_ydata()) == [(base + 4 * MiB) / MiB, (base + 12 * MiB + 4) / MiB]
    figure.savefig(__import__("io").BytesIO(), format="png")


# Registration ----------------------------------------------------------------------------


def test_callbacks_take_the_event_argument_for_ipython_8_and_9(ipython, logger):
    logger.start()
    pre = ipython.events.callbacks["pre_run_cell"]
    post = ipython.events.callbacks["post_run_cell"]
    # registered unadapted, so IPython calls them with info / result, as IPython 9 does
    assert logger._pre_run_cell in pre and logger._post_run_cell in post
    inspect.signature(logger._pre_run_cell).bind(object())
    inspect.signature(logger._post_run_cell).bind(object())


def test_stop_removes_every_callback_and_is_harmless_twice(ipython, logger, capsys):
    before = {event: list(cbs) for event, cbs in ipython.events.callbacks.items()}
    assert logger.start() is logger
    assert len(our_callbacks(ipython, logger)) == 2
    assert logger.stop() is logger
    assert logger.stop() is logger
    assert our_callbacks(ipython, logger) == []
    assert {event: list(cbs) for event, cbs in ipython.events.callbacks.items()} == before
    with logger:
        assert logger.running
        run(ipython, "a = 1", capsys)
    assert not logger.running
    assert our_callbacks(ipython, logger) == []


def test_no_shell_is_a_clear_error(monkeypatch):
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    with pytest.raises(Exception, match="no IPython shell is running"):
        IPyGPULogger().start()


def test_seed_name_and_defaults():
    assert IPyGPULogger is CellLogger
    logger = IPyGPULogger()
    assert (logger.compact, logger.gc_collect, logger.running) == (False, True, False)


@pytest.mark.parametrize(
    ("shell", "named"),
    [
        (3, "3 (int)"),
        ("ipython", "'ipython' (str)"),
        (InteractiveShell, "<class 'IPyth...ractiveShell'> (MetaHasTraits)"),  # not an instance
    ],
)
def test_a_shell_that_is_not_one_is_a_type_error_at_once(shell, named):
    with pytest.raises(TypeError) as raised:
        CellLogger(shell=shell)
    assert str(raised.value) == (
        f"shell must be an IPython shell (get_ipython()) or None, not {named}"
    )


def test_without_ipython_starting_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "IPython", None)  # import IPython fails
    logger = IPyGPULogger()
    with pytest.raises(ImportError) as raised:
        logger.start()
    assert str(raised.value) == (
        'CellLogger.start() without a shell needs IPython: pip install "torchmem[notebook]"'
    )
    assert not logger.running


def test_without_matplotlib_plot_says_which_extra_to_install(ipython, logger, capsys, monkeypatch):
    logger.start()
    run(ipython, "x = 1", capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(ImportError) as raised:
        logger.plot()
    assert str(raised.value) == 'plot() needs matplotlib: pip install "torchmem[plot]"'


def test_without_pandas_to_dataframe_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError) as raised:
        CellLogger().to_dataframe()
    assert str(raised.value) == "to_dataframe() needs pandas: pip install pandas"


def test_memlog_magic(ipython, logger, capsys):
    handle = register(ipython)
    assert register(ipython) is handle  # one logger per shell
    memlog = handle.logger
    assert run(ipython, "%memlog on", capsys)[0].startswith("RAM:")
    assert len(run(ipython, "x = torch.zeros(1024, 1024)", capsys)) == 3
    lines = run(ipython, "%memlog compact", capsys)
    assert len(lines) == 1 and lines[0].startswith("Gen: ")
    assert len(run(ipython, "y = 1", capsys)) == 1
    capsys.readouterr()
    ipython.run_line_magic("memlog", "")
    assert capsys.readouterr().out == "memlog: compact\n"
    assert run(ipython, "%memlog off", capsys) == []
    assert run(ipython, "y = 2", capsys) == []
    assert our_callbacks(ipython, memlog) == []
    ipython.run_line_magic("memlog", "")
    assert capsys.readouterr().out == "memlog: off\n"
    with pytest.raises(UsageError, match="expected on, off, compact or steps"):
        ipython.run_line_magic("memlog", "loud")


# The GPU row -----------------------------------------------------------------------------


def test_gpu_row_reads_the_allocator_and_the_whole_device(ipython, monkeypatch, capsys):
    gpu = StandInGpu(gpu_uuid(0), total=16 * GiB, used_elsewhere=1 * GiB)
    cuda, _ = install_gpus(monkeypatch, [gpu])
    ipython.user_ns["cuda"] = cuda
    logger = CellLogger(shell=ipython).start()
    try:
        lines = run(ipython, "cuda.alloc(0, 256 * 2**20)\ncuda.spike(0, 512 * 2**20)", capsys)
    finally:
        logger.stop()
    record = logger.history[-1]
    assert record.gpu_device == "cuda:0"
    assert record.gpu_used_delta == 256 * MiB
    assert record.gpu_peaked == 512 * MiB
    # NVML: other processes' 1 GiB plus all this process reserved (the spike stays cached)
    assert record.gpu_used == 1 * GiB + 768 * MiB
    assert lines[0].startswith("RAM: Consumed Peaked  Used Total  in ")
    assert lines[2] == "GPU:      256    512   1792 MB"
    assert cuda.count("reset_peak_memory_stats") >= 1


# Process RAM, in a fresh process ---------------------------------------------------------


def ram_rows() -> list[list[int]]:
    """In a new process: log three cells; return each one's RAM row in bytes."""
    from IPython.core.interactiveshell import InteractiveShell

    from torchmem import CellLogger

    shell = InteractiveShell.instance()
    # Warm up: a sum large enough to start the intra-op thread pool (its stacks are RAM).
    shell.run_cell("import torch\ntorch.ones(2**20).sum()")
    logger = CellLogger(shell=shell).start()
    for cell in (
        "x = torch.ones(16 * 2**20)",  # 64 MiB kept, every page touched
        "torch.ones(32 * 2**20).sum()",  # 128 MiB freed within the call
        "del x",
    ):
        shell.run_cell(cell, store_history=True)
    logger.stop()
    return [[r.gen_used_delta, r.gen_peaked, r.gen_used] for r in logger.history]


@pytest.mark.slow
def test_ram_row_is_exact_to_the_kernels_accounting():
    kept, spike, freed = call_in_fresh_process_without_gpu(ram_rows)
    assert abs(kept[0] - 64 * MiB) <= MiB
    assert kept[1] <= MiB
    assert abs(spike[0]) <= MiB
    assert abs(spike[1] - 128 * MiB) <= MiB
    assert abs(freed[0] + 64 * MiB) <= MiB
    assert freed[1] <= MiB
