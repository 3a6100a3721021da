"""The memory reporter, exact to the byte and to the character on CPU tensors.

Each test scans only the tensors it made (``MemReporter(objects=...)``), so that
tensors other tests left alive in this process do not show; the one test that scans
every object in the process (the default) runs in a fresh process.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from standins import CudaStandIn, StandInGpu, call_in_fresh_process_without_gpu, gpu_uuid, hide_gpus
from torchmem import MemReporter, TensorRecord, TensorReport, diff

HEADER = "Element type                                            Size  Used MEM\n"
RULE = "-" * 79 + "\n"


def only(*tensors: object):
    """An `objects` function that scans just `tensors` (held weakly where possible)."""
    refs = [weakref.ref(t) for t in tensors]
    return lambda: [t for t in (r() for r in refs) if t is not None]


def block(device: str, rows: str, total: str, extra: str = "") -> str:
    return f"{RULE}Storage on {device}\n{rows}{RULE}{total}\n{extra}{RULE}"


def test_linear_parameters_are_4_00M_and_4_00K(capsys: pytest.CaptureFixture[str]) -> None:
    linear = torch.nn.Linear(1024, 1024)
    MemReporter(linear, objects=only()).report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "weight                                          (1024, 1024)     4.00M\n"
        "bias                                                 (1024,)     4.00K\n",
        "Total Tensors: 1049600 \tUsed Memory: 4.00M",
    )


def test_after_backward_each_grad_appears_once_under_its_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    linear = torch.nn.Linear(1024, 1024)
    inp = torch.zeros(512, 1024)
    out = linear(inp).mean()
    out.backward()
    touched = linear.weight.grad  # now gc can see it too: still listed once
    reporter = MemReporter(linear, objects=only(inp, touched, out))
    expected = HEADER + block(
        "cpu",
        "weight                                          (1024, 1024)     4.00M\n"
        "weight.grad                                     (1024, 1024)     4.00M\n"
        "bias                                                 (1024,)     4.00K\n"
        "bias.grad                                            (1024,)     4.00K\n"
        "Tensor0                                          (512, 1024)     2.00M\n"
        "Tensor1                                                   ()     4.00B\n",
        "Total Tensors: 2623489 \tUsed Memory: 10.01M",
    )
    reporter.report()
    reporter.report()  # the same again: nothing counted twice, names fresh
    assert capsys.readouterr().out == expected * 2


def test_tied_weights_show_every_name(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    second.weight = first.weight
    MemReporter(torch.nn.Sequential(first, second), objects=only()).report(verbose=True)
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "0.weight+1.weight                                     (4, 4)    64.00B\n"
        "0.bias                                                  (4,)    16.00B\n"
        "1.bias                                                  (4,)    16.00B\n",
        "Total Tensors: 24 \tUsed Memory: 96.00B",
    )


def test_shared_storage_shows_its_owner_only_when_verbose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    whole = torch.zeros(256)
    half = whole[:128]
    reporter = MemReporter(objects=only(whole, half))
    reporter.report(verbose=True)
    reporter.report()
    rows = "Tensor0                                               (256,)     1.00K\n"
    total = "Total Tensors: 384 \tUsed Memory: 1.00K"
    shared = "Tensor1(->Tensor0)                                    (128,)     0.00B\n"
    assert capsys.readouterr().out == (
        HEADER + block("cpu", rows + shared, total) + HEADER + block("cpu", rows, total)
    )
    (_, record) = reporter.snapshot()
    assert (record.name, record.owner, record.nbytes) == ("Tensor1", "Tensor0", 0)


def adam_step(model: torch.nn.Module) -> torch.optim.Adam:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_optimizer_state_is_named_after_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    linear = torch.nn.Linear(4, 4, bias=False)
    reporter = MemReporter(linear, objects=only())
    reporter.add_optimizer(adam_step(linear))
    reporter.report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "weight                                                (4, 4)    64.00B\n"
        "weight.grad                                           (4, 4)    64.00B\n"
        "Adam.weight.step                                          ()     4.00B\n"
        "Adam.weight.exp_avg                                   (4, 4)    64.00B\n"
        "Adam.weight.exp_avg_sq                                (4, 4)    64.00B\n",
        "Total Tensors: 65 \tUsed Memory: 260.00B",
    )


def test_optimizer_without_a_model_uses_the_generated_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    linear = torch.nn.Linear(4, 4, bias=False)
    reporter = MemReporter(objects=only())
    reporter.add_optimizer(optimizer := adam_step(linear))
    reporter.add_optimizer(optimizer)  # once is enough
    reporter.report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Parameter0                                            (4, 4)    64.00B\n"
        "Parameter0.grad                                       (4, 4)    64.00B\n"
        "Adam.Parameter0.step                                      ()     4.00B\n"
        "Adam.Parameter0.exp_avg                               (4, 4)    64.00B\n"
        "Adam.Parameter0.exp_avg_sq                            (4, 4)    64.00B\n",
        "Total Tensors: 65 \tUsed Memory: 260.00B",
    )


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_count_their_indices_and_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Built from their parts, so that each storage holds exactly its elements; no two
    # share a part (a shared part would count once, for the first of them).
    index = torch.arange(3)
    coo = torch.sparse_coo_tensor(
        torch.stack([index, index]), torch.ones(3), (3, 3), check_invariants=True
    )
    csr = torch.sparse_csr_tensor(
        torch.arange(4), index.clone(), torch.ones(3), (3, 3), check_invariants=True
    )
    csc = torch.sparse_csc_tensor(
        torch.arange(4), index.clone(), torch.ones(3), (3, 3), check_invariants=True
    )
    MemReporter(objects=only(coo, csr, csc)).report()
    # COO: (2, 3) int64 indices + 3 float32 values; CSR/CSC: 4 + 3 int64 indices + values.
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                               (3, 3)    60.00B\n"
        "Tensor1                                               (3, 3)    68.00B\n"
        "Tensor2                                               (3, 3)    68.00B\n",
        "Total Tensors: 29 \tUsed Memory: 196.00B",
    )


@pytest.mark.filterwarnings("ignore:Sparse (CSR|CSC|BSR) tensor support is in beta")
@pytest.mark.parametrize("inside_grad", [False, True], ids=["plain", "inside-torch.func.grad"])
def test_sparse_tensors_count_their_parts_even_inside_torch_func_grad(
    inside_grad: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # Inside torch.func.grad, reading a compressed sparse tensor's parts raised "Sparse CSR
    # tensors do not have strides", and a COO tensor's parts came back without a storage.
    index = torch.arange(3)
    parts = {"size": (3, 3), "check_invariants": True}
    csr = torch.sparse_csr_tensor(torch.arange(4), index.clone(), torch.ones(3), **parts)
    csc = torch.sparse_csc_tensor(torch.arange(4), index.clone(), torch.ones(3), **parts)
    bsr = torch.sparse_bsr_tensor(torch.arange(4), index.clone(), torch.ones(3, 1, 1), **parts)
    coo = torch.sparse_coo_tensor(torch.stack([index, index]), torch.ones(3), **parts)
    reporter = MemReporter(objects=only(csr, csc, bsr, coo))
    seen = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        seen.append(reporter.snapshot())
        reporter.report()
        return (x * x).sum()

    if inside_grad:
        assert torch.func.grad(loss)(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    else:
        loss(torch.ones(3))
    # CSR, CSC, BSR: 4 compressed and 3 plain int64 indices and 3 float32 values, 32 + 24
    # + 12 bytes; COO: a (2, 3) int64 index and 3 float32 values, 48 + 12 bytes.
    assert [(r.name, r.layout, r.numel, r.nbytes, r.note) for r in seen[0]] == [
        ("Tensor0", "torch.sparse_csr", 10, 68, None),
        ("Tensor1", "torch.sparse_csc", 10, 68, None),
        ("Tensor2", "torch.sparse_bsr", 10, 68, None),
        ("Tensor3", "torch.sparse_coo", 9, 60, None),
    ]
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                               (3, 3)    68.00B\n"
        "Tensor1                                               (3, 3)    68.00B\n"
        "Tensor2                                               (3, 3)    68.00B\n"
        "Tensor3                                               (3, 3)    60.00B\n",
        "Total Tensors: 39 \tUsed Memory: 264.00B",
    )


def test_meta_tensors_hold_no_bytes_and_share_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = torch.empty(1024, 1024, device="meta")
    b = torch.empty(1024, device="meta")
    MemReporter(objects=only(a, b)).report(verbose=True)
    assert capsys.readouterr().out == HEADER + block(
        "meta",
        "Tensor0                                         (1024, 1024)     0.00B\n"
        "Tensor1                                              (1024,)     0.00B\n",
        "Total Tensors: 1049600 \tUsed Memory: 0.00B",
    )


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_nested_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    MemReporter(objects=only(strided)).report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                                    ?    20.00B\n",
        "Total Tensors: 5 \tUsed Memory: 20.00B",
    )
    jagged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    (record,) = MemReporter(objects=only(jagged)).snapshot()
    # 5 float32 values and 3 int64 offsets; the size's ragged dimension is symbolic.
    assert (record.kind, record.nbytes, record.shape[0], record.note) == (
        "NestedTensor",
        44,
        2,
        None,
    )


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        q = torch.quantize_per_tensor(torch.zeros(1000), 0.1, 0, torch.quint8)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch build has no quantized tensors: {exc}")
    MemReporter(objects=only(q)).report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                              (1000,)  1000.00B\n",
        "Total Tensors: 1000 \tUsed Memory: 1000.00B",
    )


class Tagged(torch.Tensor):
    """A plain subclass: it has the storage of the tensor it was made from."""


def test_subclasses(capsys: pytest.CaptureFixture[str]) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    tagged = torch.zeros(8).as_subclass(Tagged)
    two = TwoTensor(torch.zeros(2), torch.ones(2))  # a wrapper: its two inner tensors count
    MemReporter(objects=only(tagged, two)).report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tagged0                                                 (8,)    32.00B\n"
        "TwoTensor1                                              (2,)    16.00B\n",
        "Total Tensors: 10 \tUsed Memory: 48.00B",
    )


def test_a_tensor_without_storage_is_listed_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        opaque = torch.zeros(2, 2).to_mkldnn()
    except RuntimeError as exc:
        pytest.skip(f"this torch build has no mkldnn tensors: {exc}")
    dense = torch.zeros(4)
    MemReporter(objects=only(opaque, dense)).report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                                 (4,)    16.00B\n"
        "Tensor1                                               (2, 2)         ?\n",
        "Total Tensors: 4 \tUsed Memory: 16.00B",
        "Tensor1: not counted, no storage: NotImplementedError: Cannot access storage of"
        " OpaqueTensorImpl\n",
    )


def test_a_tensor_inside_vmap_is_listed_with_a_note() -> None:
    # Inside vmap the function sees a plain torch.Tensor that has no storage of its own.
    found = []

    def double(x: torch.Tensor) -> torch.Tensor:
        found.extend(MemReporter(objects=only(x)).snapshot())
        return x * 2

    torch.vmap(double)(torch.ones(3, 4))
    assert [(r.name, r.shape, r.numel, r.nbytes, r.note) for r in found] == [
        (
            "Tensor0",
            (4,),
            0,
            0,
            "no storage: NotImplementedError: Cannot access storage of BatchedTensorImpl",
        )
    ]


def test_names_are_fresh_in_each_report() -> None:
    a, b = torch.zeros(1), torch.zeros(2)
    first = MemReporter(objects=only(a, b)).snapshot()
    del a
    reporter = MemReporter(objects=only(b, c := torch.zeros(3)))
    assert [(r.name, r.shape) for r in first] == [("Tensor0", (2,)), ("Tensor1", (1,))]
    for _ in range(2):  # largest first, numbered afresh
        assert [(r.name, r.shape) for r in reporter.snapshot()] == [
            ("Tensor0", (3,)),
            ("Tensor1", (2,)),
        ]
    del c


def test_unnamed_tensors_are_numbered_in_the_order_printed_without_gaps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An empty view, a view and a tensor on a device not asked for took numbers that the
    # report never printed: it showed Tensor1, Tensor3, Tensor5.
    empty = torch.zeros(300)[:0]  # largest storage, first in the scan; no elements
    whole = torch.zeros(256)
    view = whole[:128]
    other = torch.zeros(64)
    elsewhere = torch.empty(32, device="meta")
    scalar = torch.tensor(1.0)
    reporter = MemReporter(objects=only(empty, whole, view, other, elsewhere, scalar))
    reporter.report(device="cpu")
    reporter.report(verbose=True, device="cpu")
    rows = (
        "Tensor0                                               (256,)     1.00K\n",
        "Tensor1                                                (64,)   256.00B\n",
        "Tensor2                                                   ()     4.00B\n",
    )
    view_row = "Tensor3(->Tensor0)                                    (128,)     0.00B\n"
    total = "Total Tensors: 449 \tUsed Memory: 1.25K"
    assert capsys.readouterr().out == (
        HEADER
        + block("cpu", "".join(rows), total)
        + HEADER
        + block("cpu", rows[0] + view_row + rows[1] + rows[2], total)
    )
    assert [(r.name, r.owner) for r in reporter.snapshot("cpu")] == [
        ("Tensor0", None),
        ("Tensor3", "Tensor0"),
        ("Tensor1", None),
        ("Tensor2", None),
    ]


def test_numbers_follow_the_devices_as_printed(capsys: pytest.CaptureFixture[str]) -> None:
    # Largest first, the scan alternates devices; the report groups them, first seen first.
    tensors = [
        torch.empty(1024, device="meta"),
        torch.zeros(512),
        torch.empty(256, device="meta"),
        torch.zeros(128),
    ]
    MemReporter(objects=only(*tensors)).report()
    assert capsys.readouterr().out == HEADER + block(
        "meta",
        "Tensor0                                              (1024,)     0.00B\n"
        "Tensor1                                               (256,)     0.00B\n",
        "Total Tensors: 1280 \tUsed Memory: 0.00B",
    ) + block(
        "cpu",
        "Tensor2                                               (512,)     2.00K\n"
        "Tensor3                                               (128,)   512.00B\n",
        "Total Tensors: 640 \tUsed Memory: 2.50K",
    )


def test_a_0_d_tensor_has_an_empty_size_as_in_its_record(
    capsys: pytest.CaptureFixture[str],
) -> None:
    scalar = torch.tensor(2.0, dtype=torch.float64)
    reporter = MemReporter(objects=only(scalar))
    reporter.report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Tensor0                                                   ()     8.00B\n",
        "Total Tensors: 1 \tUsed Memory: 8.00B",
    )
    (record,) = reporter.snapshot()
    assert (record.shape, record.numel, record.nbytes) == ((), 1, 8)
    assert "<td>()</td><td>torch.float64</td><td>8.00B</td>" in reporter.display()._repr_html_()


class Hostile(torch.Tensor):
    """A subclass whose __torch_function__ refuses everything, attribute reads included."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("refused")


