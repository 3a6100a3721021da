"""The line profiler, exact to the byte on CPU tensors.

The CPU meter counts every CPU tensor of the process, so a line's peak (the highest use
while it ran, as ``active_bytes.all.peak`` is on a GPU) includes what was alive before
the test, earlier tests' leftovers among it: tests read that base with :func:`alive`.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
import torch

import torchmem.lines
import torchmem.lines.state
from standins import (
    CudaStandIn,
    GiB,
    KiB,
    MiB,
    StandInGpu,
    TracerStandIn,
    call_in_fresh_process_without_gpu,
    gpu_uuid,
)
from torchmem import LineProfiler, meter, profile, profile_every, set_target_gpu, valid_columns
from torchmem.errors import TorchmemError
from torchmem.lines.state import LineTally
from torchmem.meters import CpuAllocatorMeter
from torchmem.meters.cpu import COUNTS, counters_of
from torchmem.units import readable_size

PEAK, DELTA = "active_bytes.all.peak", "active_bytes.all.delta"


@pytest.fixture(autouse=True)
def _global_on_cpu(isolated_meters: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh global profiler on CPU tensors, whatever the machine has (and a fresh meter
    registry)."""
    monkeypatch.setattr(torchmem.lines.memlab, "_global", LineProfiler(device="cpu"))
    yield
    atexit.unregister(torchmem.lines.memlab._print_at_exit)  # @profile's reports at exit


def alive() -> int:
    """Bytes of CPU tensors alive in the process now, as the profiler's meter counts."""
    gc.collect()
    return meter("cpu").used()


def cell(nbytes: int) -> str:
    """`nbytes` as a byte column of the text report shows it."""
    return f"{readable_size(nbytes):>12}"


def stats(prof: LineProfiler, func, offset: int) -> tuple[int, dict[str, int]]:
    """(hits, stats) of the line `offset` lines below `func`'s ``def``."""
    (record,) = prof.records(func)
    number = func.__code__.co_firstlineno + offset
    (line,) = [line for line in record.lines if line.lineno == number]
    return line.hits, line.stats


# Exact bytes per line -----------------------------------------------------------------


def allocate():
    a = torch.zeros(1024, 1024)
    b = torch.zeros(2048, 1024).exp()
    del b
    return a


def test_text_report_is_exact():
    base = alive()
    with LineProfiler(allocate, device="cpu") as prof:
        allocate()
    n = allocate.__code__.co_firstlineno
    expected = f"""\
## allocate

active_bytes active_bytes hits line code
         all          all
        peak        delta
{"":31}{n:>4} def allocate():
{cell(base + 4 * MiB)}        4.00M    1 {n + 1:>4}     a = torch.zeros(1024, 1024)
{cell(base + 20 * MiB)}        8.00M    1 {n + 2:>4}     b = torch.zeros(2048, 1024).exp()
{cell(base + 12 * MiB)}       -8.00M    1 {n + 3:>4}     del b
{cell(base + 4 * MiB)}        0.00B    1 {n + 4:>4}     return a
"""
    assert str(prof.display()) == expected
    assert repr(prof.display()) == expected


def temporary():
    norm = (torch.zeros(1024, 1024) + 1).norm()
    return norm


# The scalar 1 of `+ 1`, as an int64 wrapper and its float32 copy, alive while the sum is
# allocated. (The norm allocates no scratch; a large sum's per-thread partial sums would.)
SCALAR = 8 + 4


def test_a_temporary_freed_on_its_line_shows_in_the_peak_not_the_change():
    base = alive()
    with LineProfiler(temporary, device="cpu") as prof:
        temporary()
    hits, line = stats(prof, temporary, 1)
    assert hits == 1
    assert line[PEAK] == base + 8 * MiB + SCALAR  # zeros and zeros + 1, both alive at once
    assert line[DELTA] == 4  # only the float32 norm is kept
    assert line["active_bytes.all.allocated"] == 8 * MiB + SCALAR + 4
    assert line["active_bytes.all.freed"] == 8 * MiB + SCALAR
    assert line["active_bytes.all.current"] == base + 4
    # the same count, CUDA's other name
    assert line["allocated_bytes.all.peak"] == base + 8 * MiB + SCALAR


