"""The tensor meter: exact bytes of tensor storages, on any device, without a GPU."""

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from standins import MiB
from torchmem import TensorMeter


@pytest.fixture
def m():
    return TensorMeter("cpu")


def test_zeros_is_exactly_its_bytes(m):
    with m.window() as w:
        a = torch.zeros(1024, 1024)
        assert m.used() == 4_194_304
        assert w.peak() == 4_194_304
    assert w.start == 0
    del a
    assert m.used() == 0


def test_kept_plus_freed_temporary(m):
    with m.window() as w:
        kept = torch.empty(MiB, dtype=torch.float32)  # 4 MiB
        temp = torch.empty(2 * MiB, dtype=torch.float32)  # 8 MiB
        del temp
        assert m.used() - w.start == 4 * MiB
        assert w.peak() - w.start == 12 * MiB
    del kept


def test_views_and_in_place_ops_cost_nothing(m):
    with m.window() as w:
        a = torch.ones(256, 256)
        views = [a.view(-1), a[1:], a.t(), a.unsqueeze(0), a.detach(), a.as_strided((2,), (1,))]
        a.add_(1).mul_(2).clamp_(max=3)
        assert m.used() == w.peak() == 256 * 256 * 4
        a[0] = torch.tensor(5.0)  # a 4-byte tensor, copied in and freed
        assert m.used() == 256 * 256 * 4
        assert w.peak() == 256 * 256 * 4 + 4
    del a, views


def test_temporary_freed_inside_one_functional_call_shows_in_peak(m):
    logits = torch.randn(1024, 1024)
    target = torch.zeros(1024, dtype=torch.long)
    with m.window() as w:
        loss = F.cross_entropy(logits, target)
        # cross_entropy is log_softmax (a 4 MiB temporary) then nll_loss (a 4-byte loss
        # and a 4-byte total weight, which is dropped); only the loss stays.
        assert w.peak() == 4 * MiB + 4 + 4
        assert m.used() == 4
    del loss


def test_nested_windows_do_not_disturb_each_other(m):
    with m.window() as outer:
        spike = torch.empty(4 * MiB, dtype=torch.uint8)
        del spike
        with m.window() as inner:
            assert inner.peak() == 0
            small = torch.empty(MiB, dtype=torch.uint8)
            big = torch.empty(2 * MiB, dtype=torch.uint8)
            del big
            assert inner.start == 0
            assert inner.peak() == 3 * MiB
        assert outer.peak() == 4 * MiB  # the inner window's reset did not lower it
        another = torch.empty(6 * MiB, dtype=torch.uint8)
        assert outer.peak() == 7 * MiB
        assert inner.peak() == 3 * MiB  # closed: frozen
    del small, another


def test_restart_starts_the_peak_over(m):
    with m.window() as w:
        temp = torch.empty(4 * MiB, dtype=torch.uint8)
        del temp
        kept = torch.empty(MiB, dtype=torch.uint8)
        w.restart()
        assert (w.start, w.peak()) == (MiB, MiB)
        temp = torch.empty(2 * MiB, dtype=torch.uint8)
        del temp
        assert w.peak() == 3 * MiB
    del kept


def test_frees_after_the_window_still_count(m):
    with m.window():
        a = torch.empty(MiB, dtype=torch.uint8)
        b = a[10:]
    assert m.used() == MiB
    del a
    assert m.used() == MiB  # the view keeps the storage alive
    del b
    assert m.used() == 0


def test_only_allocations_while_watching_count(m):
    before = torch.empty(MiB, dtype=torch.uint8)
    with m.window():
        pass
    after = torch.empty(MiB, dtype=torch.uint8)
    assert m.used() == 0
    del before, after


def test_torch_tensor_counts_and_borrowed_numpy_memory_does_not(m):
    array = np.ones(1000)
    with m.window():
        owned = torch.tensor([1.0, 2.0, 3.0])
        borrowed = torch.from_numpy(array)
        assert m.used() == 12
    del owned, borrowed


