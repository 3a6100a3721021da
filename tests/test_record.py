"""``torchmem.record()``: exact bytes per category, site, module and timeline on CPU tensors.

CPU tensors are counted by the counting allocator (the fallback meter has no event log;
the last test checks what it reports instead). Garbage of earlier tests is collected
before each recording, so nothing dies inside it by chance.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import weakref
from unittest.mock import ANY

import pytest
import torch
from torch import nn

import torchmem
from standins import KiB, MiB
from torchmem.meters import meter
from torchmem.records.frames import BACKWARD, shown
from torchmem.records.run import CATEGORIES, DeviceRun, Held, ModulePeak, Phase, RunRecord, Site

pytestmark = pytest.mark.counting
HERE = shown(__file__)
"""This file as sites name it."""


def two_linears() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def record(**kwargs):
    gc.collect()
    return torchmem.record("cpu", **kwargs)


def test_categories_at_the_end_are_exact() -> None:
    with record() as rec:
        model, optimizer = two_linears()
        model(torch.randn(64, 1024)).square().mean().backward()
        optimizer.step()
    cpu = rec.report().devices["cpu"]
    end = cpu.categories_at_end
    assert end is not None
    # Modules alive from earlier tests, which this code neither ran nor holds, are not looked
    # for: their parameters count as other.
    assert (end["parameters"], end["gradients"], end["optimizer_state"]) == (8 * MiB,) * 3
    assert sum(end.values()) == cpu.end_bytes
    assert list(end) == list(CATEGORIES)


def test_a_model_built_before_the_recording_is_named_and_categorised() -> None:
    model, optimizer = two_linears()
    model(torch.randn(64, 1024)).square().mean().backward()
    optimizer.step()
    with record() as rec:
        big = torch.zeros(MiB)  # 4 MiB, the peak
        del big
    cpu = rec.report().devices["cpu"]
    peak = cpu.categories_at_peak
    assert peak is not None
    parameters = peak["parameters"]
    assert (parameters, peak["gradients"], peak["optimizer_state"]) == (8 * MiB,) * 3
    assert cpu.peak_bytes - cpu.start_bytes == 4 * MiB
    names = {h.name for h in cpu.largest_at_peak}
    assert {"0.weight", "1.weight.grad", "SGD.1.weight.momentum_buffer"} <= names


def allocate_256_mib() -> torch.Tensor:
    return torch.zeros(64, 1024, 1024)  # the line the report must name


def test_the_line_that_allocated_the_peak_is_the_top_site() -> None:
    with record() as rec:
        kept = allocate_256_mib()
        del kept
    cpu = rec.report().devices["cpu"]
    top = cpu.sites_at_peak[0]
    line = allocate_256_mib.__code__.co_firstlineno + 1
    assert (top.file, top.line, top.function, top.bytes) == (
        HERE,
        line,
        "allocate_256_mib",
        256 * MiB,
    )
    assert top.source == "return torch.zeros(64, 1024, 1024)  # the line the report must name"
    # Pseudo files have no line to read.
    assert {s.source for s in cpu.sites_at_peak if not s.line} <= {None}
    assert cpu.largest_at_peak[0].bytes == 256 * MiB
    assert cpu.largest_at_peak[0].site == f"{HERE}:{line}"


def test_a_tensor_alive_at_the_end_is_named_after_its_variable_with_its_shape() -> None:
    model = torch.nn.Linear(1024, 512)
    with record() as rec:
        survivor = torch.zeros(MiB)
        out = model(torch.randn(8, 64, 1024))  # a view of mm's output, saved by nothing
        part = torch.zeros(3, MiB // 2)[1]  # a view of part of its storage
    held = {h.name: h for h in rec.report().devices["cpu"].largest_at_peak}
    assert held["survivor"] == Held("survivor", 4 * MiB, "other", (MiB,), "torch.float32", ANY)
    assert held["out"] == Held("out", 1 * MiB, "other", (8, 64, 512), "torch.float32", ANY)
    assert held["part"] == Held("part", 6 * MiB, "other", None, None, ANY)
    del survivor, out, part


def test_backward_allocations_are_named_backward_with_the_line_in_their_stack() -> None:
    weight = torch.randn(1024, 1024, requires_grad=True)
    x = torch.randn(256, 1024)
    with record() as rec:
        loss = (x @ weight).sum()
        loss.backward()  # autograd's engine allocates, no module around it
        peak_line = sys._getframe().f_lineno - 1
    sites = rec.report().devices["cpu"].sites_at_peak
    (engine,) = [s for s in sites if s.file == BACKWARD]
    assert engine.bytes == 5 * MiB  # weight's gradient (4 MiB), the product's (1 MiB)
    assert engine.source is None
    name = test_backward_allocations_are_named_backward_with_the_line_in_their_stack.__name__
    assert (HERE, peak_line, name) in engine.stack
    assert (peak_line, 4) in {(s.line, s.bytes) for s in sites}  # backward()'s ones_like(loss)


def test_activations_are_the_tensors_autograd_saved() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(1024, 1024, bias=False)
    with record() as rec:
        x = torch.randn(1024, 1024)  # saved by the linear for its weight's gradient
        out = linear(x)  # 4 MiB, not saved
        big = torch.zeros(2 * MiB)  # 8 MiB: the peak
        del big
    cpu = rec.report().devices["cpu"]
    earlier = cpu.start_bytes - 4 * MiB  # alive before, besides the weight: earlier tests'
    assert cpu.categories_at_peak == {
        "parameters": 4 * MiB,
        "gradients": 0,
        "optimizer_state": 0,
        "buffers": 0,
        "communication": 0,
        "activations": 4 * MiB,
        "other": earlier + 12 * MiB,
    }
    del out


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1024, 256)
        self.norm = nn.BatchNorm1d(256)
        self.register_buffer("inv_freq", torch.ones(256), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.inv_freq


def test_buffers_are_a_category_of_their_own() -> None:
    """BatchNorm's running statistics counted as activations (batch_norm saves them for
    backward), its step counter and a rotary embedding's ``inv_freq`` as other."""
    torch.manual_seed(0)
    model = Rotary()
    with record() as rec:
        model(torch.randn(64, 1024)).sum().backward()
    cpu = rec.report().devices["cpu"]
    assert cpu.categories_at_peak is not None and cpu.categories_at_end is not None
    # running mean and variance and inv_freq (3 x 256 float32), num_batches_tracked (int64)
    assert cpu.categories_at_peak["buffers"] == cpu.categories_at_end["buffers"] == 3 * 1024 + 8