def test_print_stats_writes_the_text_with_the_columns_asked_for(capsys):
    with LineProfiler(temporary, device="cpu") as prof:
        temporary()
    prof.print_stats(columns=["active_bytes.all.allocated", "active_bytes.all.freed"])
    n = temporary.__code__.co_firstlineno
    assert (
        capsys.readouterr().out
        == f"""\
## temporary

active_bytes active_bytes hits line code
         all          all
   allocated        freed
{"":31}{n:>4} def temporary():
       8.00M        8.00M    1 {n + 1:>4}     norm = (torch.zeros(1024, 1024) + 1).norm()
       0.00B        0.00B    1 {n + 2:>4}     return norm
"""
    )


def loop():
    kept = []
    for _ in range(3):
        kept.append(torch.zeros(256, 1024))
    return kept


def test_a_line_run_many_times_shows_its_highest_peak_and_summed_change():
    base = alive()
    with LineProfiler(loop, device="cpu") as prof:
        loop()
    assert stats(prof, loop, 1)[0] == 1
    assert stats(prof, loop, 1)[1][DELTA] == 0
    hits, _ = stats(prof, loop, 2)
    assert hits == 4  # three turns and the exit
    hits, body = stats(prof, loop, 3)
    assert hits == 3
    assert body[PEAK] == base + 3 * MiB
    assert body[DELTA] == 3 * MiB
    assert body["active_bytes.all.current"] == base + 3 * MiB


# The counting CPU allocator's lines, read without dicts ----------------------------------


def busy():
    kept = allocate()
    for _ in range(3):
        kept = kept + 1
        nothing = len(kept)  # allocates and frees nothing: no lap
    del kept
    return nothing


def test_on_the_counting_allocator_lines_record_what_the_dicts_of_any_meter_give(monkeypatch):
    if not isinstance(meter("cpu"), CpuAllocatorMeter):
        pytest.skip("the counting allocator is not available here")

    def profiled() -> list[list[tuple[int, int, list[tuple[str, int]]]]]:
        with LineProfiler(busy, loop, device="cpu") as prof:
            busy()
            loop()
            with meter("cpu").window():  # another window, which each lap folds into
                busy()
        return [
            [(x.hits, x.lineno, list(x.stats.items())) for x in f.lines] for f in prof.records()
        ]

    base = alive()
    fast = profiled()
    assert alive() == base
    # Every meter but the counting allocator's is read through its dicts.
    monkeypatch.setattr(torchmem.lines.state, "CpuAllocatorMeter", type(None))
    assert profiled() == fast
    number = busy.__code__.co_firstlineno + 4  # nothing = len(kept)
    ((hits, _, line),) = [row for row in fast[0] if row[1] == number]
    assert hits == 6
    assert dict(line)["allocated_bytes.all.peak"] == base + 4 * MiB  # kept alone
    assert {k: v for k, v in line if k.endswith((".delta", ".allocated", ".freed"))} == {
        "allocated_bytes.all.delta": 0,
        "allocated_bytes.all.allocated": 0,
        "allocated_bytes.all.freed": 0,
        "allocation.all.allocated": 0,
        "allocation.all.freed": 0,
        "active_bytes.all.delta": 0,
        "active_bytes.all.allocated": 0,
        "active_bytes.all.freed": 0,
    }


def test_a_line_adds_the_counting_allocators_counts_as_it_adds_their_dicts():
    rng = random.Random(0)
    fast, slow = LineTally(), LineTally()
    start = [10**6, 10**6, 5 * 10**6, 4 * 10**6, 100, 90, 0]
    for _ in range(200):
        counts = list(start)
        if rng.random() < 0.5:  # allocations and frees; else nothing moved (the same list)
            made, freed = rng.randrange(10**5), rng.randrange(10**5)
            counts[0] += made - freed
            counts[2:6] = [start[2] + made, start[3] + freed, start[4] + 1, start[5] + 1]
            counts[1] = counts[0]
        else:
            counts = start
        peak = max(start[0], counts[0]) + rng.randrange(10**4)
        fast.add_counts(peak, counts, start)
        slow.add({COUNTS[1]: peak}, counters_of(start), counters_of(counts))
        assert (fast.hits, list(fast.values.items())) == (slow.hits, list(slow.values.items()))
        start = counts


