"""Storages that PyTorch's CPU allocator does not make, on the counting allocator's meter:
shared memory, mapped files, DataLoader workers' batches. Exact bytes, counted while a
window is open, counted off when the memory really goes, and PyTorch's functions as they
were whenever nothing measures."""

from __future__ import annotations

import gc
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from standins import MiB
from torchmem import MemTrace, meter
from torchmem.meters import Meter

pytestmark = pytest.mark.counting

WRAPPED = ("_new_shared_fd_cpu", "_share_fd_cpu_", "_new_using_fd_cpu", "from_file")
PYTORCHS = {name: vars(torch.UntypedStorage).get(name) for name in WRAPPED}
PYTORCHS_FROM_FILE = torch.from_file


def pytorchs_own() -> bool:
    """Whether the functions wrapped while something measures are PyTorch's."""
    mine = {name: vars(torch.UntypedStorage).get(name) for name in WRAPPED}
    return mine == PYTORCHS and torch.from_file is PYTORCHS_FROM_FILE


@pytest.fixture
def cpu() -> Meter:
    gc.collect()
    return meter("cpu")


def change(cpu: Meter, fn):
    """Run `fn` in a window: (used at the end - start, peak - start, what fn gave)."""
    gc.disable()
    try:
        with cpu.window() as w:
            assert not pytorchs_own()
            kept = fn()
        return cpu.used() - w.start, w.peak() - w.start, kept
    finally:
        gc.enable()


