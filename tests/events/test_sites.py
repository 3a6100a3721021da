"""The one rule for the user's line, in every place that names sites: real-shaped CUDA
frames lists (copied from real GPU snapshots), the CPU allocator's log, autograd's
backward, snapshots, the estimator, the JSON and the HTML."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import torchmem
from standins import MiB, call_in_fresh_process_without_gpu
from torchmem.events.analysis import BEFORE, Names, device_run
from torchmem.events.hooks import Watcher
from torchmem.events.notes import Notes, Tree
from torchmem.events.sources import Log, cuda_events
from torchmem.events.tally import CLOSE, HIT, OPEN
from torchmem.meters import CpuAllocatorMeter, meter
from torchmem.meters.native import CpuAllocatorLibrary
from torchmem.records import frames
from torchmem.records.frames import (
    BACKWARD,
    ENGINE,
    LIBRARY,
    NO_PYTHON,
    OTHER,
    USER,
    kind,
    python_stack,
    stack_site,
)
from torchmem.records.run import DeviceRun, RunRecord, Site, SiteStack
from torchmem.render import run as render_run
from torchmem.snapshot import BEFORE_TRACE, Snapshot

HERE = frames.shown(__file__)
"""This file as sites name it: relative to the working directory the tests run in."""
ENV = "/scratch/u/envs/a2/lib/python3.13/site-packages"
MODEL = "/home/u/assignment1/cs336_basics/transformer.py"
BENCH = "/home/u/assignment2/cs336_systems/benchmark.py"


def cpp(name: str, filename: str = "??") -> dict[str, object]:
    return {"name": name, "filename": filename, "line": 0}


def py(filename: str, line: int, name: str) -> dict[str, object]:
    return {"name": name, "filename": filename, "line": line}


ALLOCATOR = [
    cpp("torch::unwind::unwind()"),
    cpp("torch::CapturedTraceback::gather(bool, bool, bool)"),
    cpp("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
    cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
        "CUDACachingAllocator.cpp"),
    cpp("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)", ""),
    cpp("at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)"),
]  # fmt: skip
"""The C++ frames every CUDA allocation's stack starts with."""
EINSUM = [
    *ALLOCATOR,
    cpp("at::native::einsum(...)", "Linear.cpp"),
    cpp("torch::autograd::THPVariable_einsum(_object*, _object*, _object*)"),
    py(f"{ENV}/torch/functional.py", 407, "einsum"),
    cpp("_PyEval_EvalFrameDefault"),
    py(f"{ENV}/einops/_backends.py", 288, "einsum"),
    py(f"{ENV}/einops/einops.py", 916, "einsum"),
    py(MODEL, 22, "forward"),
    cpp("_PyEval_EvalFrameDefault"),
    py(f"{ENV}/torch/nn/modules/module.py", 1750, "_call_impl"),
    py(f"{ENV}/torch/nn/modules/module.py", 1739, "_wrapped_call_impl"),
    py(MODEL, 188, "forward"),
    cpp("Py_RunMain"),
    cpp("_start"),
    py(BENCH, 335, "profile_memory_forward_fullstep"),
    py(BENCH, 452, "<module>"),
]
"""An einsum inside einops, called from the user's model (a real snapshot's stack, cut)."""
AUTOGRAD_THREAD = [
    *ALLOCATOR,
    cpp("at::_ops::neg::call(at::Tensor const&)"),
    cpp("torch::autograd::generated::SubBackward0::apply(...)"),
    cpp("torch::autograd::Node::operator()(...)", ""),
    cpp("torch::autograd::Engine::evaluate_function(...)"),
    cpp("torch::autograd::Engine::thread_main(...)"),
    cpp("torch::autograd::python::PythonEngine::thread_init(int, ...)"),
    cpp("execute_native_thread_routine", "thread48.o"),
    cpp("pthread_condattr_setpshared"),
]
"""A gradient made on autograd engine's thread for the GPU: C++ frames only."""


def frames_of(listed: list[dict[str, object]]) -> list[tuple[str, int, str]]:
    return [(str(f["filename"]), int(f["line"]), str(f["name"])) for f in listed]  # type: ignore[call-overload]


