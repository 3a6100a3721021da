"""Per-rank reports: the records, the imbalance, the text, and the launcher's store
(a real ``torch.distributed.TCPStore``, ranks as threads of this process).

``torchrun`` itself, with real processes, is in test_torchrun.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
import torch

import torchmem
from standins import GiB, MiB, StandInGpu, gpu_uuid, install_gpus
from torchmem.meters import nvml
from torchmem.ranks import Launch, RanksReport, _payload, assemble, gather_reports, imbalance
from torchmem.records.ranks import RankRun
from torchmem.records.run import DeviceRun, Held, ModulePeak, RunRecord, Site
from torchmem.render import ranks as render_ranks


def categories(**sizes: int) -> dict[str, int]:
    names = ("parameters", "gradients", "optimizer_state", "activations", "other")
    return {name: sizes.get(name, 0) for name in names}


def record(peak: int, *, device: str = "cpu", exit_code: int | None = 0, **sizes: int) -> RunRecord:
    run = DeviceRun(
        device,
        0,
        peak,
        0.5,
        peak // 2,
        ((0.5, peak), (1.0, peak // 2)),
        categories_at_peak=categories(**sizes) if sizes else None,
    )
    ram = DeviceRun("ram", 200 * MiB, 300 * MiB, 0.5, 250 * MiB, (), exact=True)
    return RunRecord({device: run, "ram": ram}, (), 1.0, exit_code=exit_code)


def payload(
    rank: int,
    report: RunRecord,
    error: str | None = None,
    host: str = "node1",
    gpus: dict[str, int] | None = None,
) -> dict:
    return {
        "rank": rank,
        "host": host,
        "error": error,
        "gpu_process_bytes": gpus or {},
        "report": report.to_json(),
    }


def test_a_report_survives_its_json_unchanged() -> None:
    run = DeviceRun(
        "cuda:0",
        1,
        10 * MiB,
        0.25,
        2,
        ((0.1, 3), (0.25, 10 * MiB)),
        categories_at_peak=categories(parameters=4, other=6),
        categories_at_end=categories(parameters=4),
        sites_at_peak=(Site("train.py", 3, "<module>", 8 * MiB),),
        largest_at_peak=(
            Held("fc.weight", 4 * MiB, "parameters", (1024, 1024), "torch.float32", "t.py:1"),
            Held("Tensor@t.py:2", 16, "other"),
        ),
        reserved_peak_bytes=20 * MiB,
        exact=False,
    )
    module = ModulePeak("fc", "Linear", "cuda:0", 5 * MiB, None, 2)
    original = RunRecord({"cuda:0": run}, (module,), 1.5, 3, ("t.py", "-x"), ("a note",))
    assert RunRecord.from_json(json.loads(json.dumps(original.to_json()))) == original


def test_a_report_that_is_not_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a torchmem run report: KeyError: 'timeline'"):
        RunRecord.from_json({"devices": {}})


def three_ranks() -> list[RunRecord]:
    """Three ranks' reports: the same parameters; rank 1 holds 16 MiB of other, rank 2
    three times the activations."""
    return [
        record(8 * MiB, parameters=4 * MiB, activations=4 * MiB),
        record(24 * MiB, parameters=4 * MiB, activations=4 * MiB, other=16 * MiB),
        record(16 * MiB, parameters=4 * MiB, activations=12 * MiB),
    ]


def test_the_ranks_peaks_and_the_category_that_differs_most() -> None:
    reports = three_ranks()
    ranks = assemble([payload(r, report) for r, report in enumerate(reports)], range(3))
    found = ranks.imbalance
    assert found is not None
    assert (found.kind, found.highest_rank, found.highest_bytes) == ("cpu", 1, 24 * MiB)
    assert (found.lowest_rank, found.lowest_bytes, found.ratio) == (0, 8 * MiB, 3.0)
    assert (found.category, found.category_high_rank, found.category_high_bytes) == (
        "other",
        1,
        16 * MiB,
    )
    assert (found.category_low_rank, found.category_low_bytes) == (0, 0)


def test_each_ranks_categories_say_which_rank_held_the_most_of_each() -> None:
    reports = three_ranks()
    ranks = assemble([payload(r, report) for r, report in enumerate(reports)], range(3))
    lines = str(ranks).splitlines()
    at = lines.index("Each rank at its peak, by category:")
    assert lines[at + 1 : at + 6] == [
        "  rank  device  parameters  activations   other",
        "     0  cpu          4.00M        4.00M   0.00B",
        "     1  cpu          4.00M        4.00M  16.00M",
        "     2  cpu          4.00M       12.00M   0.00B",
        "  Most of each: activations on rank 2 (12.00M); other on rank 1 (16.00M).",
    ]
    even = assemble([payload(r, reports[0]) for r in range(2)], range(2))
    assert "  Every rank held the same of each." in str(even).splitlines()
    alone = assemble([payload(0, reports[0])], range(1))
    assert "Each rank at its peak, by category:" not in str(alone)
    assert "<th>activations</th>" in ranks._repr_html_()


def test_ranks_compare_their_main_devices_of_the_common_kind() -> None:
    runs = [
        RankRun(0, "a", record(30 * MiB, device="cuda:0")),
        RankRun(1, "a", record(10 * MiB, device="cuda:1")),
        RankRun(2, "b", record(99 * MiB)),  # no GPU: not compared with the GPUs
    ]
    found = imbalance(runs)
    assert found is not None
    assert (found.kind, found.highest_rank, found.lowest_rank, found.category) == (
        "cuda",
        0,
        1,
        None,
    )
    assert imbalance(runs[:1]) is None
    nothing = imbalance([RankRun(0, "a", record(0)), RankRun(1, "a", record(5))])
    assert nothing is not None and nothing.ratio == float("inf")
    tied = imbalance([RankRun(r, "a", record(8 * MiB)) for r in range(3)])
    assert tied is not None  # two ranks, not rank 0 against itself
    assert (tied.highest_rank, tied.lowest_rank, tied.ratio) == (0, 1, 1.0)


def test_the_table_says_each_ranks_peak_and_who_raised() -> None:
    reports = [
        record(8 * MiB, other=8 * MiB),
        record(16 * MiB, exit_code=1, other=16 * MiB),
    ]
    ranks = assemble(
        [payload(0, reports[0]), payload(1, reports[1], "ValueError: boom")], range(3), top=2
    )
    lines = str(ranks).splitlines()
    assert lines[:8] == [
        "torchmem: memory per rank (3 ranks on 1 host, exit code 1)",
        "",
        "rank  host   device    peak    end  most at the peak  ram peak  exit",
        "   0  node1  cpu      8.00M  4.00M  other 8.00M        300.00M     0",
        "   1  node1  cpu     16.00M  8.00M  other 16.00M       300.00M     1",
        "",
        "Each rank at its peak, by category:",
        "  rank  device   other",
    ]
    assert lines[8:18] == [
        "     0  cpu      8.00M",
        "     1  cpu     16.00M",
        "  Most of each: other on rank 1 (16.00M).",
        "",
        "Imbalance on cpu: rank 1 peaked at 16.00M, 2.00x rank 0's 8.00M; the category that"
        " differs most is other: 16.00M on rank 1 against 8.00M on rank 0.",
        "Rank 1 raised ValueError: boom (the traceback is in rank 1's output).",
        "Rank 2 sent no report: it died, or had not finished by then.",
        "",
        "Rank 1, the highest peak, in detail:",
        "",
    ]
    assert lines[18] == "torchmem: where the memory went (1.00s, exit code 1)"
    assert ranks.exit_code == 1


def test_a_gpu_table_shows_the_reserved_peak() -> None:
    run = DeviceRun("cuda:0", 0, 8 * MiB, 0.5, 0, (), reserved_peak_bytes=20 * MiB)
    report = RunRecord({"cuda:0": run}, (), 1.0)
    text = str(assemble([payload(0, report)], range(1)))
    assert text.splitlines()[:4] == [
        "torchmem: memory per rank (1 rank on 1 host)",
        "",
        "rank  host   device   peak  reserved peak    end  most at the peak  ram peak  exit",
        "   0  node1  cuda:0  8.00M         20.00M  0.00B  -                        -     -",
    ]


def gpu_record(peak: int, device: str) -> RunRecord:
    run = DeviceRun(device, 0, peak, 0.5, 0, (), reserved_peak_bytes=peak)
    return RunRecord({device: run}, (), 1.0, exit_code=0)


def test_memory_a_rank_holds_on_another_ranks_gpu_is_named() -> None:
    ranks = assemble(
        [
            payload(0, gpu_record(8 * GiB, "cuda:0"), gpus={"cuda:0": 9 * GiB}),
            payload(
                1, gpu_record(8 * GiB, "cuda:1"), gpus={"cuda:1": 9 * GiB, "cuda:0": 512 * MiB}
            ),
            payload(
                2, gpu_record(8 * GiB, "cuda:2"), gpus={"cuda:2": 9 * GiB, "cuda:0": 500 * MiB}
            ),
        ],
        range(3),
    )
    assert [(e.rank, e.device, e.bytes) for e in ranks.elsewhere] == [
        (1, "cuda:0", 512 * MiB),
        (2, "cuda:0", 500 * MiB),
    ]
    lines = str(ranks).splitlines()
    assert lines[2:8] == [
        "rank  host   device   peak  reserved peak    end  most at the peak  process on the GPU"
        "  ram peak  exit",
        "   0  node1  cuda:0  8.00G          8.00G  0.00B  -                              9.00G"
        "         -     0",
        "   1  node1  cuda:1  8.00G          8.00G  0.00B  -                              9.00G"
        "         -     0",
        "   1  node1  cuda:0      -              -      -  -                            512.00M"
        "         -     0",
        "   2  node1  cuda:2  8.00G          8.00G  0.00B  -                              9.00G"
        "         -     0",
        "   2  node1  cuda:0      -              -      -  -                            500.00M"
        "         -     0",
    ]
    assert (
        "Ranks 1 and 2 hold memory on cuda:0, which is not their GPU (512.00M, 500.00M,"
        " NVML): a CUDA context or tensors made there, as a missing"
        " torch.cuda.set_device(local_rank), or torch.load without map_location, does."
    ) in lines
    data = ranks.to_json()
    assert data["elsewhere"][0] == {"rank": 1, "device": "cuda:0", "bytes": 512 * MiB}
    assert data["ranks"][1]["gpu_process_bytes"] == {"cuda:1": 9 * GiB, "cuda:0": 512 * MiB}


def test_a_rank_without_a_gpu_holds_nothing_elsewhere() -> None:
    found = assemble([payload(0, record(8 * MiB), gpus={"cuda:0": 300 * MiB})], range(1))
    assert found.elsewhere == ()


def test_nvml_says_what_this_process_holds_on_each_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [StandInGpu(gpu_uuid(n)) for n in range(3)]
    gpus[0].processes = {os.getpid(): 700 * MiB, os.getpid() + 1: 5 * GiB}
    gpus[1].processes = {os.getpid() + 1: 5 * GiB}
    gpus[2].processes = {os.getpid(): None}  # a driver that does not say
    install_gpus(monkeypatch, gpus)
    assert nvml.process_memory(os.getpid()) == {0: 700 * MiB}
    data = json.loads(_payload(3, record(1)))
    assert data["gpu_process_bytes"] == {"cuda:0": 700 * MiB}
    assert data["rank"] == 3


def test_without_nvml_nothing_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    install_gpus(monkeypatch, [StandInGpu(gpu_uuid(0))], nvml="missing")
    assert nvml.process_memory(os.getpid()) == {}


def test_the_json_holds_every_rank_as_a_single_process_report(tmp_path: Path) -> None:
    ranks = assemble([payload(1, record(16 * MiB)), payload(0, record(8 * MiB))], range(2))
    ranks.save_json(tmp_path / "ranks.json")
    data = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][1]["devices"]["cpu"]["peak_bytes"] == 16 * MiB
    assert data["ranks"][1]["host"] == "node1"
    assert (data["world_size"], data["exit_code"], data["missing_ranks"]) == (2, 0, [])
    assert data["imbalance"]["ratio"] == 2.0
    assert data["imbalance"]["highest_rank"] == 1


def test_the_html_page_opens_offline_and_the_frame_counts_bytes(tmp_path: Path) -> None:
    ranks = assemble([payload(0, record(8 * MiB)), payload(1, record(16 * MiB))], range(2))
    ranks.save_html(tmp_path / "ranks.html")
    page = (tmp_path / "ranks.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page and page.count("<script") == page.count("<script>") == 1  # hover
    assert page.count("<details") == 2 and "<details open><summary>rank 1" in page
    pytest.importorskip("pandas")
    frame = ranks.to_dataframe()
    assert list(frame["peak_bytes"]) == [8 * MiB, 300 * MiB, 16 * MiB, 300 * MiB]
    assert list(frame["rank"]) == [0, 0, 1, 1]


# -- the launcher's environment and store ------------------------------------------------


def environ(rank: int, world: int, port: int, **more: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **more,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_process_without_a_launcher_is_a_single_process() -> None:
    assert Launch.from_environ({}) is None
    assert Launch.from_environ({"RANK": "0", "WORLD_SIZE": "2"}) is None
    assert Launch.from_environ(environ(0, 1, 1234)) is None  # a job of one: nothing to gather
    assert Launch.from_environ(environ(0, 2, 1234)) is not None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RANK", "one", "RANK='one' is not a whole number"),
        ("WORLD_SIZE", "2.5", "WORLD_SIZE='2.5' is not a whole number"),
        ("RANK", "2", "RANK=2 is not below WORLD_SIZE=2"),
        ("MASTER_PORT", "http", "MASTER_PORT='http' is not a whole number"),
    ],
)
def test_a_bad_launcher_variable_is_named(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Launch.from_environ({**environ(0, 2, 1234), name: value})


def test_torchruns_store_keys_are_per_run_and_attempt() -> None:
    launch = Launch.from_environ(
        environ(
            1,
            2,
            1234,
            TORCHELASTIC_RUN_ID="abc",
            TORCHELASTIC_RESTART_COUNT="2",
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
    )
    assert launch is not None
    assert (launch.prefix, launch.agent_store) == ("torchmem/abc/2/", True)


def test_rank_zero_gathers_every_rank_through_the_store() -> None:
    port = free_port()
    zero = Launch.from_environ(environ(0, 2, port))
    one = Launch.from_environ(environ(1, 2, port))
    assert zero is not None and one is not None
    zero.connect()  # rank 0 hosts the store where no torchrun agent does
    done: list[object] = []

    def rank_one() -> None:
        one.connect()
        done.append(one.exchange(record(16 * MiB, exit_code=1), "ValueError: boom"))
        one.finish()

    thread = threading.Thread(target=rank_one)
    thread.start()
    ranks = zero.exchange(record(8 * MiB))
    assert isinstance(ranks, RanksReport)
    assert [(r.rank, r.report.devices["cpu"].peak_bytes, r.error) for r in ranks.ranks] == [
        (0, 8 * MiB, None),
        (1, 16 * MiB, "ValueError: boom"),
    ]
    assert ranks.ranks[0].host == socket.gethostname()
    thread.join(0.3)
    assert done == []  # rank 1 failed: it waits until rank 0 has printed
    zero.finish()
    thread.join(10)
    assert done == [None]


def test_rank_zero_told_to_stop_reports_what_arrived() -> None:
    zero = Launch.from_environ(environ(0, 3, free_port()))
    assert zero is not None
    zero.connect()
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    ranks = zero.exchange(record(8 * MiB))
    timer.join()
    zero.finish()
    assert ranks is not None
    assert ([r.rank for r in ranks.ranks], ranks.missing, ranks.exit_code) == ([0], (1, 2), 1)
    assert signal.getsignal(signal.SIGTERM) is before


def test_exchange_needs_a_connection() -> None:
    launch = Launch.from_environ(environ(0, 2, 1234))
    assert launch is not None
    with pytest.raises(RuntimeError, match="connect"):
        launch.exchange(record(1))


# -- gather_reports on a real process group ---------------------------------------------


def test_gathering_without_a_process_group_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="call init_process_group first"):
        gather_reports(record(1))


@pytest.mark.integration  # a real gloo group, measured
def test_gather_reports_on_a_one_rank_gloo_group() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with torchmem.record("cpu") as rec:
            x = torch.zeros(1024, 1024)
        del x
        ranks = torchmem.gather_reports(rec.report(), dst=None)
        assert ranks is not None
        assert ranks.ranks[0].report.devices["cpu"].peak_bytes >= 4 * MiB
        assert ranks.imbalance is None
        with pytest.raises(ValueError, match="dst=3 is not a rank of the group"):
            gather_reports(rec.report(), dst=3)
        with pytest.raises(ValueError, match="top must be at least 1, not 0"):
            gather_reports(rec.report(), top=0)
    finally:
        dist.destroy_process_group()


def test_after_a_failure_rank_zero_waits_only_a_grace_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("torchmem.ranks.GRACE", 0.2)
    port = free_port()
    zero, one = (Launch.from_environ(environ(r, 3, port)) for r in (0, 1))
    assert zero is not None and one is not None
    zero.connect()
    one.connect()
    failed: list[object] = []
    thread = threading.Thread(
        target=lambda: failed.append(one.exchange(record(16 * MiB, exit_code=1), "OOM"))
    )
    thread.start()
    ranks = zero.exchange(record(8 * MiB))  # rank 2 never comes: stuck in a collective
    assert ranks is not None
    assert ([r.rank for r in ranks.ranks], ranks.missing) == ([0, 1], (2,))
    zero.finish()
    thread.join(10)
    assert failed == [None]  # rank 0 printed: rank 1 does not


def test_a_failed_rank_prints_what_arrived_when_rank_zero_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("torchmem.ranks.GRACE", 0.2)
    port = free_port()
    zero, one, two = (Launch.from_environ(environ(r, 3, port)) for r in (0, 1, 2))
    assert zero is not None and one is not None and two is not None
    zero.connect()  # hosts the store, then is stuck in the script: never reports
    one.connect()
    two.connect()
    second: list[object] = []
    thread = threading.Thread(
        target=lambda: second.append(two.exchange(record(24 * MiB, exit_code=1), "OOM"))
    )
    thread.start()
    ranks = one.exchange(record(16 * MiB, exit_code=1), "ValueError: boom")
    thread.join(10)
    printed = [r for r in (ranks, *second) if r is not None]
    assert len(printed) == 1  # by whichever failed rank claimed it first
    assert printed[0].missing == (0,)
    assert [(r.rank, r.error) for r in printed[0].ranks] in (
        [(1, "ValueError: boom"), (2, "OOM")],
        [(1, "ValueError: boom")],
        [(2, "OOM")],
    )


# -- the command line's choice -----------------------------------------------------------


@pytest.mark.integration  # measures the CPU for real
def test_a_job_of_one_process_runs_as_a_single_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torchmem.cli import main

    for name, value in environ(0, 1, 1).items():  # port 1: nothing could be reached there
        monkeypatch.setenv(name, value)
    script = tmp_path / "one.py"
    script.write_text("import torch\nx = torch.zeros(1024, 1024)\n")
    assert main(["run", "-q", "--json", str(tmp_path / "out.json"), str(script)]) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert "ranks" not in report and report["exit_code"] == 0


def test_a_bad_launcher_variable_stops_the_command_before_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchmem.cli import main

    for name, value in environ(0, 2, 1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "first")
    script = tmp_path / "never.py"
    script.write_text("print('ran')\n")
    assert main(["run", str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "torchmem run: error: RANK='first' is not a whole number\n"


@pytest.mark.parametrize(
    ("ranks", "words"),
    [
        ([3], "Rank 3"),
        ([2, 1], "Ranks 1 and 2"),
        ([0, 1, 2, 3, 4, 5, 7, 9], "Ranks 0-5, 7 and 9"),
        ([4, 6, 7], "Ranks 4, 6 and 7"),
        ([0, 1, 2], "Ranks 0-2"),
    ],
)
def test_many_ranks_are_named_in_short(ranks: list[int], words: str) -> None:
    assert render_ranks._ranks(ranks) == words


def test_ranks_that_failed_alike_share_a_line() -> None:
    failed = [
        payload(r, record(MiB, exit_code=1), "torch.OutOfMemoryError: CUDA") for r in range(4)
    ]
    lines = str(assemble(failed, range(6))).splitlines()
    assert (
        "Ranks 0-3 raised torch.OutOfMemoryError: CUDA (the tracebacks are in their outputs)."
        in lines
    )
    assert "Ranks 4 and 5 sent no report: they died, or had not finished by then." in lines
