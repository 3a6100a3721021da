"""Hostile memory snapshots: each is refused in one line (SnapshotError; the command prints
one line and exits 1), in time and memory bounded by the file's size, and nothing from it
runs; names that are not UTF-8 are written, escaped, where reports go."""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import threading
import tracemalloc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchmem.cli import main
from torchmem.errors import SnapshotError
from torchmem.records.frames import stack_site
from torchmem.records.run import DeviceRun, Site, SiteStack
from torchmem.records.snapshot_file import MAX_TUPLE_DEPTH, SnapshotUnpickler
from torchmem.snapshot import MAX_STACK_FRAMES, Snapshot, load_snapshot

pytestmark = pytest.mark.integration

NOT_UTF8 = os.fsdecode(b"/tmp/x\xff/train.py")
"""A script's path in a folder whose name is not UTF-8, as Python names it (U+DCFF)."""


def block(size: int, frames: object = (), **more: Any) -> dict[str, Any]:
    return {"address": 0, "size": size, "state": "active_allocated", "frames": frames, **more}


def segment(*blocks: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"device": 0, "address": 0, "total_size": 512, "blocks": list(blocks), **more}


def entry(action: str, **more: Any) -> dict[str, Any]:
    return {"action": action, "addr": 0, "size": 512, "time_us": 1, **more}