def python_of(listed: list[dict[str, object]]) -> tuple[tuple[str, int, str], ...]:
    return tuple(f for f in frames_of(listed) if f[1])


FRAME_KINDS = [
    (MODEL, "forward", USER),
    ("/tmp/ipykernel_12/3456.py", "<module>", USER),  # a Jupyter cell
    ("<stdin>", "<module>", USER),
    ("/home/zoë/ππ/実験.py", "λ", USER),  # beyond ASCII
    (f"{ENV}/einops/_backends.py", "einsum", LIBRARY),
    ("/usr/lib/python3/dist-packages/numpy/core/numeric.py", "zeros_like", LIBRARY),
    (f"{ENV}/torch/nn/modules/module.py", "_call_impl", OTHER),
    ("/opt/conda/lib/python3.11/threading.py", "run", OTHER),
    ("/tmp/torchinductor_me/ab/cabcdef.py", "call", OTHER),
    ("<eval_with_key>.3", "forward", OTHER),
    ("<string>", "f", OTHER),
    ("<frozen runpy>", "_run_code", OTHER),
    ("/home/u/src/torchmem/recording.py", "stop", OTHER),
    (f"{ENV}/torch/autograd/graph.py", "_engine_run_backward", ENGINE),
    (f"{ENV}/torch/autograd/graph.py", "backward", OTHER),
    ("/usr/lib/python3.11/site-packages/einops/einops.py", "rearrange", LIBRARY),
    ("/usr/lib/python3.11/json/decoder.py", "decode", OTHER),
    ("/opt/pypy/lib/pypy3.10/copy.py", "deepcopy", OTHER),
    ("/home/u/lib/python3.x/notes.py", "f", USER),
    ("C:\\Python311\\Lib\\json\\decoder.py", "decode", OTHER),
    ("C:\\Python311\\Lib\\site-packages\\timm\\layers.py", "forward", LIBRARY),
    ("/home/u/torch_utils/ops.py", "f", USER),
    ("/home/u/mytorch/torch.py", "f", USER),
]
"""Frames of each kind: (file, function, kind)."""


@pytest.mark.parametrize(("file", "function", "expected"), FRAME_KINDS)
def test_what_a_frame_is(file: str, function: str, expected: int) -> None:
    assert kind(file, function) == expected


def test_a_library_line_gives_way_to_the_users_line_below_it() -> None:
    found, stack = stack_site(frames_of(EINSUM))
    assert found == (MODEL, 22, "forward")
    assert stack == python_of(EINSUM)
    assert stack[1] == (f"{ENV}/einops/_backends.py", 288, "einsum")  # one look away


def test_without_a_user_frame_the_innermost_library_frame_then_any_python_frame() -> None:
    assert stack_site(frames_of(EINSUM[:11]))[0] == (f"{ENV}/einops/_backends.py", 288, "einsum")
    assert stack_site(frames_of(EINSUM[:9]))[0] == (f"{ENV}/torch/functional.py", 407, "einsum")


def test_cpp_frames_never_name_a_site() -> None:
    assert stack_site(frames_of(AUTOGRAD_THREAD)) == ((BACKWARD, 0, ""), ())
    assert stack_site(frames_of(ALLOCATOR)) == ((NO_PYTHON, 0, ""), ())


def test_autograd_engine_entry_names_backward_unless_user_code_runs_inside_it() -> None:
    engine = (f"{ENV}/torch/autograd/graph.py", 829, "_engine_run_backward")
    caller = (f"{ENV}/torch/_tensor.py", 647, "backward")
    line = ("/home/u/train.py", 40, "step")
    hook = ("/home/u/train.py", 12, "MyFunction.backward")
    assert stack_site([engine, caller, line]) == ((BACKWARD, 0, ""), (engine, caller, line))
    assert stack_site([hook, engine, caller, line])[0] == hook