def test_lap_counts_laps_a_window_as_lap_with_counters_does():
    cpu = meter("cpu")
    if not isinstance(cpu, CpuAllocatorMeter):
        pytest.skip("the counting allocator is not available here")
    outer, a, b = cpu.window(), cpu.window(), cpu.window()
    base = alive()
    torch.zeros(1024, 1024)  # 4 MiB, freed at once
    peaks, counters = a.lap_with_counters()
    peak, counts = cpu.lap_counts(b)
    assert peaks == {"allocated_bytes.all": base + 4 * MiB} and peak == base + 4 * MiB
    assert counters_of(counts) == counters == cpu.counters()
    assert counts[1] == counts[0] == base == b.start  # the peak counter starts over
    torch.zeros(2048, 1024)
    peak, counts = cpu.lap_counts(b)
    assert peak == base + 8 * MiB and counts[1] == base
    assert a.lap() == {"allocated_bytes.all": base + 8 * MiB}  # folded in before the reset
    assert cpu.lap_counts(b)[0] == base  # nothing since
    a.close()
    b.close()
    assert outer.peak() == base + 8 * MiB
    outer.close()
    with pytest.raises(TorchmemError, match="closed window"):
        cpu.lap_counts(b)


def test_a_lap_on_counts_read_before_another_allocation_keeps_the_peak_above_it():
    cpu = meter("cpu")
    if not isinstance(cpu, CpuAllocatorMeter):
        pytest.skip("the counting allocator is not available here")
    window = cpu.window()
    base = alive()
    torch.zeros(1024)  # the peak above the bytes in use: the lap restarts it
    read = cpu.counts()  # what the line profiler read ...
    kept = torch.zeros(1024, 1024)  # ... before another thread allocated this
    cpu.lap_counts(window, read)
    assert cpu.counts()[:2] == [base + 4 * MiB, base + 4 * MiB]  # not below the bytes in use
    del kept
    window.close()


def inner():
    t = torch.zeros(1024, 1024)
    return t.norm()


def outer():
    keep = torch.zeros(512, 1024)
    inner()
    unwatched()
    return keep


def unwatched():
    torch.zeros(4096, 1024)


def test_nested_calls_charge_each_line_and_the_calling_line_sees_their_peak():
    base = alive()
    with LineProfiler(outer, inner, device="cpu") as prof:
        outer()
    assert stats(prof, inner, 1)[0] == 1
    assert stats(prof, inner, 1)[1][PEAK] == base + 2 * MiB + 4 * MiB
    assert stats(prof, inner, 1)[1][DELTA] == 4 * MiB
    calling = stats(prof, outer, 2)[1]
    assert calling[PEAK] == base + 6 * MiB + 4  # t and its norm, before inner returned
    assert calling[DELTA] == 0  # t died with inner's frame, the 4-byte norm unused
    assert calling["active_bytes.all.allocated"] == 4 * MiB + 4
    # not watched, still seen
    assert stats(prof, outer, 3)[1][PEAK] == base + 2 * MiB + 16 * MiB


def recurse(n):
    t = torch.zeros(n, 1024)
    if n > 1:
        recurse(n - 1)
    return t.shape


def test_recursion():
    base = alive()
    with LineProfiler(recurse, device="cpu") as prof:
        recurse(3)
    hits, line = stats(prof, recurse, 1)
    assert hits == 3
    assert line[DELTA] == (3 + 2 + 1) * 4096
    assert line[PEAK] == base + (3 + 2 + 1) * 4096
    hits, call = stats(prof, recurse, 3)
    assert hits == 2
    assert call[PEAK] == base + (3 + 2 + 1) * 4096
    assert call[DELTA] == 0


def produce():
    for _ in range(2):
        yield torch.zeros(1024, 1024)


async def compute():
    a = torch.zeros(1024, 1024)
    await asyncio.sleep(0)
    b = torch.zeros(1024, 1024)
    return a, b