def test_an_estimate_counts_buffers_as_buffers() -> None:
    def step(batch: int) -> None:
        model = Rotary()  # alive until the step returns, as its buffers
        model(torch.randn(batch, 1024)).sum().backward()

    estimate = torchmem.estimate(step, 64, device="cpu")
    assert estimate.categories["buffers"] == 3 * 1024 + 8


def test_module_forward_peaks_are_exact() -> None:
    model, _ = two_linears()
    x = torch.randn(64, 1024)  # 256 KiB
    with record() as rec:
        model(x).sum().backward()
    report = rec.report()
    modules = {m.name: m for m in report.modules}
    before = report.devices["cpu"].start_bytes  # parameters and x, and earlier tests' memory
    assert [(m.name, m.type) for m in report.modules] == [
        ("", "Sequential"),
        ("0", "Linear"),
        ("1", "Linear"),
    ]
    assert modules["0"].forward_peak_bytes == before + 256 * KiB
    assert modules["1"].forward_peak_bytes == before + 512 * KiB
    assert modules[""].forward_peak_bytes == before + 512 * KiB
    for module in report.modules:
        assert module.calls == 1
        assert module.backward_peak_bytes is not None
        assert module.backward_peak_bytes >= before + 4 * MiB  # a weight's gradient


def test_the_timeline_holds_the_peak() -> None:
    with record() as rec:
        allocate_256_mib()
    cpu = rec.report().devices["cpu"]
    assert max(bytes_ for _, bytes_ in cpu.timeline) == cpu.peak_bytes
    times = [t for t, _ in cpu.timeline]
    assert times == sorted(times)
    assert 0 <= cpu.peak_time <= times[-1]


def test_allocations_in_another_thread_have_their_own_line() -> None:
    def work() -> None:
        kept.append(torch.zeros(MiB))

    kept: list[torch.Tensor] = []
    with record() as rec:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    sites = rec.report().devices["cpu"].sites_at_peak
    line = work.__code__.co_firstlineno + 1
    function = getattr(work.__code__, "co_qualname", "work")  # Python 3.10: the bare name
    assert (line, function, 4 * MiB) in {(s.line, s.function, s.bytes) for s in sites}


def test_without_sites_there_are_none() -> None:
    with record(sites=False) as rec:
        allocate_256_mib()
    cpu = rec.report().devices["cpu"]
    assert cpu.sites_at_peak == ()
    assert cpu.peak_bytes - cpu.start_bytes == 256 * MiB