def test_cuda_history_sites_follow_the_rule_and_keep_the_stack() -> None:
    trace = [
        {"action": "alloc", "addr": 1 * MiB, "size": 4 * MiB, "time_us": 2, "frames": EINSUM},
        {"action": "alloc", "addr": 9 * MiB, "size": 8 * MiB, "time_us": 3,
         "frames": AUTOGRAD_THREAD},
        {"action": "alloc", "addr": 20 * MiB, "size": 2 * MiB, "time_us": 4, "frames": EINSUM},
    ]  # fmt: skip
    events, sites = cuda_events(trace, 0, 1000)
    assert events[:, 3].tolist() == [0, 1, 0]
    assert sites == {0: (MODEL, 22, "forward"), 1: (BACKWARD, 0, "")}
    assert sites[0].stack == python_of(EINSUM)


def test_cuda_backward_is_named_after_the_module_whose_backward_ran() -> None:
    """A CUDA recording's log, with the backward passes its watcher saw."""
    model = nn.Sequential(nn.Linear(2, 2))
    watcher = Watcher()
    watcher.roots = [id(model)]
    watcher.trees = {id(model): Tree.of(model)}
    watcher.modules = {id(m): type(m).__name__ for m in model.modules()}
    notes = Notes()
    for when, op, probe, module, depth in (
        (100, OPEN, 1, model, 0),  # from 100 to 900
        (101, OPEN, 2, model[0], 1),  # the same output, a moment apart: from 101 to 500
        (500, HIT, 2, model[0], 1),
        (900, HIT, 1, model, 0),
        (990, CLOSE, 1, model, 0),
        (990, CLOSE, 2, model[0], 1),
    ):
        notes.rows.append((when, op, probe, id(module), depth << 1 | 1, ""))
    trace = [
        {"action": "alloc", "addr": a, "size": s, "time_us": t, "frames": AUTOGRAD_THREAD}
        for a, s, t in ((0, 8 * MiB, 200), (10 * MiB, 4 * MiB, 600), (20 * MiB, MiB, 950))
    ]
    events, sites = cuda_events(trace, 0, 0)
    events[:, 0] //= 1000  # on the intervals' clock: microseconds here
    found = Log("cuda:0", 0, 0, events, sites).tally(notes)
    run = device_run(found, 1000, Names(watcher), watcher.names, {}, 10)
    assert [(s.file, s.bytes) for s in run.sites_at_peak] == [
        ("backward of 0 (Linear)", 8 * MiB),
        ("backward of Sequential", 4 * MiB),
        (BACKWARD, MiB),
    ]
    assert {h.site for h in run.largest_at_peak} == {
        "backward of 0 (Linear)",
        "backward of Sequential",
        BACKWARD,
    }


def test_a_snapshots_top_site_is_the_users_line_with_its_stack_in_json() -> None:
    block = {"size": 6 * MiB, "requested_size": 6 * MiB, "state": "active_allocated"}
    trace = [
        {"action": "alloc", "addr": 0, "size": 4 * MiB, "time_us": 1, "frames": EINSUM},
        {"action": "alloc", "addr": 4 * MiB, "size": 2 * MiB, "time_us": 2,
         "frames": AUTOGRAD_THREAD},
    ]  # fmt: skip
    data = {
        "segments": [{"address": 0, "total_size": 6 * MiB, "blocks": [block]}],
        "device_traces": [trace],
    }
    device = Snapshot.from_dict(data).devices[0]
    assert device.sites_at_peak == (
        Site(MODEL, 22, "forward", 4 * MiB),
        Site(BACKWARD, 0, "", 2 * MiB),
    )
    top = device.sites_at_peak[0].to_json()
    assert top["stack"][:2] == [[f"{ENV}/torch/functional.py", 407, "einsum"],
                                [f"{ENV}/einops/_backends.py", 288, "einsum"]]  # fmt: skip
    assert Site.from_json(top).stack == python_of(EINSUM)