def written(tmp_path: Path, content: bytes | object, name: str = "evil.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else pickle.dumps(content))
    return path


def refused_in_one_line(path: Path, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`load_snapshot` raises SnapshotError(`message`), and the command prints it, one line,
    exit code 1."""
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    assert str(caught.value) == message
    capsys.readouterr()
    assert main(["snapshot", str(path)]) == 1
    assert capsys.readouterr() == ("", f"torchmem snapshot: error: {message}\n")


# -- memory and time bounded by the file's size ------------------------------------------

MEMO = {
    "LONG_BINPUT": b"\x80\x02Nr" + struct.pack("<I", 2**26) + b".",
    "PUT": b"\x80\x02Np67108864\n.",
}
"""Pickles that store None at memo index 2**26: the unpickler would make the memo an array
of 2**27 entries (1 GiB) before anything else."""


@pytest.mark.parametrize("opcode", sorted(MEMO))
def test_a_memo_index_past_what_the_file_can_make_is_refused(
    tmp_path: Path, opcode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, MEMO[opcode])
    assert len(MEMO["LONG_BINPUT"]) == 9
    message = (
        f"{path} is not a pickle: at byte 3 it stores memo entry 67108864, more than the"
        " objects it can have made by then"
    )
    refused_in_one_line(path, message, capsys)


def test_the_9_byte_file_takes_no_memory(tmp_path: Path) -> None:
    """Python's allocator traced while it is read: its memo took 1 GiB."""
    path = written(tmp_path, MEMO["LONG_BINPUT"])
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with pytest.raises(SnapshotError):
            load_snapshot(path)
        grown = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    assert grown < 2**20


@pytest.mark.parametrize(
    ("content", "at"),
    [
        (b"\x80\x04\x8d" + struct.pack("<Q", 2**40) + b"abc.", 2),  # BINUNICODE8 of 1 TiB
        (b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.", 2),  # a FRAME of 1 TiB
        (b"\x80\x02X" + struct.pack("<I", 2**31) + b"N.", 2),  # BINUNICODE of 2 GiB
    ],
)
def test_a_length_past_the_end_of_the_file_is_refused(
    tmp_path: Path, content: bytes, at: int, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, content)
    message = f"{path} is not a pickle: the opcode at byte {at} runs past its end"
    refused_in_one_line(path, message, capsys)


def shared_stack(devices: int, blocks: int, frames: int) -> dict[str, Any]:
    """`blocks` blocks on each of `devices` devices, all with one list of `frames` frames
    (the same dict each time): the pickle holds each once and refers to it."""
    one = {"filename": "/home/me/train.py", "line": 1, "name": "f"}
    stack = [one] * frames
    return {
        "segments": [
            {
                "device": d,
                "address": 0,
                "total_size": 512 * blocks,
                "blocks": [{**block(512, stack), "address": 512 * j} for j in range(blocks)],
            }
            for d in range(devices)
        ]
    }


def test_a_frame_list_shared_by_a_thousand_blocks_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """219 KiB: one 100,000-frame list shared by 1,000 blocks. Its site is found once, not
    once a block (a minute and more)."""
    path = written(tmp_path, shared_stack(1, 1000, 100_000))
    assert path.stat().st_size < 220 * 2**10
    found = []

    def counted(frames: Any) -> Any:
        found.append(len(frames))
        return stack_site(frames)

    monkeypatch.setattr("torchmem.snapshot.stack_site", counted)
    (site,) = load_snapshot(path).devices[0].sites
    assert found == [100_000]
    assert site == Site("/home/me/train.py", 1, "f", 512 * 1000)
    assert site.stack == (("/home/me/train.py", 1, "f"),) * 100_000


def test_one_long_stack_on_many_devices_is_kept_up_to_the_limit(tmp_path: Path) -> None:
    """A site on each of 30 devices, all with one 100,000-frame stack: their reports (JSON,
    HTML) would hold 3,000,000 frames from a 200 KiB file; MAX_STACK_FRAMES are kept, in
    device order, and the sites past them keep none."""
    path = written(tmp_path, shared_stack(30, 1, 100_000))
    devices = load_snapshot(path).devices.values()
    kept = MAX_STACK_FRAMES // 100_000
    assert [len(s.stack) for d in devices for s in d.sites] == [100_000] * kept + [0] * (30 - kept)
    assert [s.bytes for d in devices for s in d.sites] == [512] * 30


def test_the_command_makes_json_only_for_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = written(tmp_path, shared_stack(2, 1, 10))

    def unwanted(self: Snapshot) -> Any:
        raise AssertionError("the JSON was made")

    monkeypatch.setattr(Snapshot, "to_json", unwanted)
    assert main(["snapshot", str(path)]) == 0
    assert "Allocation sites in use at the snapshot on cuda:1:" in capsys.readouterr().out


# -- tuples nested deep ----------------------------------------------------------------------


def too_deep(path: Path | str, at: int) -> str:
    """What a file whose tuples nest deeper than the limit is refused with."""
    return (
        f"{path} is not a memory snapshot: its tuples nest deeper than {MAX_TUPLE_DEPTH}"
        f" (at byte {at})"
    )


def test_a_tuple_nested_200000_deep_as_a_key_is_refused_without_a_crash(tmp_path: Path) -> None:
    """A 200 KB dict whose key is None in 200,000 tuples: hashing the key overflows CPython's
    C stack while it is unpickled, and the process dies. Read in a child process, where a
    crash fails the test instead of ending pytest; refused at byte 104, its 101st TUPLE1."""
    path = written(tmp_path, b"\x80\x02}N" + b"\x85" * 200_000 + b"Ns.")
    assert path.stat().st_size < 200 * 2**10
    command = [sys.executable, "-m", "torchmem", "snapshot", path.name]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"torchmem snapshot: error: {too_deep(path.name, 104)}\n"


DEEP_150 = {
    "TUPLE1 after TUPLE1, the stream cut short": (b"\x80\x02}N" + b"\x85" * 150 + b"Ns", 104),
    "TUPLE after MARK": (b"\x80\x02}" + b"(" * 150 + b"N" + b"t" * 150 + b"Ns.", 254),
    "protocol 0": (b"(" * 150 + b"I1\n" + b"t" * 150 + b".", 253),
    "DUP then TUPLE2": (b"\x80\x02}N\x85" + b"2\x86" * 150 + b"Ns.", 204),
    "the memo's tuple twice, stored again": (
        b"\x80\x02}N\x85q\x00" + b"h\x00h\x00\x86q\x00" * 150 + b"h\x00Ns.",
        704,
    ),
    "in a frozenset": (b"\x80\x04(N" + b"\x85" * 150 + b"\x91.", 104),
}
"""Tuples nested 150 deep (hashing them is safe: any test that fails, fails alone), and
the byte of the tuple that is 101 deep."""


@pytest.mark.parametrize("case", sorted(DEEP_150))
def test_tuples_nested_past_the_limit_are_refused(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    content, at = DEEP_150[case]
    path = written(tmp_path, content)
    refused_in_one_line(path, too_deep(path, at), capsys)


def nested(depth: int) -> object:
    """0 in `depth` tuples."""
    found: object = 0
    for _ in range(depth):
        found = (found,)
    return found


@pytest.mark.parametrize("walked", [False, True], ids=["counted", "walked"])
def test_a_snapshot_whose_tuples_nest_as_deep_as_the_limit_loads(
    tmp_path: Path, walked: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tuple MAX_TUPLE_DEPTH deep, as a dict's key, loads: as is, under the limit of the
    tuples that may hold tuples; and with 200 tuples of strings besides, each read then.
    One deeper is refused, at the TUPLE1 that makes it."""
    strings = [(f"s{i}",) for i in range(200 if walked else 0)]
    data = {"segments": [], "key": {nested(MAX_TUPLE_DEPTH): 1}, "strings": strings}
    path = written(tmp_path, data)
    assert load_snapshot(path) == Snapshot.from_dict(data, str(path))
    data["key"] = {nested(MAX_TUPLE_DEPTH + 1): 1}
    content = pickle.dumps(data)
    ops = pickletools.genops(content)
    tuples = [at for op, _, at in ops if op.name == "TUPLE1" and at is not None]
    path = written(tmp_path, content)
    refused_in_one_line(path, too_deep(path, tuples[MAX_TUPLE_DEPTH]), capsys)


def test_a_second_pickle_that_nests_the_firsts_tuple_deeper_is_refused() -> None:
    """The second pickle reads the first's memo: its tuple 60 deep, in 60 more tuples. The
    41st TUPLE1 (4 bytes into the second pickle) makes it 101 deep."""
    first = b"\x80\x02K\x00" + b"\x85" * 60 + b"q\x00."
    second = b"\x80\x02h\x00" + b"\x85" * 60 + b"."
    unpickler = SnapshotUnpickler(io.BytesIO(first + second), "two")
    assert unpickler.load() == nested(60)
    with pytest.raises(SnapshotError) as caught:
        unpickler.load()
    assert str(caught.value) == too_deep("two", len(first) + 4 + 40)


def test_lists_and_dicts_nested_200000_deep_are_read_without_a_crash(tmp_path: Path) -> None:
    """Hashing stops at a list or dict, and CPython frees them without recursing: as a
    snapshot's unknown keys, they are read (in a child process, where a crash fails the
    test); as the whole file, a list is not a snapshot."""
    lists = b"]" * 200_000 + b"a" * 199_999
    dicts = b"}" + b"K\x00}" * 200_000 + b"s" * 200_000
    content = b"\x80\x04}(\x8c\x08segments]\x8c\x05lists" + lists + b"\x8c\x05dicts" + dicts
    written(tmp_path, content + b"u.", "deep.pickle")
    written(tmp_path, b"\x80\x04" + lists + b".", "list.pickle")
    command = [sys.executable, "-m", "torchmem", "snapshot"]
    done = subprocess.run(
        [*command, "deep.pickle"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "The snapshot holds no segments and no trace." in done.stdout
    done = subprocess.run(
        [*command, "list.pickle"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "torchmem snapshot: error: list.pickle is not a memory snapshot: it holds a list, not"
        " a dict\n"
    )


# -- numbers and files that are not a snapshot's ------------------------------------------

HUGE = 2**2000


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"segments": [segment(total_size=HUGE)]}, "segment 0 has a bad 'total_size'"),
        ({"segments": [segment(address=HUGE)]}, "segment 0 has a bad 'address'"),
        ({"segments": [segment(device=-1)]}, "segment 0 has a bad 'device'"),
        ({"segments": [segment(stream=2**63)]}, "segment 0 has a bad 'stream'"),
        ({"segments": [segment(block(HUGE))]}, "segment 0, block 0 has a bad 'size'"),
        ({"segments": [segment(block(-512))]}, "segment 0, block 0 has a bad 'size'"),
        (
            {"segments": [segment(block(512, None, history={1: 2}))]},
            "segment 0, block 0 has a bad 'history'",
        ),
        (
            {"segments": [segment(block(512, [{"filename": "a.py", "line": HUGE, "name": ""}]))]},
            "segment 0, block 0 has a bad 'line'",
        ),
        (
            {"segments": [], "device_traces": [[entry("alloc", size=HUGE)]]},
            "entry 0 of the trace of device 0 has a bad 'size'",
        ),
        (
            {"segments": [], "device_traces": [[entry("alloc", addr=-1)]]},
            "entry 0 of the trace of device 0 has a bad 'addr'",
        ),
        (
            {
                "segments": [],
                "device_traces": [[entry("alloc"), entry("free_requested", time_us=HUGE)]],
            },
            "entry 1 of the trace of device 0 has a bad 'time_us'",
        ),
        (
            {"segments": [], "device_traces": [[entry("oom", device_free=HUGE)]]},
            "entry 0 of the trace of device 0 has a bad 'device_free'",
        ),
    ],
)
def test_a_number_pytorch_never_writes_is_refused(
    tmp_path: Path, data: dict[str, Any], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every number of a snapshot is an int64 of PyTorch's, and none is negative: 2**2000
    would overflow a float, a negative device index would pick a device from the end."""
    path = written(tmp_path, data)
    refused_in_one_line(path, f"{path} is not a memory snapshot: {why}", capsys)


def in_a_thread(path: Path) -> BaseException | None:
    """What `load_snapshot(path)` raised, in a thread given 10 s (a FIFO blocked it)."""
    found: list[BaseException | None] = []

    def load() -> None:
        try:
            load_snapshot(path)
            found.append(None)
        except BaseException as exc:
            found.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    assert found, f"load_snapshot({path}) is still waiting"
    return found[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    """Opened to read, a FIFO waits for a writer: forever."""
    fifo = tmp_path / "snapshot.pickle"
    os.mkfifo(fifo)
    found = in_a_thread(fifo)
    assert isinstance(found, SnapshotError)
    assert str(found) == f"{fifo} is not a memory snapshot: it is a FIFO, not a regular file"
    command = [sys.executable, "-m", "torchmem", "snapshot", fifo.name]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        "",
        "torchmem snapshot: error: snapshot.pickle is not a memory snapshot: it is a FIFO, not"
        " a regular file\n",
    )


def test_a_directory_and_a_device_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"{tmp_path} is not a memory snapshot: it is a directory, not a regular file"
    refused_in_one_line(tmp_path, message, capsys)
    if os.name == "posix":
        message = "/dev/null is not a memory snapshot: it is a character device, not a regular file"
        refused_in_one_line(Path(os.devnull), message, capsys)


# -- nothing runs ----------------------------------------------------------------------------

EXT_CODE = 0xF0
"""An extension code of copyreg's private range (240 to 255)."""
EXT = b"\x80\x02\x82" + bytes([EXT_CODE]) + b")R."
"""EXT1 240, an empty tuple, REDUCE: calls what code 240 names."""


@pytest.fixture
def an_extension(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """A process where copyreg maps EXT_CODE to a callable that records its calls, and
    a plain pickle.loads has used it (so copyreg's cache holds it); undone after."""
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("torchmem_test_extension")
    module.__dict__["record"] = lambda *args: calls.append(args)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    copyreg.add_extension(module.__name__, "record", EXT_CODE)
    try:
        pickle.loads(EXT)
        assert calls == [()]
        calls.clear()
        yield calls
    finally:
        copyreg.remove_extension(module.__name__, "record", EXT_CODE)


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (EXT, EXT_CODE),
        (b"\x80\x02\x83" + struct.pack("<H", EXT_CODE) + b")R.", EXT_CODE),
        (b"\x80\x02\x84" + struct.pack("<i", EXT_CODE) + b")R.", EXT_CODE),
        (b"\x80\x02\x84" + struct.pack("<i", -1) + b")R.", -1),
    ],
)
def test_an_extension_code_is_refused_and_nothing_runs(
    tmp_path: Path,
    an_extension: list[tuple[Any, ...]],
    content: bytes,
    code: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """CPython's unpickler takes a cached extension from copyreg without asking
    find_class: an EXT opcode would run what the process registered."""
    path = written(tmp_path, content)
    message = (
        f"refused to load {path}: it asks for extension code {code}, and a snapshot holds"
        " plain data only; nothing from it was run"
    )
    refused_in_one_line(path, message, capsys)
    assert an_extension == []


def test_a_second_pickle_in_the_file_is_checked_too(an_extension: list[tuple[Any, ...]]) -> None:
    """An unpickler loads one pickle after another from a file: each is checked first."""
    unpickler = SnapshotUnpickler(io.BytesIO(pickle.dumps({"segments": []}) + EXT), "two")
    assert unpickler.load() == {"segments": []}
    with pytest.raises(SnapshotError) as caught:
        unpickler.load()
    assert str(caught.value) == (
        "refused to load two: it asks for extension code 240, and a snapshot holds plain data"
        " only; nothing from it was run"
    )
    assert an_extension == []


def test_a_long_persistent_id_is_named_short(tmp_path: Path) -> None:
    path = written(tmp_path, b"\x80\x02X" + struct.pack("<I", 10_000) + b"x" * 10_000 + b"Q.")
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    short = "'" + "x" * 12 + "..." + "x" * 13 + "'"
    assert str(caught.value) == (
        f"refused to load {path}: it asks for a persistent object {short}, and a snapshot"
        " holds plain data only; nothing from it was run"
    )


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_of_plain_data_loads(tmp_path: Path, protocol: int) -> None:
    """Each protocol's opcodes, with more than 256 memo entries (LONG_BINPUT, or PUT), long
    integers, strings and floats, as the unpickler reads them."""
    data: dict[str, Any] = {
        "segments": [
            {**segment(block(512, [{"filename": f"/m/{i}.py", "line": i, "name": "f"}])), "i": i}
            for i in range(300)
        ],
        "device_traces": [[entry("alloc", addr=2**62, time_us=2**50, note="é" * 300)]],
        "other": [1.5, -(2**70), None, True, (1, 2), (1, 2, 3, 4), "x" * 70_000],
    }
    path = written(tmp_path, pickle.dumps(data, protocol=protocol))
    assert load_snapshot(path) == Snapshot.from_dict(data, str(path))


# -- names that are not UTF-8 ----------------------------------------------------------------


def not_utf8_snapshot() -> dict[str, Any]:
    frames = [{"filename": NOT_UTF8, "line": 3, "name": "main"}]
    return {
        "segments": [segment(block(512, frames))],
        "device_traces": [[entry("alloc", frames=frames)]],
    }


def test_a_file_name_that_is_not_utf8_is_written_escaped(tmp_path: Path) -> None:
    snapshot = Snapshot.from_dict(not_utf8_snapshot(), os.fsdecode(b"s\xff.pickle"))
    page = tmp_path / "page.html"
    snapshot.save_html(page)
    text = page.read_text(encoding="utf-8")
    assert "<title>torchmem: memory snapshot of s\\xff.pickle</title>" in text
    assert "/tmp/x\\xff/train.py:3" in text
    assert "  512.00B  /tmp/x\\xff/train.py:3  main" in str(snapshot).splitlines()
    assert json.loads(json.dumps(snapshot.to_json()))["devices"]["0"]["sites"][0] == {
        "file": NOT_UTF8,
        "line": 3,
        "function": "main",
        "bytes": 512,
        "stack": [[NOT_UTF8, 3, "main"]],
        "stacks": [{"bytes": 512, "stack": [[NOT_UTF8, 3, "main"]]}],
        "source": None,  # no such file to read the line from
    }


def test_the_command_writes_names_that_are_not_utf8(tmp_path: Path) -> None:
    """Out through a strict UTF-8 stdout, into the JSON (as escapes) and the page."""
    folder = tmp_path / os.fsdecode(b"d\xff")
    try:
        folder.mkdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes UTF-8 names only")
    written(folder, not_utf8_snapshot(), "s.pickle")
    command = [sys.executable, "-m", "torchmem", "snapshot", "--json", "o.json"]
    command += ["--html", "o.html", os.path.join(folder.name, "s.pickle")]
    environment = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torchmem: memory snapshot of d\\xff/s.pickle"
    assert "  512.00B  /tmp/x\\xff/train.py:3  main" in lines
    assert json.loads((tmp_path / "o.json").read_text())["source"] == os.fsdecode(b"d\xff/s.pickle")
    page = (tmp_path / "o.html").read_text(encoding="utf-8")
    assert "<title>torchmem: memory snapshot of d\\xff/s.pickle</title>" in page


def test_a_run_report_of_a_script_in_a_folder_that_is_not_utf8(tmp_path: Path) -> None:
    from torchmem import RunReport

    site = Site(NOT_UTF8, 3, "<module>", 512, (SiteStack(512, ((NOT_UTF8, 3, "<module>"),)),))
    cpu = DeviceRun("cpu", 0, 512, 1.0, 0, ((1.0, 512),), sites_at_peak=(site,))
    report = RunReport({"cpu": cpu}, (), 1.0, 0, (NOT_UTF8,))
    report.save_html(tmp_path / "run.html")
    page = (tmp_path / "run.html").read_text(encoding="utf-8")
    assert (
        "<title>torchmem: where the memory went: &#x27;/tmp/x\\xff/train.py&#x27;</title>" in page
    )
    assert "/tmp/x\\xff/train.py:3" in page
    report.save_json(tmp_path / "run.json")
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["command"] == [NOT_UTF8]
    assert saved["sites_at_peak"][0]["file"] == NOT_UTF8