class Unflattenable(torch.Tensor):
    """A wrapper subclass that cannot give its inner tensors."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self):
        raise RuntimeError("cannot flatten")

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        raise RuntimeError("cannot unflatten")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("refused")


class Nowhere(torch.Tensor):
    """A subclass that cannot say which device it is on."""

    @property
    def device(self):
        raise RuntimeError("nowhere")


def test_subclasses_that_refuse_to_be_read_are_counted_or_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hostile = torch.zeros(4).as_subclass(Hostile)  # its own storage: counted exactly
    unflattenable = Unflattenable(torch.zeros(5))  # listed, not counted
    nowhere = torch.zeros(6).as_subclass(Nowhere)  # no device: not listed
    plain = torch.zeros(2)
    reporter = MemReporter(objects=only(hostile, unflattenable, nowhere, plain))
    reporter.report()
    assert capsys.readouterr().out == HEADER + block(
        "cpu",
        "Unflattenable0                                          (5,)         ?\n"
        "Hostile1                                                (4,)    16.00B\n"
        "Tensor2                                                 (2,)     8.00B\n",
        "Total Tensors: 6 \tUsed Memory: 24.00B",
        "Unflattenable0: not counted, unreadable: RuntimeError: cannot flatten\n",
    )
    assert [(r.name, r.kind, r.nbytes) for r in reporter.snapshot()] == [
        ("Unflattenable0", "Unflattenable", 0),
        ("Hostile1", "Hostile", 16),
        ("Tensor2", "Tensor", 8),
    ]


def test_diff_lists_what_appeared_and_disappeared() -> None:
    kept, dropped = torch.zeros(16), torch.zeros(256)
    tensors = [kept, dropped]
    reporter = MemReporter(objects=lambda: list(tensors))
    before = reporter.snapshot()
    tensors[1] = torch.zeros(1024, 1024)
    del dropped
    difference = reporter.diff(before)
    assert [r.name for r in difference.appeared] == ["Tensor0"]
    assert [r.name for r in difference.disappeared] == ["Tensor0"]
    assert str(difference) == (
        HEADER + RULE + "+ Tensor0 [cpu]                                 (1024, 1024)     4.00M\n"
        "- Tensor0 [cpu]                                       (256,)     1.00K\n"
        + RULE
        + "Appeared: 1 (4.00M) \tDisappeared: 1 (1.00K)\n"
        + RULE
    )
    now = reporter.snapshot()
    assert diff(now, now).appeared == diff(now, now).disappeared == ()


def test_to_dataframe_has_a_row_per_tensor() -> None:
    whole = torch.zeros(4, dtype=torch.float64)
    view = whole[1:]
    frame = MemReporter(objects=only(whole, view)).to_dataframe()
    assert list(frame.columns) == [
        "name",
        "device",
        "shape",
        "dtype",
        "layout",
        "kind",
        "numel",
        "nbytes",
        "owner",
        "note",
    ]
    frame["owner"] = frame["owner"].astype(object).where(frame["owner"].notna(), None)
    assert frame.to_dict("records") == [
        {
            "name": "Tensor0",
            "device": "cpu",
            "shape": (4,),
            "dtype": "torch.float64",
            "layout": "torch.strided",
            "kind": "Tensor",
            "numel": 4,
            "nbytes": 32,
            "owner": None,
            "note": None,
        },
        {
            "name": "Tensor1",
            "device": "cpu",
            "shape": (3,),
            "dtype": "torch.float64",
            "layout": "torch.strided",
            "kind": "Tensor",
            "numel": 3,
            "nbytes": 0,
            "owner": "Tensor0",
            "note": None,
        },
    ]


def test_device_filter(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    hide_gpus(monkeypatch)
    kept = [torch.zeros(4), torch.empty(4, device="meta")]
    reporter = MemReporter(objects=only(*kept))
    reporter.report(device="meta")
    assert capsys.readouterr().out == HEADER + block(
        "meta",
        "Tensor0                                                 (4,)     0.00B\n",
        "Total Tensors: 4 \tUsed Memory: 0.00B",
    )
    reporter.report(device="cuda")
    assert capsys.readouterr().out == HEADER  # nothing there: the header only


def test_html_and_report_object() -> None:
    linear = torch.nn.Linear(2, 2)
    report = MemReporter(linear, objects=only()).display()
    assert isinstance(report, TensorReport)
    assert (
        str(report)
        == repr(report)
        == HEADER
        + block(
            "cpu",
            "weight                                                (2, 2)    16.00B\n"
            "bias                                                    (2,)     8.00B\n",
            "Total Tensors: 6 \tUsed Memory: 24.00B",
        )
    )
    page = report._repr_html_()
    assert "<h4>Storage on cpu</h4>" in page
    assert "<td>(2, 2)</td><td>torch.float32</td><td>16.00B</td>" in page
    assert "Total Tensors: 6, Used Memory: 24.00B" in page
    assert len(report.to_dataframe()) == 2


class Touchy:
    """An object that raises when asked its class, as some proxies do."""

    @property
    def __class__(self):
        raise RuntimeError("do not touch")


def test_the_scan_skips_objects_it_cannot_read() -> None:
    tensor = torch.zeros(2)
    target = torch.zeros(1)
    proxy = weakref.proxy(target)
    del target  # the proxy is dead: asking it anything raises ReferenceError
    records = MemReporter(objects=lambda: [proxy, Touchy(), tensor]).snapshot()
    assert [(r.name, r.nbytes) for r in records] == [("Tensor0", 8)]
    # The default scan (every object in the process) survives the whole test process.
    assert all(isinstance(r, TensorRecord) for r in MemReporter(pre_collect=True).snapshot())


def compile_then_report() -> list:
    """Live fake tensors after a first torch.compile (inductor, a cold cache) and its
    caches' reset, and the kinds of tensor the default report lists then."""
    import gc
    import os
    import tempfile

    import torch._dynamo
    from torch._subclasses.fake_tensor import FakeTensor

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    model = torch.nn.Linear(4, 4)
    torch.compile(model)(torch.randn(2, 4)).sum().backward()
    torch._dynamo.reset()
    gc.collect()
    fakes = sum(type(o) is FakeTensor for o in gc.get_objects())
    return [fakes, sorted({record.kind for record in MemReporter().snapshot()})]