def test_html_shows_a_sites_stack_on_demand_and_text_does_not() -> None:
    stack = (("/lib/site-packages/einops/_backends.py", 288, "einsum"), ("train.py", 5, "f<g>"))
    sites = (
        Site("train.py", 5, "f<g>", 4 * MiB, (SiteStack(4 * MiB, stack),)),
        Site(BACKWARD, 0, "", 2 * MiB),
    )
    record = RunRecord(
        {"cpu": DeviceRun("cpu", 0, 6 * MiB, 1.0, 0, (), sites_at_peak=sites)}, (), 2.0
    )
    html = render_run.html(record)
    assert (
        '<td style="text-align: left"><details><summary>train.py:5</summary>'
        '<ol style="margin: 2px 0; padding-left: 1.6em; text-align: left">'
        "<li><code>/lib/site-packages/einops/_backends.py:288</code> einsum</li>"
        "<li><code>train.py:5</code> f&lt;g&gt;</li></ol></details></td>"
    ) in html
    assert html.count("<details>") == 1  # a site without a stack is a plain cell
    assert "<script" not in html  # no timeline: no chart to hover
    assert "einops" not in render_run.text(record)


def test_html_shows_each_stack_of_a_site_under_its_bytes() -> None:
    line = ("model.py", 9, "forward")
    train = SiteStack(3 * MiB, (line, ("train.py", 18, "train_step")))
    evaluate = SiteStack(MiB, (line, ("train.py", 12, "evaluate")))
    sites = (Site(*line, 4 * MiB, (train, evaluate)),)
    record = RunRecord(
        {"cpu": DeviceRun("cpu", 0, 4 * MiB, 1.0, 0, (), sites_at_peak=sites)}, (), 2.0
    )
    ol = '<ol style="margin: 2px 0; padding-left: 1.6em; text-align: left">'
    assert (
        '<td style="text-align: left"><details><summary>model.py:9</summary>'
        f'<div style="text-align: left">3.00M:</div>{ol}'
        "<li><code>model.py:9</code> forward</li><li><code>train.py:18</code> train_step</li>"
        f'</ol><div style="text-align: left">1.00M:</div>{ol}'
        "<li><code>model.py:9</code> forward</li><li><code>train.py:12</code> evaluate</li>"
        "</ol></details></td>"
    ) in render_run.html(record)


needs_allocator = pytest.mark.counting


@pytest.fixture
def installed_library(tmp_path: Path) -> Iterator[object]:
    """A package in a site-packages folder on sys.path, that allocates for its caller."""
    folder = tmp_path / "site-packages" / "tensorlib"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "import torch\n\n\ndef make(n):\n    return torch.zeros(n)  # the library's line\n"
    )
    sys.path.insert(0, str(folder.parent))
    try:
        yield importlib.import_module("tensorlib")
    finally:
        sys.path.remove(str(folder.parent))
        sys.modules.pop("tensorlib", None)


def users_line(library: object) -> torch.Tensor:
    return library.make(MiB)  # type: ignore[attr-defined,no-any-return]


@needs_allocator
def test_the_cpu_log_names_the_users_line_that_called_an_installed_package(
    installed_library: object,
) -> None:
    with torchmem.record("cpu") as rec:
        kept = users_line(installed_library)
    del kept
    sites = rec.report().devices["cpu"].sites_at_peak  # in a whole suite, storages alive
    top = next(s for s in sites if s.file == HERE)  # before the recording come first
    line = users_line.__code__.co_firstlineno + 1
    library = os.path.join(os.path.dirname(installed_library.__file__), "__init__.py")  # type: ignore[attr-defined]
    assert (top.file, top.line, top.function, top.bytes) == (HERE, line, "users_line", 4 * MiB)
    assert top.stack[:2] == ((library, 5, "make"), (HERE, line, "users_line"))


def cpu_library() -> CpuAllocatorLibrary:
    found = meter("cpu")
    assert isinstance(found, CpuAllocatorMeter)
    return found.library


@needs_allocator
@pytest.mark.parametrize(("file", "function", "expected"), FRAME_KINDS)
def test_the_allocators_walk_tells_what_a_frame_is_by_the_same_rule(
    file: str, function: str, expected: int
) -> None:
    namespace = {"library": cpu_library()}
    exec(compile("def probe():\n    return library.check_walk()\n", file, "exec"), namespace)
    probe = namespace["probe"]
    names = {"co_qualname": function} if sys.version_info >= (3, 11) else {}
    probe.__code__ = probe.__code__.replace(co_name=function, **names)  # type: ignore[attr-defined]
    walked = probe()  # type: ignore[operator]
    assert walked[1] == (file, 2, function, expected)