def global_hooks() -> tuple[int, ...]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (
        len(module._global_forward_pre_hooks),
        len(module._global_forward_hooks),
        len(optimizer._global_optimizer_pre_hooks),
        len(optimizer._global_optimizer_post_hooks),
    )


def test_recordings_nest_and_overlap_each_seeing_its_own_span() -> None:
    """``torchmem.record()`` inside ``torchmem run``, or inside a test the pytest plugin
    records: one log, shared."""
    here = sys._getframe().f_lineno
    with record() as outer:
        a = torch.zeros(1024, 1024)  # here + 2
        with record() as inner:
            b = torch.zeros(512, 1024)  # here + 4
            del b
        c = torch.zeros(256, 1024)  # here + 6
        del a, c
    o, i = outer.report().devices["cpu"], inner.report().devices["cpu"]
    assert (i.peak_bytes - i.start_bytes, i.end_bytes - i.start_bytes) == (2 * MiB, 0)
    assert [(s.line - here, s.bytes) for s in i.sites_at_peak if s.file == HERE] == [
        (4, 2 * MiB)
    ]  # and "<before recording>": `a`, and whatever earlier tests left
    # The inner recording's own tally is not the program's memory: it is not counted.
    assert (o.peak_bytes - o.start_bytes, o.end_bytes - o.start_bytes) == (6 * MiB, 0)
    lines = [(s.line - here, s.bytes) for s in o.sites_at_peak if s.file == HERE]
    assert lines == [(2, 4 * MiB), (4, 2 * MiB)]
    with record() as after:  # the log was cleared with the last one: a fresh start
        d = torch.zeros(128, 1024)
        del d
    cpu = after.report().devices["cpu"]
    assert (cpu.peak_bytes - cpu.start_bytes, after._logs[0].tally.events) == (512 * KiB, 2)


def test_a_forward_pass_without_a_backward_pass_is_freed_at_once() -> None:
    """relu saves its own output for the backward pass: had the recording's hook kept that
    output as it is, the output would hold its own graph, a cycle gc cannot break."""
    model = nn.Linear(8, 8)
    with record():
        output = model(torch.randn(2, 8)).relu()
        alive = weakref.ref(output)
        del output
        assert alive() is None


def test_an_exception_passes_through_and_every_hook_is_removed() -> None:
    before = global_hooks()
    model, optimizer = two_linears()
    error = ValueError("the user's own")
    with pytest.raises(ValueError) as caught, record() as rec:
        model(torch.randn(8, 1024)).sum().backward()
        raise error
    assert caught.value is error
    assert global_hooks() == before
    seen = (dict(rec._watcher.calls), len(rec._watcher.names.entries))
    model(torch.randn(8, 1024)).sum().backward()  # after the recording: nothing seen
    optimizer.step()
    assert (dict(rec._watcher.calls), len(rec._watcher.names.entries)) == seen
    assert rec.report().devices["cpu"].categories_at_end is not None


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="'gpu7'"):
        torchmem.record("gpu7")
    rec = torchmem.record("cpu")
    with pytest.raises(RuntimeError, match="stop the recording"):
        rec.report()
    with rec:
        pass
    with pytest.raises(ValueError, match="top must be at least 1, not 0"):
        rec.report(top=0)
    with pytest.raises(RuntimeError, match="has started already"):
        rec.start()


def test_the_report_prints_saves_json_and_html(tmp_path) -> None:
    with record() as rec:
        model, optimizer = two_linears()
        model(torch.randn(64, 1024)).sum().backward()
        optimizer.step()
    report = rec.report(top=3)
    assert "parameters" in str(report)
    assert "<svg" in report._repr_html_()
    report.save_json(tmp_path / "r.json")
    report.save_html(tmp_path / "r.html")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["devices"]["cpu"]["categories_at_end"]["optimizer_state"] == 8 * MiB
    # The record keeps every site; the text lists three and says how many more.
    sites = data["sites_at_peak"]
    assert len(sites) > 3
    more = len(sites) - 3  # how many depends on what ran before ("site" for one)
    assert f"... and {more} more site{'s' if more > 1 else ''} (" in str(report)
    assert data["devices"]["cpu"]["others_at_peak"]["count"] >= 1
    assert "http" not in (tmp_path / "r.html").read_text()