def mapped(address: int) -> bool:
    """Whether `address` is in a mapping of this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(part, 16) for part in line.split()[0].split("-"))
        if low <= address < high:
            return True
    return False


@pytest.fixture
def floats(tmp_path: Path) -> Path:
    """A file of 1,048,576 float32 (4 MiB): 0, 1, 2, ..."""
    path = tmp_path / "floats.bin"
    torch.arange(MiB, dtype=torch.float32).numpy().tofile(path)
    return path


def test_share_memory_counts_both_copies_while_it_copies_then_the_shared_one(cpu):
    t = torch.ones(1024, 1024)
    assert change(cpu, t.share_memory_)[:2] == (0, 4 * MiB)
    assert t.is_shared() and t.sum().item() == 1024 * 1024
    before = cpu.used()
    del t  # after the window: counted until it dies, whatever measures then
    assert before - cpu.used() == 4 * MiB
    assert pytorchs_own()


def test_a_shared_storage_is_counted_off_when_its_memory_is_unmapped(cpu):
    """PyTorch keeps a storage's Python object as long as C++ holds the storage (here a
    view's tensor, then autograd's saved tensor): the count falls with the mapping."""
    t = torch.ones(MiB)
    w = torch.ones(MiB - 16, requires_grad=True)
    with cpu.window():
        t.share_memory_()
        address = t.untyped_storage().data_ptr()
        loss = (t[16:] * w).sum()  # autograd saves the view, for w's gradient
        del t
        gc.collect()
        held = cpu.used()
        assert mapped(address)
        loss.backward()  # frees what autograd saved, and makes w's gradient
        assert w.grad is not None
        assert held + w.grad.nbytes - cpu.used() == 4 * MiB
        assert not mapped(address)


def test_torch_from_file_counts_the_file_it_maps(cpu, floats):
    used, peak, t = change(cpu, lambda: torch.from_file(str(floats), size=MiB, dtype=torch.float32))
    assert (used, peak) == (4 * MiB, 4 * MiB)
    assert t[12345].item() == 12345
    before = cpu.used()
    del t
    assert before - cpu.used() == 4 * MiB


def test_untyped_storage_from_file_counts_its_bytes(cpu, floats):
    used, _, storage = change(cpu, lambda: torch.UntypedStorage.from_file(str(floats), False, 4096))
    assert used == 4096 and storage.nbytes() == 4096
    before = cpu.used()
    del storage
    assert before - cpu.used() == 4096


def test_torch_load_mmap_counts_the_file_until_its_last_tensor_dies(cpu, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"a": torch.ones(256, 256), "b": torch.zeros(1024)}, path)
    used, _, loaded = change(cpu, lambda: torch.load(path, mmap=True))
    assert used == path.stat().st_size  # one mapping of the whole file
    a = loaded.pop("a")
    del loaded
    gc.collect()
    before = cpu.used()
    assert a.sum().item() == 256 * 256
    del a
    assert before - cpu.used() == path.stat().st_size


def test_a_dataloader_workers_batch_counts_where_it_arrives(cpu):
    data = TensorDataset(torch.randn(256, 256), torch.arange(256))
    loader = DataLoader(data, batch_size=64, num_workers=2, multiprocessing_context="fork")
    with MemTrace(device="cpu", on_exit_report=False) as trace:
        x, y = next(iter(loader))
    assert x.is_shared() and y.is_shared()
    assert trace.used_bytes == 64 * 256 * 4 + 64 * 8
    before = cpu.used()
    del x, y
    assert before - cpu.used() == 64 * 256 * 4 + 64 * 8


def test_while_nothing_measures_nothing_is_wrapped_or_counted(cpu, floats):
    assert pytorchs_own()
    t = torch.ones(1024, 1024)
    before = cpu.used()
    t.share_memory_()  # leaves the allocator, and is not counted anywhere
    mapped_file = torch.from_file(str(floats), size=MiB, dtype=torch.float32)
    assert before - cpu.used() == 4 * MiB
    del t, mapped_file
    assert before - cpu.used() == 4 * MiB


def test_the_wrappers_raise_what_pytorch_raises(cpu, tmp_path):
    missing = str(tmp_path / "missing.bin")

    def error() -> tuple[type[BaseException], str]:
        with pytest.raises(RuntimeError) as caught:
            torch.from_file(missing, size=4, dtype=torch.float32)
        return caught.type, str(caught.value)

    assert change(cpu, error)[2] == error()
    assert pytorchs_own()


def test_the_wrappers_go_when_a_window_ends_by_an_error(cpu):
    with pytest.raises(KeyboardInterrupt), cpu.window():
        assert not pytorchs_own()
        raise KeyboardInterrupt
    assert pytorchs_own()


def _send_back(queue, answers) -> None:
    batch = queue.get()
    answers.put(float(batch.sum()))


def test_a_received_batch_is_still_pytorchs_to_share_again(cpu):
    """PyTorch finds a storage's shared memory from its deleter: the received batch goes
    on to another process as it would (is_shared, _share_fd_cpu_), with its value."""
    data = TensorDataset(torch.ones(64, 16))
    loader = DataLoader(data, batch_size=64, num_workers=1, multiprocessing_context="fork")
    context = torch.multiprocessing.get_context("fork")
    queue, answers = context.SimpleQueue(), context.SimpleQueue()
    with cpu.window():
        (batch,) = next(iter(loader))
        assert batch.is_shared()
        child = context.Process(target=_send_back, args=(queue, answers))
        child.start()
        queue.put(batch)
        assert answers.get() == 64 * 16
        child.join(60)
    assert child.exitcode == 0


def _is_pytorchs(answers) -> None:
    answers.put(pytorchs_own())


def test_a_forked_child_has_pytorchs_functions(cpu):
    context = multiprocessing.get_context("fork")
    answers = context.SimpleQueue()
    with cpu.window():
        child = context.Process(target=_is_pytorchs, args=(answers,))
        child.start()
        assert answers.get() is True
        child.join(60)
        assert not pytorchs_own()
    assert child.exitcode == 0


def test_a_storage_that_dies_in_another_thread_is_counted_off(cpu):
    t = torch.ones(MiB)
    with cpu.window():
        t.share_memory_()
    holder = [t]
    del t
    before = cpu.used()
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    assert before - cpu.used() == 4 * MiB


def test_a_recording_logs_each_at_the_line_that_brought_it_in(cpu, floats):
    import torchmem

    t = torch.ones(MiB)
    with torchmem.record("cpu") as rec:
        mapped_file = torch.from_file(str(floats), size=MiB, dtype=torch.float32)
        t.share_memory_()  # both copies while it copies: the peak
    run = rec.report().devices["cpu"]
    assert (run.peak_bytes - run.start_bytes, run.end_bytes - run.start_bytes) == (8 * MiB, 4 * MiB)
    sites = rec.sites_alive("cpu")
    lines = {ptr: (Path(site[0]).name, site[1]) for ptr, site in sites.items()}
    first = test_a_recording_logs_each_at_the_line_that_brought_it_in.__code__.co_firstlineno
    assert lines[mapped_file.untyped_storage().data_ptr()] == ("test_storages.py", first + 5)
    assert lines[t.untyped_storage().data_ptr()] == ("test_storages.py", first + 6)


def test_a_storage_brought_in_without_a_line_of_the_users_is_sited_past_torchmem(cpu, floats):
    """A thread running PyTorch's function itself: the innermost frame is the wrapper's,
    which names no site; the innermost of the others does."""
    import concurrent.futures

    import torchmem

    with torchmem.record("cpu") as rec, concurrent.futures.ThreadPoolExecutor(1) as pool:
        mapped_file = pool.submit(torch.from_file, str(floats), size=MiB, dtype=torch.float32)
        t = mapped_file.result()
    file, _, function = rec.sites_alive("cpu")[t.untyped_storage().data_ptr()]
    assert (Path(file).parts[-2:], function) == (("futures", "thread.py"), "_WorkItem.run")


@pytest.mark.cuda
def test_pinned_memory_counts_while_a_window_is_open(cpu):
    """Pinned memory comes from the accelerator's host allocator; pinning a pinned tensor
    gives the tensor itself, no new memory."""
    t = torch.ones(MiB)
    used, peak, pinned = change(cpu, t.pin_memory)
    assert pinned.is_pinned() and (used, peak) == (4 * MiB, 4 * MiB)
    assert change(cpu, pinned.pin_memory)[:2] == (0, 0)
    before = cpu.used()
    del pinned
    assert before - cpu.used() == 4 * MiB
    assert vars(torch.Tensor).get("pin_memory") is None  # PyTorch's own, from TensorBase


def test_a_function_the_program_replaced_meanwhile_stays_its_own(cpu):
    def programs(*args, **kwargs):
        return PYTORCHS_FROM_FILE(*args, **kwargs)

    try:
        with cpu.window():
            torch.from_file = programs
        assert torch.from_file is programs
    finally:
        torch.from_file = PYTORCHS_FROM_FILE
    assert pytorchs_own()