def walked_and_shown() -> Iterator[
    tuple[list[tuple[str, int, str, int]], list[tuple[str, int, str, int]]]
]:
    library = cpu_library()
    yield library.check_walk()[1:], python_stack(sys._getframe())


@needs_allocator
def test_the_allocators_walk_reads_the_stack_python_shows_in_generators_and_threads() -> None:
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.extend(walked_and_shown()))
    worker.start()
    worker.join()
    for walked, shown in [*walked_and_shown(), *found]:  # type: ignore[misc]
        assert walked == shown
        assert walked[0][2] == "walked_and_shown"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(1024, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)  # type: ignore[no-any-return]


@pytest.fixture
def moved_inductor_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A ``TORCHINDUCTOR_CACHE_DIR`` away from its default, read by the rule afresh."""
    folder = str(tmp_path / "compiled")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)
    caches = (frames.pattern, frames._inductor_cache, frames.kind)
    for cache in caches:
        cache.cache_clear()
    yield folder
    for cache in caches:
        cache.cache_clear()


def walked_kind(file: str, function: str) -> int:
    """What the CPU allocator's walk says a frame of `file` running `function` is."""
    namespace = {"library": cpu_library()}
    exec(compile("def probe():\n    return library.check_walk()\n", file, "exec"), namespace)
    probe = namespace["probe"]
    probe.__code__ = probe.__code__.replace(co_name=function, co_qualname=function)  # type: ignore[attr-defined]
    return probe()[1][3]  # type: ignore[operator, no-any-return]


def test_compiled_code_is_passed_over_where_its_cache_folder_is_moved(
    moved_inductor_cache: str,
) -> None:
    generated = os.path.join(moved_inductor_cache, "ab", "cabcdef.py")
    beside = os.path.join(os.path.dirname(moved_inductor_cache), "compiled.py")
    assert (kind(generated, "call"), kind(beside, "f")) == (OTHER, USER)
    if getattr(meter("cpu"), "backend", "") == "allocator":
        assert (walked_kind(generated, "call"), walked_kind(beside, "f")) == (OTHER, USER)


def compiled_sites() -> list[str]:
    """The files of the sites of a compiled module's training step."""
    model = torch.compile(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)))
    x = torch.randn(64, 256)
    model(x).sum().backward()  # compiled before the recording: its sites are the steps'
    with torchmem.record("cpu") as rec:
        model(x).sum().backward()
    return [site.file for site in rec.report().devices["cpu"].sites_at_peak]


@pytest.mark.slow
def test_a_compiled_steps_sites_are_the_users_lines_and_backward(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = str(tmp_path / "compiled")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)  # the process is started with it
    files = call_in_fresh_process_without_gpu(compiled_sites)
    assert sorted(files) == sorted([BEFORE, f"{BACKWARD} of OptimizedModule", HERE])


@needs_allocator
def test_a_cpu_backward_pass_is_named_after_its_modules() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(256, 1024, requires_grad=True)
    with torchmem.record("cpu") as rec:
        model(x).sum().backward()
    sites = {s.file: s for s in rec.report().devices["cpu"].sites_at_peak}
    # each attn's weight gradient (4 MiB) and its input's (1 MiB)
    first, second = sites["backward of 0.attn (Linear)"], sites["backward of 1.attn (Linear)"]
    assert first.bytes == second.bytes == 5 * MiB
    assert any(f[2] == "_engine_run_backward" for f in first.stack)


def test_the_estimator_names_sites_by_the_same_rule(installed_library: object) -> None:
    def step(batch: int) -> None:
        model = nn.Sequential(Block())
        users_line(installed_library)
        model(torch.randn(batch, 1024, requires_grad=True)).sum().backward()

    sites = {s.file: s for s in torchmem.estimate(step, 256, device="cpu").run.sites_at_peak}
    assert sites["backward of 0.attn (Linear)"].bytes == 5 * MiB
    assert not [f for f in sites if "site-packages" in f or f == BACKWARD]
    assert all("torchmem" not in f[0] for s in sites.values() for f in s.stack)