@pytest.mark.slow
def test_the_fake_tensors_torch_compile_keeps_alive_are_not_reported() -> None:
    fakes, kinds = call_in_fresh_process_without_gpu(compile_then_report)
    assert fakes > 100  # its pattern matcher's examples, kept for the process's life
    assert "Parameter" in kinds and "FakeTensor" not in kinds


def test_cuda_totals_come_from_memory_allocated(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = CudaStandIn([StandInGpu(gpu_uuid(0))]).install(monkeypatch, environ=False)
    with FakeTensorMode():
        fake = torch.empty(250, device="cuda")  # 1,000 bytes: a 1,024-byte block
    reporter = MemReporter(objects=only(fake))
    reporter.report()
    assert ("memory_allocated", 0) in cuda.calls
    cuda.alloc(0, 1000)
    reporter.report()
    rows = "FakeTensor0                                           (250,)     1.00K\n"
    total = "Total Tensors: 250 \tUsed Memory: 1.00K"
    assert capsys.readouterr().out == (
        HEADER
        + block(
            "cuda:0",
            rows,
            total,
            "The allocated memory on cuda:0: 0.00B\n"
            "Memory differs due to the matrix alignment or invisible gradient buffer tensors\n",
        )
        + HEADER
        + block("cuda:0", rows, total, "The allocated memory on cuda:0: 1.00K\n")
    )


def readme_example() -> str:
    import contextlib
    import io

    from torchmem import MemReporter

    linear = torch.nn.Linear(1024, 1024)
    inp = torch.zeros(512, 1024)
    reporter = MemReporter(linear)
    out = linear(inp).mean()
    out.backward()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        reporter.report()
    return text.getvalue()


@pytest.mark.slow
def test_every_tensor_in_a_fresh_process() -> None:
    assert call_in_fresh_process_without_gpu(readme_example) == HEADER + block(
        "cpu",
        "weight                                          (1024, 1024)     4.00M\n"
        "weight.grad                                     (1024, 1024)     4.00M\n"
        "bias                                                 (1024,)     4.00K\n"
        "bias.grad                                            (1024,)     4.00K\n"
        "Tensor0                                          (512, 1024)     2.00M\n"
        "Tensor1                                                   ()     4.00B\n",
        "Total Tensors: 2623489 \tUsed Memory: 10.01M",
    )


def test_records_are_complete_frozen_dataclasses() -> None:
    kept = torch.zeros(1024, 1024)
    (record,) = MemReporter(objects=lambda: [kept]).snapshot()
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(TensorRecord)}
    assert record == TensorRecord(**fields)
    assert hash(record) == hash(TensorRecord(**fields))
    assert (record.name, record.shape, record.nbytes, record.numel) == (
        "Tensor0",
        (1024, 1024),
        4_194_304,
        1_048_576,
    )
    assert record.tensor is not None and record.tensor() is kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.nbytes = 0  # type: ignore[misc]