class Net(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return y.sum()


def test_generators_coroutines_and_methods():
    net = Net()
    with LineProfiler(produce, compute, net.forward, device="cpu") as prof:
        items = list(produce())
        asyncio.run(compute())
        net(torch.ones(1024))
    hits, yielding = stats(prof, produce, 2)
    assert hits == 2
    assert yielding["active_bytes.all.allocated"] == 8 * MiB
    assert stats(prof, compute, 1)[1][DELTA] == 4 * MiB
    assert stats(prof, compute, 3)[1][DELTA] == 4 * MiB
    (record,) = prof.records(Net.forward)
    assert record.qualname == "Net.forward"
    assert stats(prof, Net.forward, 1)[1][DELTA] == 4096
    assert len(items) == 2


def test_threads_started_while_profiling_are_profiled():
    base = alive()
    with LineProfiler(allocate, device="cpu") as prof:
        thread = threading.Thread(target=allocate)
        thread.start()
        thread.join()
    assert stats(prof, allocate, 1)[0] == 1
    assert stats(prof, allocate, 2)[1][PEAK] == base + 20 * MiB
    assert stats(prof, allocate, 2)[1][DELTA] == 8 * MiB


def test_a_function_that_never_ran_says_no_data_collected():
    with LineProfiler(allocate, temporary, device="cpu") as prof:
        temporary()
    text = str(prof.display())
    assert text.startswith("## allocate\n\nNo data collected\n\n\n## temporary\n")
    assert str(LineProfiler(device="cpu").display()) == "No data collected\n"
    assert LineProfiler(device="cpu").display()._repr_html_() == "<p>No data collected</p>"


def test_html_report_is_exact():
    base = alive()
    with LineProfiler(temporary, device="cpu") as prof:
        temporary()
    n = temporary.__code__.co_firstlineno
    code = ' style="text-align: left; white-space: pre; font-family: monospace"'
    bar = "background: linear-gradient(90deg, {} {}%, transparent {}%)"
    top, last = base + 8 * MiB + SCALAR, base + 4  # the peak column's bars scale to its top
    width = f"{99 * last / top:.1f}"
    expected = (
        '<h3><span style="font-family: monospace">temporary</span></h3><div>'
        '<table style="border-collapse: collapse">'
        '<thead><tr style="text-align: left">'
        "<th>active_bytes<br>all<br>peak</th><th>active_bytes<br>all<br>delta</th>"
        "<th>hits</th><th>line</th><th>code</th></tr></thead><tbody>"
        f"<tr><td></td><td></td><td></td><td>{n}</td><td{code}>def temporary():</td></tr>"
        f'<tr><td style="{bar.format("#4878d0", "99.0", "99.0")}">{readable_size(top)}</td>'
        f'<td style="{bar.format("#ee854a", "99.0", "99.0")}">4.00B</td>'
        f"<td>1</td><td>{n + 1}</td>"
        f"<td{code}>    norm = (torch.zeros(1024, 1024) + 1).norm()</td></tr>"
        f'<tr><td style="{bar.format("#4878d0", width, width)}">{readable_size(last)}</td>'
        f"<td>0.00B</td><td>1</td><td>{n + 2}</td><td{code}>    return norm</td></tr>"
        "</tbody></table></div>"
    )
    assert prof.display()._repr_html_() == expected


def test_html_escapes_code_and_draws_no_bar_for_an_all_zero_column(recwarn):
    def tags():
        text = "<b>&</b>"
        return text

    with LineProfiler(tags, device="cpu") as prof:
        tags()
    # the delta alone: the peak column holds the tensors alive before (earlier tests')
    html = prof.display(columns=["active_bytes.all.delta"])._repr_html_()
    assert "text = &quot;&lt;b&gt;&amp;&lt;/b&gt;&quot;" in html
    assert "gradient" not in html
    assert not recwarn.list


def test_dataframe_has_a_row_per_source_line():
    pd = pytest.importorskip("pandas")
    base = alive()
    with LineProfiler(temporary, device="cpu") as prof:
        temporary()
    frame = prof.to_dataframe()
    n = temporary.__code__.co_firstlineno
    assert list(frame.columns[:5]) == ["function", "filename", "line", "code", "hits"]
    assert list(frame["line"]) == [n, n + 1, n + 2]
    assert list(frame["hits"]) == [0, 1, 1]
    assert pd.isna(frame[PEAK][0])
    assert frame[PEAK][1] == base + 8 * MiB + SCALAR
    assert frame[DELTA][1] == 4


# Columns ------------------------------------------------------------------------------


def test_a_bad_column_raises_listing_the_valid_ones():
    prof = LineProfiler(device="cpu")
    with pytest.raises(ValueError, match=r"unknown column\(s\) 'active_bytes.all.peek'") as info:
        prof.display(columns=["active_bytes.all.peek"])
    assert "valid columns: active_bytes.all.peak, active_bytes.all.current" in str(info.value)
    with pytest.raises(ValueError, match=r"'reserved_bytes\.all\.peak' for device 'cpu'"):
        prof.display(columns=["active_bytes.all.peak", "reserved_bytes.all.peak"])
    with pytest.raises(ValueError, match="unknown column"):
        profile(columns=["bogus"])
    with pytest.raises(ValueError, match="unknown column"):
        profile_every(2, columns="bogus")


def test_valid_columns_per_device():
    assert valid_columns("cpu")[:5] == (
        "active_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.allocated",
        "active_bytes.all.freed",
        "active_bytes.all.delta",
    )
    assert len(valid_columns("cpu")) == 10
    assert valid_columns("ram") == ("rss.peak", "rss.current", "rss.delta")
    assert "reserved_bytes.all.peak" in valid_columns("cuda:0")
    assert "allocation.small_pool.freed" in valid_columns("cuda:0")


# Never in the user's way --------------------------------------------------------------


def failing():
    t = torch.zeros(1024, 1024)
    raise ValueError(t.shape)


def test_exceptions_pass_through_and_every_hook_is_removed():
    before = sys.gettrace(), threading.gettrace()
    prof = LineProfiler(failing, device="cpu")
    with pytest.raises(ValueError) as info, prof:
        failing()
    assert info.value.args == (torch.Size([1024, 1024]),)
    assert (sys.gettrace(), threading.gettrace()) == before
    assert not prof.enabled
    assert stats(prof, failing, 1)[1][DELTA] == 4 * MiB
    assert stats(prof, failing, 2)[0] == 1


def interrupted():
    torch.zeros(16)
    raise KeyboardInterrupt


def test_keyboard_interrupt_passes_through_and_the_hooks_go():
    before = sys.gettrace()
    with pytest.raises(KeyboardInterrupt), LineProfiler(interrupted, device="cpu"):
        interrupted()
    assert sys.gettrace() is before


def run_both():
    allocate()
    temporary()


def test_another_tracer_keeps_every_event_and_is_restored():
    plain = TracerStandIn(allocate, temporary)
    previous = sys.gettrace()
    sys.settrace(plain)
    try:
        run_both()
    finally:
        sys.settrace(previous)
    profiled = TracerStandIn(allocate, temporary)
    base = alive()
    sys.settrace(profiled)
    try:
        with LineProfiler(allocate, device="cpu") as prof:
            run_both()
        assert sys.gettrace() is profiled
    finally:
        sys.settrace(previous)
    assert profiled.events == plain.events
    assert len(plain.events) == 10
    assert stats(prof, allocate, 2)[1][PEAK] == base + 20 * MiB


def test_unwatched_frames_are_not_traced():
    seen = []

    def probe():
        seen.append(sys._getframe().f_trace)

    def watched():
        probe()

    watched()  # what the tracer already there, if any (coverage.py), makes of it
    with LineProfiler(watched, device="cpu") as prof:
        watched()
    assert seen == [seen[0], seen[0]]
    assert seen[0] is None or seen[0] is sys.gettrace()
    assert prof.records(watched)[0].ran


needs_monitoring = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="sys.monitoring is new in Python 3.12"
)