def test_the_json_holds_categories_over_time_phases_what_modules_added_and_sources() -> None:
    run = DeviceRun(
        "cpu",
        4 * MiB,
        12 * MiB,
        0.5,
        4 * MiB,
        ((0.25, 4 * MiB), (0.5, 12 * MiB)),
        sites_at_peak=(Site("t.py", 3, "<module>", 8 * MiB, (), "x = torch.zeros(2, MiB)"),),
        timeline_categories=((4 * MiB, 0, 0, 0, 0), (4 * MiB, 4 * MiB, 0, 0, 4 * MiB)),
    )
    module = ModulePeak("fc", "Linear", "cpu", 12 * MiB, 16 * MiB, 2, 256 * KiB, 4 * MiB)
    phases = (Phase("forward", 0.125, 0.25), Phase("backward", 0.25, 0.5), Phase("step", 0.5, 1))
    original = RunRecord({"cpu": run}, (module,), 1.0, phases=phases)
    data = json.loads(json.dumps(original.to_json()))
    assert data["devices"]["cpu"]["timeline_categories"] == [
        [4_194_304, 0, 0, 0, 0],
        [4_194_304, 4_194_304, 0, 0, 4_194_304],
    ]
    six = json.loads(json.dumps(data))  # before communication: six categories a row
    six["devices"]["cpu"]["timeline_categories"] = [[1, 2, 3, 4, 5, 6]]
    (layers,) = RunRecord.from_json(six).devices["cpu"].timeline_categories or ()
    assert dict(zip(CATEGORIES, layers, strict=True)) == {
        "parameters": 1,
        "gradients": 2,
        "optimizer_state": 3,
        "buffers": 4,
        "communication": 0,
        "activations": 5,
        "other": 6,
    }
    assert data["phases"] == [
        {"kind": "forward", "start_s": 0.125, "end_s": 0.25},
        {"kind": "backward", "start_s": 0.25, "end_s": 0.5},
        {"kind": "step", "start_s": 0.5, "end_s": 1},
    ]
    assert data["modules"] == [
        {
            "name": "fc",
            "type": "Linear",
            "device": "cpu",
            "forward_peak_bytes": 12_582_912,
            "backward_peak_bytes": 16_777_216,
            "calls": 2,
            "forward_kept_bytes": 262_144,
            "backward_rise_bytes": 4_194_304,
        }
    ]
    assert data["sites_at_peak"] == [
        {
            "file": "t.py",
            "line": 3,
            "function": "<module>",
            "bytes": 8_388_608,
            "stack": [],
            "stacks": [],
            "source": "x = torch.zeros(2, MiB)",
        }
    ]
    again = RunRecord.from_json(data)
    assert again == original
    assert again.devices["cpu"].sites_at_peak[0].source == "x = torch.zeros(2, MiB)"
    # A report written before these fields reads as one that had none.
    del data["phases"], data["devices"]["cpu"]["timeline_categories"]
    del data["modules"][0]["forward_kept_bytes"], data["modules"][0]["backward_rise_bytes"]
    del data["devices"]["cpu"]["sites_at_peak"][0]["source"]
    older = RunRecord.from_json(data)
    assert (older.phases, older.devices["cpu"].timeline_categories) == ((), None)
    (site,) = older.devices["cpu"].sites_at_peak
    assert (older.modules[0].forward_kept_bytes, older.modules[0].backward_rise_bytes) == (0, None)
    assert site.source is None


def test_a_device_without_an_event_log_has_no_categories_over_time() -> None:
    with torchmem.record("ram") as rec:
        kept = bytearray(MiB)
    report = rec.report()
    assert report.devices["ram"].timeline_categories is None
    assert report.to_json()["devices"]["ram"]["timeline_categories"] is None
    assert report.phases == ()
    del kept


def test_a_notebook_cells_sites_are_named_after_the_cell_with_its_source(ipython) -> None:
    """In a real IPython shell: a site in a cell is ``In [n]`` (not ``<ipython-input-...>``
    or ipykernel's ``/tmp/ipykernel_<pid>/<hash>.py``), its source read from the cell; an
    allocation's site reads ``In [n], line 2``, as IPython's tracebacks say it."""
    cells = [
        "import gc, torch, torchmem",
        "def make():\n    return torch.zeros(1024, 1024)  # 4 MiB",
        "gc.collect()\nwith torchmem.record('cpu') as rec:\n    x = make()\n    del x",
    ]
    for cell in cells:
        ipython.run_cell(cell, store_history=True).raise_error()
    made = ipython.execution_count - 2  # the cell that defined make()
    cpu = ipython.user_ns["rec"].report().devices["cpu"]
    # Earlier tests may leave memory alive from before the recording: it is a site too.
    (top,) = [s for s in cpu.sites_at_peak if s.file != "<before recording>"]
    assert (top.file, top.line, top.function, top.bytes) == (f"In [{made}]", 2, "make", 4 * MiB)
    assert top.source == "return torch.zeros(1024, 1024)  # 4 MiB"
    assert top.stack[:2] == ((f"In [{made}]", 2, "make"), (f"In [{made + 1}]", 3, "<module>"))
    (held,) = [h for h in cpu.largest_at_peak if h.site != "<before recording>"]
    assert (held.name, held.site) == (f"Tensor@In [{made}], line 2", f"In [{made}], line 2")
    text = json.dumps(ipython.user_ns["rec"].report().to_json())
    assert "ipython-input" not in text and "ipykernel_" not in text