def test_storage_grown_by_out_or_resize_counts_its_growth(m):
    a = torch.ones(1024)
    with m.window() as w:
        out = torch.empty(0)
        torch.add(a, a, out=out)
        assert m.used() == 4096
        out.resize_(2048)
        assert m.used() == w.peak() == 8192
    del out
    assert m.used() == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_sparse_tensors_count_their_indices_and_values(m):
    dense = torch.eye(4)
    with m.window():
        coo = dense.to_sparse()
        assert m.used() == 2 * 4 * 8 + 4 * 4  # int64 indices (2 x nnz) + float32 values
        del coo
        csr = dense.to_sparse_csr()
        # crow indices (5 x int64) and values (4 x float32) have storages of their own;
        # col indices are a view into the 2 x 4 int64 COO indices the conversion built.
        assert m.used() == 5 * 8 + 2 * 4 * 8 + 4 * 4
    del csr


def test_backward_counts_gradients(m):
    w = torch.randn(1024, requires_grad=True)
    with m.window() as window:
        (w * 2).sum().backward()
        assert m.used() == 4096  # w.grad
        # The product (4096) dies after sum(); then the 4-byte loss, the 4-byte output
        # gradient and the 4096-byte weight gradient are alive together.
        assert window.peak() == 4096 + 4 + 4
    w.grad = None
    assert m.used() == 0


def test_meta_tensors_count_their_nominal_bytes():
    m = TensorMeter("meta")
    with m.window():
        a = torch.empty(1024, 1024, device="meta")
        cpu = torch.empty(1024)
        assert m.used() == 4 * MiB  # the cpu tensor is another device
    del a, cpu


def test_fake_tensors_count_on_their_fake_device():
    cuda = TensorMeter("cuda")
    cpu = TensorMeter("cpu")
    assert cuda.device == "cuda:0"
    with FakeTensorMode(), cuda.window() as w, cpu.window():
        x = torch.empty(1024, 1024, device="cuda")
        y = x @ x
        del y
        assert cuda.used() == 4 * MiB
        assert w.peak() == 8 * MiB
        assert cpu.used() == 0
    del x


def test_two_meters_count_independently(m):
    other = TensorMeter("cpu")
    with m.window():
        a = torch.empty(MiB, dtype=torch.uint8)
        with other.window():
            b = torch.empty(2 * MiB, dtype=torch.uint8)
    assert (m.used(), other.used()) == (3 * MiB, 2 * MiB)
    del a, b


def test_other_threads_are_not_watched(m):
    kept = []
    with m.window():
        thread = threading.Thread(target=lambda: kept.append(torch.empty(MiB)))
        thread.start()
        thread.join()
        assert m.used() == 0


def test_the_dispatch_mode_is_removed_on_exit_error_and_interrupt(m):
    assert _get_current_dispatch_mode_stack() == []
    with m.window():
        assert len(_get_current_dispatch_mode_stack()) == 1
        with m.window():
            assert len(_get_current_dispatch_mode_stack()) == 1  # one mode per thread
    assert _get_current_dispatch_mode_stack() == []
    for error in (ValueError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)), m.window():
            raise error
        assert _get_current_dispatch_mode_stack() == []


def test_errors_from_operators_pass_through_untouched(m):
    with m.window(), pytest.raises(RuntimeError, match="size of tensor a"):
        torch.ones(2) + torch.ones(3)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_users_mode_keeps_working_whatever_the_order(m):
    user = Recorder()
    with user:
        with m.window():
            torch.ones(3)
        assert _get_current_dispatch_mode_stack() == [user]
    assert user.ops == [torch.ops.aten.ones.default]
    # Entered after our window and still open when it closes: it stays, and works.
    window = m.window()
    user = Recorder()
    user.__enter__()
    window.close()
    assert _get_current_dispatch_mode_stack() == [user]
    torch.zeros(2)
    user.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == []
    assert user.ops == [torch.ops.aten.zeros.default]


def test_a_window_closed_from_another_thread_stops_counting(m):
    window = m.window()
    thread = threading.Thread(target=window.close)
    thread.start()
    thread.join()
    a = torch.empty(MiB, dtype=torch.uint8)
    assert m.used() == 0
    del a
    with m.window():  # the owner thread takes the inactive mode off its stack
        assert len(_get_current_dispatch_mode_stack()) == 1
    assert _get_current_dispatch_mode_stack() == []


def test_index_less_cuda_without_cuda_is_device_zero():
    assert TensorMeter("cuda").device == "cuda:0"
    assert TensorMeter(torch.device("meta")).device == "meta"
    with pytest.raises(ValueError, match="'nodevice'"):
        TensorMeter("nodevice")