def torchmem_tools():
    return [t for t in range(6) if sys.monitoring.get_tool(t) == "torchmem"]


@needs_monitoring
def test_from_python_3_12_events_come_from_sys_monitoring():
    base = alive()
    before = sys.gettrace()
    with LineProfiler(allocate, device="cpu") as prof:
        assert sys.gettrace() is before
        assert len(torchmem_tools()) == 1
        thread = threading.Thread(target=allocate)  # every thread, started when it may
        thread.start()
        thread.join()
    assert torchmem_tools() == []
    assert stats(prof, allocate, 2)[1][PEAK] == base + 20 * MiB
    assert stats(prof, allocate, 2)[0] == 1


@needs_monitoring
def test_without_a_free_monitoring_tool_id_settrace_is_used():
    taken = [t for t in (3, 4) if sys.monitoring.get_tool(t) is None]
    for tool in taken:
        sys.monitoring.use_tool_id(tool, "someone else")
    base = alive()
    try:
        with LineProfiler(allocate, device="cpu") as prof:
            assert sys.gettrace().__qualname__ == "_hook.<locals>.hook"
            allocate()
    finally:
        for tool in taken:
            sys.monitoring.free_tool_id(tool)
    assert stats(prof, allocate, 2)[1][PEAK] == base + 20 * MiB