def test_the_fallback_meter_reports_peaks_without_an_event_log() -> None:
    code = (
        "import torch, torchmem\n"
        "with torchmem.record('cpu') as rec:\n"
        "    x = torch.zeros(1024, 1024)\n"
        "    del x\n"
        "cpu = rec.report().devices['cpu']\n"
        "print(cpu.peak_bytes - cpu.start_bytes, cpu.categories_at_peak, cpu.sites_at_peak)\n"
        "print(rec.report().notes[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHMEM_CPU_METER": "dispatch"},
        check=True,
    )
    sizes, note = done.stdout.splitlines()
    assert sizes == f"{4 * MiB} None ()"
    assert note.startswith("CPU tensors were measured by the fallback meter")


def test_cuda_allocator_history_becomes_an_event_log() -> None:
    """The CUDA path's conversion, on a trace shaped as ``_snapshot()["device_traces"][i]``."""
    from torchmem.events.sources import cuda_events

    inside_torch = {"filename": torch.nn.modules.module.__file__, "line": 1, "name": "_call_impl"}
    mine = {"filename": "/home/me/train.py", "line": 7, "name": "step"}
    trace = [
        {"action": "alloc", "addr": 5000, "size": 512, "time_us": 500_000},  # before the start
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB, "time_us": 1_500_000},
        {"action": "alloc", "addr": 1000, "size": 1024, "time_us": 2_000_000,
         "frames": [inside_torch, mine]},
        {"action": "free_requested", "addr": 1000, "size": 1024, "time_us": 2_500_000},
        {"action": "free_completed", "addr": 1000, "size": 1024, "time_us": 3_000_000},
        {"action": "free_completed", "addr": 9000, "size": 2048, "time_us": 3_500_000},
    ]  # fmt: skip
    start, wall = 7_000_000_000, 1_000_000_000  # monotonic and wall-clock ns at the start
    events, sites = cuda_events(trace, start, wall)
    assert events.tolist() == [
        [start + 1_000_000_000, 1000, 1024, 0, 1],
        [start + 2_000_000_000, 1000, -1024, -1, 0],
        [start + 2_500_000_000, 9000, -2048, -1, -1],  # allocated before the recording
    ]
    assert sites == {0: ("/home/me/train.py", 7, "step")}


def test_cuda_allocations_count_their_blocks_bytes() -> None:
    """The history records requested bytes; the log counts the block, as
    ``memory_allocated()`` does: a request leaving under 1 MiB of its 20 MiB segment takes
    the whole segment, and a small one its size rounded up to 512 bytes."""
    from torchmem.events.sources import cuda_events

    request = 19 * MiB + 1
    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 20 * MiB,
            "blocks": [{"address": 0, "size": 20 * MiB, "state": "active_allocated"}],
        },
        {
            "device": 0,
            "address": 64 * MiB,
            "total_size": 2 * MiB,
            "blocks": [{"address": 64 * MiB, "size": 2 * MiB, "state": "inactive"}],
        },
    ]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB, "time_us": 1},
        {"action": "alloc", "addr": 0, "size": request, "time_us": 2},
        {"action": "segment_alloc", "addr": 64 * MiB, "size": 2 * MiB, "time_us": 3},
        {"action": "alloc", "addr": 64 * MiB, "size": 100, "time_us": 4},
        {"action": "free_completed", "addr": 64 * MiB, "size": 100, "time_us": 5},
    ]
    events, _ = cuda_events(trace, 0, 0, segments)
    assert events[:, 2].tolist() == [20 * MiB, 512, -512]