GPU_TRUTH = Path(__file__).resolve().parents[3] / "shared" / "gpu-truth"


@pytest.mark.skipif(not GPU_TRUTH.is_dir(), reason=f"{GPU_TRUTH} is absent (real GPU snapshots)")
@pytest.mark.parametrize(
    ("name", "backward"),
    [
        ("transformer-2.7b-ctx128-forward-fp32", None),
        ("transformer-2.7b-ctx128-forward-bf16autocast", None),
        ("transformer-2.7b-ctx512-forward-fp32", None),
        ("transformer-2.7b-ctx128-fullstep-fp32", 13_795_371_008),
        ("transformer-2.7b-ctx512-fullstep-fp32", 13_627_238_400),
    ],
)
def test_real_snapshots_name_user_lines_and_backward(name: str, backward: int | None) -> None:
    """No site at the peak is a C++ file or an installed package's line (a user line is in
    every stack of these files); the gradients are the backward pass's."""
    device = torchmem.load_snapshot(GPU_TRUTH / f"{name}.pickle").devices[0]
    sites = device.sites_at_peak
    named = {s.file: s.bytes for s in sites}
    assert named.get(BACKWARD) == backward
    for site in sites:
        if site.file in (BEFORE_TRACE, BACKWARD):
            continue
        assert site.file.endswith(".py") and site.line > 0
        assert "site-packages" not in site.file
        assert site.stack[0][0].endswith(".py")
    einsum = next(s for s in sites if s.file.endswith("transformer.py") and s.line == 22)
    assert einsum.stack[1][1:] == (288, "einsum") and "einops" in einsum.stack[1][0]


def test_files_are_shown_relative_to_the_working_directory_where_under_it() -> None:
    here = os.getcwd()  # where the tests started, as torchmem did
    assert frames.shown(os.path.join(here, "src", "train.py")) == os.path.join("src", "train.py")
    assert frames.shown(os.path.join("src", ".", "train.py")) == os.path.join("src", "train.py")
    outside = os.path.join(os.path.dirname(here), "elsewhere", "model.py")
    assert frames.shown(outside) == outside
    assert frames.shown(os.path.join(os.pardir, "elsewhere", "model.py")) == outside
    for pseudo in ("<stdin>", "<frozen runpy>", "In [4]", BACKWARD, "backward of 0 (Linear)"):
        assert frames.shown(pseudo) == pseudo


SCRIPT_SOURCE = """\
import torch
from model import make

kept = [make(), torch.zeros(256, 1024)]
"""
MODULE_SOURCE = """\
import torch

def make():
    return torch.zeros(512, 1024)
"""


@needs_allocator
def test_a_script_and_the_module_it_imports_are_named_in_one_form(tmp_path: Path) -> None:
    """Python names the script by the path it was given (relative) and the module beside it,
    imported through ``sys.path[0]``, by its absolute path: the report names both relative
    to the directory torchmem ran in, in its sites, their stacks and its largest tensors."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(SCRIPT_SOURCE)
    (tmp_path / "job" / "model.py").write_text(MODULE_SOURCE)
    command = [sys.executable, "-m", "torchmem", "run", "-q", "--json", "r.json", "job/train.py"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    cpu = json.loads((tmp_path / "r.json").read_text())["devices"]["cpu"]
    sites = [(s["file"], s["line"], s["bytes"]) for s in cpu["sites_at_peak"]]
    assert sites == [("job/model.py", 4, 2 * MiB), ("job/train.py", 4, MiB)]
    files = {f[0] for s in cpu["sites_at_peak"] for each in s["stacks"] for f in each["stack"]}
    assert {"job/model.py", "job/train.py"} <= files
    assert not [f for f in files if f.startswith(str(tmp_path))]
    assert [h["site"] for h in cpu["largest_at_peak"]] == ["job/model.py:4", "job/train.py:4"]