def test_leaving_one_profiler_leaves_another_on():
    first = LineProfiler(allocate, device="cpu")
    second = LineProfiler(temporary, device="cpu")
    base = alive()
    with first:
        with second:
            temporary()
        allocate()
    assert stats(first, allocate, 2)[1][PEAK] == base + 20 * MiB
    assert stats(second, temporary, 1)[1][PEAK] == base + 8 * MiB + SCALAR
    assert not first.records(temporary)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="cannot profile <built-in function len>"):
        LineProfiler(len)
    for bad in (-1, "x", 1.5, True):
        with pytest.raises(ValueError, match=f"invalid target GPU {bad!r}"):
            LineProfiler(target_gpu=bad)
        with pytest.raises(ValueError, match=f"invalid target GPU {bad!r}"):
            set_target_gpu(bad)
    with pytest.raises(ValueError, match="invalid device 'cpx'"):
        LineProfiler(device="cpx")
    for bad in (0, -2, 1.0, True):
        with pytest.raises(ValueError, match=f"invalid output_interval {bad!r}"):
            profile_every(bad)


# Where the source comes from ------------------------------------------------------------


def test_a_function_without_source_lists_the_lines_that_ran():
    namespace = {"torch": torch}
    exec(
        compile("def nosource():\n    x = torch.zeros(256)\n    return x\n", "<stdin>", "exec"),
        namespace,
    )
    nosource = namespace["nosource"]
    base = alive()
    with LineProfiler(nosource, device="cpu") as prof:
        nosource()
    assert str(prof.display()) == textwrap.dedent(f"""\
        ## nosource

        active_bytes active_bytes hits line code
                 all          all
                peak        delta
        {cell(base + KiB)}        1.00K    1    2
        {cell(base + KiB)}        0.00B    1    3
        """)


def test_a_function_defined_in_an_ipython_cell():
    InteractiveShell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("import torch\nfrom torchmem import LineProfiler", store_history=True)
        shell.run_cell(
            "def cell_function():\n    x = torch.zeros(1024, 1024)\n    return x\n",
            store_history=True,
        )
        base = alive()
        result = shell.run_cell(
            "with LineProfiler(cell_function, device='cpu') as prof:\n    cell_function()\n"
            "str(prof.display())",
            store_history=True,
        )
        result.raise_error()
    finally:
        InteractiveShell.clear_instance()
    lines = result.result.splitlines()
    assert lines[:5] == [
        "## cell_function",
        "",
        "active_bytes active_bytes hits line code",
        "         all          all",
        "        peak        delta",
    ]
    assert lines[5:] == [
        f"{'':34}1 def cell_function():",
        f"{cell(base + 4 * MiB)}        4.00M    1    2     x = torch.zeros(1024, 1024)",
        f"{cell(base + 4 * MiB)}        0.00B    1    3     return x",
    ]


# Process memory -------------------------------------------------------------------------


def ram_lines():
    kept = torch.ones(64 * MiB, dtype=torch.uint8)  # touched, so resident
    spike = torch.ones(128 * MiB, dtype=torch.uint8).sum()
    return kept, spike


def profile_ram_lines() -> list[dict[str, int]]:
    ram_lines()  # once first: torch's first operators load code and warm its allocator
    with LineProfiler(ram_lines, device="ram") as prof:
        ram_lines()
    return [line.stats for line in prof.records()[0].lines[1:3]]