def test_a_forked_child_records_nothing() -> None:
    """A DataLoader worker made by fork must not grow a log nobody reads."""
    code = (
        "import os, torch, torchmem\n"
        "from torchmem.meters import native\n"
        "with torchmem.record('cpu') as rec:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        torch.zeros(1024 * 1024)\n"
        "        os._exit(native.load().count())\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "0\n"


@pytest.mark.slow  # 3,000 recordings
def test_recordings_share_one_stream_and_one_fork_handler() -> None:
    """Each recording made a new stream, whose fork handler (never removed) kept it alive:
    3,000 recordings left 3,000 handlers that ran at every fork."""
    from torchmem.events.sources import CpuStream

    for _ in range(3_000):
        with torchmem.record("cpu"):
            pass
    gc.collect()
    assert sum(type(o) is CpuStream for o in gc.get_objects()) == 1


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_module_compiled_in_place_compiles_no_frame_more_under_the_hooks() -> None:
    """``model.compile()``: its eager wrapper calls the global hooks, and Dynamo compiled
    torchmem's hook wrapper as a frame of its own."""
    from torch._dynamo.utils import counters

    def frames(recording: bool) -> dict[str, int]:
        torch._dynamo.reset()
        counters.clear()
        model, _ = two_linears()
        model.compile(backend="eager")
        with record() if recording else contextlib.nullcontext():
            for batch in (4, 4, 6):
                model(torch.randn(batch, 1024)).sum().backward()
        return dict(counters["frames"])

    assert frames(recording=True) == frames(recording=False)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_module_runs_under_the_hooks() -> None:
    """Dynamo must not trace torchmem's global hooks (it failed on them)."""
    model, _ = two_linears()
    compiled = torch.compile(model, backend="eager")
    with record() as rec:
        for _ in range(2):
            compiled(torch.randn(8, 1024)).sum().backward()
    end = rec.report().devices["cpu"].categories_at_end
    assert end is not None
    assert (end["parameters"], end["gradients"]) == (8 * MiB, 8 * MiB)


def test_autograd_patterns_keep_working_and_no_hook_stays() -> None:
    """autograd.grad (a multi-grad hook in mode "all" raised there), in-place ops on a
    module's output, gradient accumulation, checkpointing, forward without backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    x = torch.randn(4, 16, requires_grad=True)
    with record() as rec:
        out = model(torch.randn(4, 16))
        out += 1
        out.sum().backward()
        (model(x).sum() + model(x).sum()).backward()
        (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        grad.sum().backward()
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
        for _ in range(20):
            model(x)
    modules = rec.report().modules
    assert [(m.name, m.calls) for m in modules] == [("", 26), ("0", 26), ("1", 26), ("2", 26)]
    assert all(m.backward_peak_bytes is not None for m in modules)
    assert not x._backward_hooks
    assert all(not p._backward_hooks for p in model.parameters())


def saved_hooks_on_this_thread() -> list[object]:
    """The pack hooks on this thread's saved-tensor hook stack, top first (the stack is
    read by popping, then put back)."""
    found = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        found.append(top)
    for pack, unpack in reversed(found):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return [pack for pack, _ in found]


def test_torch_func_transforms_run_and_ordinary_activations_are_still_seen() -> None:
    """torch.func refuses to run while saved-tensor hooks are installed: ours step aside."""
    from torch.func import grad, hessian, jacrev, vmap

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return ((x @ w).tanh() ** 2).sum()

    torch.manual_seed(0)
    w, x = torch.randn(8, 4), torch.randn(5, 8)
    plain = (grad(loss)(w, x), vmap(grad(loss), in_dims=(None, 0))(w, x.unsqueeze(1)))
    plain += (jacrev(loss)(w, x), hessian(lambda w: loss(w, x))(w))
    binding = torch._C._autograd._saved_tensors_hooks_disable
    model = nn.Linear(256, 256, bias=False)
    with record() as rec:
        measured = (grad(loss)(w, x), vmap(grad(loss), in_dims=(None, 0))(w, x.unsqueeze(1)))
        measured += (jacrev(loss)(w, x), hessian(lambda w: loss(w, x))(w))
        inputs = torch.randn(64, 256, requires_grad=True)
        out = model(inputs).relu()
        seen = rec._watcher.names.entries[:]
        out.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, measured, strict=True))
    # relu's output (64 x 256 float32), saved by autograd after the transforms ran.
    assert (None, (64, 256), "torch.float32") in seen
    assert torch._C._autograd._saved_tensors_hooks_disable is binding
    assert saved_hooks_on_this_thread() == []


def test_torch_func_with_modules_computes_as_without_a_recording() -> None:
    """functional_call (per-sample gradients) and stack_module_state (an ensemble) of
    modules: the watcher asked torch.func's tensors, which have no storage, for their data
    pointer and failed. The module called as usual afterwards is still categorised."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    members = [nn.Linear(64, 4) for _ in range(3)]
    x = torch.randn(5, 64)

    def run() -> list[torch.Tensor]:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (xi.unsqueeze(0),)).sum()

        per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
        stacked, buffers = stack_module_state(members)  # type: ignore[arg-type]

        def member(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(members[0], (p, b), (x,))

        return [
            *per_sample.values(),
            *grad(loss)(params, x[0]).values(),
            vmap(member)(stacked, buffers),
        ]

    plain = run()
    with record() as rec:
        measured = run()
        model(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, measured, strict=True))
    end = rec.report().devices["cpu"].categories_at_end
    assert end is not None
    # model's (64 * 64 + 64 + 64 + 1) floats, and the members' 3 * (64 * 4 + 4) floats.
    assert (end["parameters"], end["gradients"]) == (16_900 + 3_120, 16_900)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_torch_func_transform_compiled_whole_inside_a_recording_runs(backend: str) -> None:
    # Before, Dynamo met our replacement of disable_saved_tensors_hooks, which it could not
    # trace: fullgraph=True failed where plain Python ran.
    from torch.func import grad

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return ((x @ w) ** 2).sum()

    torch._dynamo.reset()
    w, x = torch.randn(8, 4), torch.randn(16, 8)
    compiled = torch.compile(grad(loss), fullgraph=True, backend=backend)
    with record():
        found = compiled(w, x)
    assert torch.allclose(found, 2 * x.T @ (x @ w))
    assert saved_hooks_on_this_thread() == []


def test_the_programs_own_hooks_still_forbid_torch_func_inside_a_recording() -> None:
    # As in plain Python: only our hooks step aside.
    from torch.func import grad

    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    refused = pytest.raises(RuntimeError, match="don't yet support saved tensor hooks")
    with record(), hooks, refused:
        grad(lambda w: (w * w).sum())(torch.ones(3))
    assert saved_hooks_on_this_thread() == []


def test_a_recording_started_inside_a_torch_func_transform_runs() -> None:
    from torch.func import grad

    def loss(w: torch.Tensor) -> torch.Tensor:
        with record() as rec:
            value = (w.sin() * 2).sum()
        assert rec.report().devices["cpu"].peak_bytes >= 0
        return value

    assert torch.equal(grad(loss)(torch.zeros(3)), torch.full((3,), 2.0))
    assert saved_hooks_on_this_thread() == []


def test_the_users_saved_tensor_hooks_stay_when_scopes_are_not_nested() -> None:
    """A user's saved_tensors_hooks scope entered inside a recording and left after it:
    the recording's end takes off its own hooks, not the user's."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.shape)
        return tensor

    packed: list[torch.Size] = []
    users = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    rec = record()
    rec.__enter__()
    users.__enter__()
    rec.__exit__(None, None, None)
    assert saved_hooks_on_this_thread() == [pack]
    (torch.ones(3, requires_grad=True) * torch.ones(3)).sum()
    assert packed == [torch.Size([3])]  # mul saves the factor that needs no gradient
    users.__exit__(None, None, None)
    assert saved_hooks_on_this_thread() == []


def test_a_model_the_program_drops_is_freed_at_once_and_still_named() -> None:
    """The recording holds no module, optimizer or parameter of the program's alive: a
    model a function made and dropped is freed when it returns, as without torchmem."""

    def train() -> tuple[weakref.ref[nn.Module], weakref.ref[torch.optim.Optimizer]]:
        model, optimizer = two_linears()
        model(torch.randn(64, 1024)).square().mean().backward()
        optimizer.step()
        return weakref.ref(model), weakref.ref(optimizer)

    with record() as rec:
        model, optimizer = train()
        dropped = (model(), optimizer())
    assert dropped == (None, None)
    cpu = rec.report().devices["cpu"]
    assert cpu.end_bytes == cpu.start_bytes
    end = cpu.categories_at_end
    assert end is not None and end["parameters"] == end["optimizer_state"] == 0
    peak = cpu.categories_at_peak
    assert peak is not None
    assert (peak["parameters"], peak["gradients"], peak["optimizer_state"]) == (8 * MiB,) * 3
    names = {h.name for h in cpu.largest_at_peak}
    assert {"0.weight", "1.weight.grad", "SGD.1.weight.momentum_buffer"} <= names
    assert [(m.name, m.type, m.calls) for m in rec.report().modules] == [
        ("", "Sequential", 1),
        ("0", "Linear", 1),
        ("1", "Linear", 1),
    ]


def test_a_recording_nested_before_the_first_allocation_shares_the_names() -> None:
    """An inner recording started before its outer one logged a row starts at row 0 too:
    it still nests (the outer's report failed, naming marks through a table the inner
    replaced). In a fresh process: there the outer's log is empty when the inner starts."""
    script = (
        "import torch, torchmem\n"
        "model = torch.nn.Linear(64, 64)\n"
        "with torchmem.record('cpu'):\n"  # an earlier recording, which named marks
        "    model(torch.randn(4, 64)).sum().backward()\n"
        "with torchmem.record('cpu') as outer:\n"
        "    with torchmem.record('cpu') as inner:\n"
        "        kept = torch.zeros(1024, 1024)\n"
        "    inner_report = inner.report()\n"  # kept: its figures are numpy's, not the program's
        "    del kept\n"
        "for report in (outer.report(), inner_report):\n"
        "    cpu = report.devices['cpu']\n"
        "    print(cpu.peak_bytes - cpu.start_bytes)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.split() == [str(4 * MiB)] * 2, done.stderr


def test_a_recording_imports_no_dynamo_while_the_program_runs() -> None:
    """Importing torch._dynamo (seconds, tens of MiB) is not the program's cost."""
    script = (
        "import sys, torch, torchmem\n"
        "with torchmem.record('cpu') as rec:\n"
        "    model = torch.nn.Linear(64, 64)\n"
        "    model(torch.randn(4, 64)).sum().backward()\n"
        "    print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.split() == ["False"], done.stderr


def process_state() -> dict[str, object]:
    """What docs/process.md ("What torchmem changes in your process") says a recording
    changes and undoes, read from the process."""
    return {
        "global hooks": global_hooks(),
        "saved-tensor hooks": saved_hooks_on_this_thread(),
        "_saved_tensors_hooks_disable": torch._C._autograd._saved_tensors_hooks_disable,
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("torch")),
        "trace": sys.gettrace(),
        "storage functions": (dict(vars(torch.UntypedStorage)), torch.from_file),
    }


@pytest.mark.parametrize("ending", ["normally", "by an error", "by Ctrl-C"])
def test_every_change_a_recording_makes_to_the_process_is_undone(ending: str) -> None:
    model, optimizer = two_linears()
    model[0].weight.requires_grad_(False)  # a module whose inputs need no gradient: hooks
    before = process_state()
    error = {"by an error": ValueError("the user's"), "by Ctrl-C": KeyboardInterrupt()}
    raises = pytest.raises(BaseException) if ending in error else contextlib.nullcontext()
    with raises, record():
        during = process_state()
        model(torch.randn(8, 1024)).sum().backward()
        optimizer.step()
        hooked = [bool(p._post_accumulate_grad_hooks) for p in model.parameters()]
        if ending in error:
            raise error[ending]
    assert during != before and any(hooked)  # the changes it checks are undone were made
    assert process_state() == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert all(not p._backward_hooks for p in model.parameters())


def test_rows_the_log_had_no_memory_for_are_said_in_the_report(monkeypatch) -> None:
    """The wiring, with a stand-in for the library's count of dropped rows (the library's
    own dropping, out of memory, is tested in test_allocator_contract.py)."""
    library = meter("cpu").library
    readings = iter([5, 12])
    monkeypatch.setattr(library, "dropped_rows", lambda: next(readings))
    with record() as rec:
        torch.zeros(1024)
    notes = rec.report().notes
    assert [n for n in notes if "could not be logged" in n] == [
        "cpu: 7 allocations and frees could not be logged (out of memory): this device's"
        " figures may be off (meter('cpu') itself stayed exact)."
    ]


def test_a_recording_in_a_function_holds_none_of_its_locals_after_its_end() -> None:
    """Naming what variables hold at the end read the function's f_locals, which (before
    Python 3.13) left a snapshot on the frame holding every local alive until return."""

    def train() -> int:
        with record():
            kept = torch.zeros(1024, 1024)
        before = meter("cpu").used()
        del kept
        return before - meter("cpu").used()

    assert train() == 4 * MiB  # freed at its del, as without torchmem


def test_a_module_namespace_is_left_alone_by_a_recording() -> None:
    namespace: dict[str, object] = {"torch": torch, "record": record}
    exec("with record():\n    kept = torch.zeros(4)\n", namespace)
    assert namespace["kept"].shape == (4,)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_compiled_module_keeps_its_graph_whole_under_a_recording() -> None:
    # Before, the hooks were opaque to Dynamo: each module's call broke the graph.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    compiled = torch.compile(model, backend="eager")
    with torchmem.record("cpu") as rec:
        for _ in range(2):
            compiled(torch.randn(8, 64)).sum().backward()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert any(note.startswith("Compiled modules ran") for note in rec.report().notes)