@pytest.mark.slow
def test_ram_columns_profile_the_process_resident_memory():
    # In a fresh process: in this one, threads earlier tests started move the RSS.
    kept, spike = call_in_fresh_process_without_gpu(profile_ram_lines)
    slack = MiB  # the kernel counts resident pages per CPU, in batches
    assert abs(kept["rss.delta"] - 64 * MiB) < slack
    assert abs(spike["rss.delta"]) < slack
    assert spike["rss.peak"] - kept["rss.current"] > 128 * MiB - slack


# The decorators -----------------------------------------------------------------------


def test_profile_every_prints_every_nth_call_and_keeps_adding_up(capsys):
    @profile_every(2)
    def twice():
        return torch.zeros(256, 1024)

    twice()
    assert capsys.readouterr().out == ""
    twice()
    first = capsys.readouterr().out
    assert first.startswith("## test_profile_every_prints_every_nth_call_and_keeps_adding_up.")
    assert "   2.00M    2 " in first  # summed change over two calls, two hits
    twice()
    twice()
    assert "   4.00M    4 " in capsys.readouterr().out


def test_profile_every_disabled_runs_the_function_itself():
    def f():
        return 1

    assert profile_every(enable=False)(f) is f


def test_profile_wraps_a_generator_only_while_it_runs():
    @profile
    def numbers():
        yield torch.zeros(1024)
        yield torch.zeros(2048)

    prof = torchmem.lines.global_line_profiler()
    gen = numbers()
    assert next(gen).numel() == 1024
    assert not prof.enabled  # off between steps
    assert next(gen).numel() == 2048
    with pytest.raises(StopIteration):
        next(gen)
    (record,) = prof.records(numbers)
    assert [line.stats.get("active_bytes.all.allocated") for line in record.lines[2:]] == [
        4096,
        8192,
    ]


@pytest.mark.slow
def test_profile_at_exit_in_a_real_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""\
        import torch
        from torchmem import LineProfiler, profile
        import torchmem.lines.memlab
        torchmem.lines.memlab._global = LineProfiler(device="cpu")

        @profile
        def step():
            x = torch.zeros(1024, 1024)
            return x.sum()

        @profile(columns=["active_bytes.all.allocated"])
        def never():
            return 1

        step()
        step()
        """)
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert run.stdout == textwrap.dedent("""\
        ## never

        No data collected
        ## step

        active_bytes active_bytes hits line code
                 all          all
                peak        delta
                                          6 @profile
                                          7 def step():
               4.00M        8.00M    2    8     x = torch.zeros(1024, 1024)
               4.00M        8.00B    2    9     return x.sum()
        """)


# A GPU, through the stand-in ------------------------------------------------------------


def test_on_cuda_the_default_columns_come_from_the_allocator(monkeypatch):
    gpus = [StandInGpu(gpu_uuid(0), total=16 * GiB), StandInGpu(gpu_uuid(1), total=16 * GiB)]
    cuda = CudaStandIn(gpus).install(monkeypatch)

    def on_gpu_standin():
        cuda.alloc(1, 4 * MiB)
        cuda.free(1, 4 * MiB)
        cuda.spike(0, 64 * MiB)  # another GPU
        cuda.alloc(1, 2 * MiB)

    with LineProfiler(on_gpu_standin, target_gpu=1) as prof:
        on_gpu_standin()
    assert prof.meter.device == "cuda:1"
    n = on_gpu_standin.__code__.co_firstlineno
    text = str(prof.display())
    assert text.splitlines()[2:5] == [
        "active_bytes reserved_bytes hits line code",
        "         all            all",
        "        peak           peak",
    ]
    assert f"       4.00M          4.00M    1 {n + 1:>4}         cuda.alloc(1, 4 * MiB)" in text
    assert f"       2.00M          4.00M    1 {n + 4:>4}         cuda.alloc(1, 2 * MiB)" in text
    _, line = stats(prof, on_gpu_standin, 2)
    assert line["active_bytes.all.freed"] == 4 * MiB
    assert line["reserved_bytes.all.delta"] == 0  # the freed block stays cached
    assert line["allocation.all.delta"] == -1
    assert cuda.count("reset_peak_memory_stats") > 0
    assert set(cuda.devices("reset_peak_memory_stats")) == {1}
    with pytest.raises(ValueError, match=r"invalid target GPU 2: .*2 CUDA device"):
        set_target_gpu(2)
