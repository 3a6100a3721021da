"""``torchmem run`` under ``torchrun``, and ``torchmem.gather_reports`` in a training
script: real launchers in subprocesses, real gloo process groups on CPU.

In every job, rank r allocates (r + 1) x 8 MiB, so the gathered peaks differ by 8 MiB
from one rank to the next."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launchers import finished, free_port, torchrun
from standins import MiB

pytestmark = [
    pytest.mark.slow,
    pytest.mark.counting,
]

JOB = textwrap.dedent(
    """\
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.zeros((rank + 1) * 2 * 2**20, device=os.environ.get("DEVICE", "cpu"))
    if os.environ.get("STUCK") == str(rank):  # the others wait in all_reduce for it
        raise MemoryError(f"out of memory on rank {rank}")
    total = torch.ones(4)
    dist.all_reduce(total)
    del x
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("RAISE") == str(rank):
        raise ValueError(f"boom on rank {rank}")
    if os.environ.get("DIE") == str(rank):
        time.sleep(1)  # rank 0 is waiting for the reports by then
        os._exit(3)
    """
)


def job(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def torchmem_job(
    tmp_path: Path, *options: str, ranks: int = 2, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc-per-node=RANKS -m torchmem run OPTIONS job.py``, run
    to its end in `tmp_path`: its exit code, stdout and stderr."""
    words = ["--standalone", f"--nproc-per-node={ranks}", "-m", "torchmem", "run", *options]
    return finished(torchrun(*words, "job.py", cwd=job(tmp_path), env=env))


def peaks(report: dict) -> list[int]:
    return [rank["devices"][rank["main_device"]]["peak_bytes"] for rank in report["ranks"]]


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_zero_prints_every_ranks_peak(tmp_path: Path, ranks: int) -> None:
    code, _, err = torchmem_job(
        tmp_path, "--json", "ranks.json", "--snapshot", "memory.pickle", ranks=ranks
    )
    assert code == 0, err
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == list(range(ranks))
    snapshots = sorted(path.name for path in tmp_path.glob("memory*.pickle"))
    assert snapshots == [f"memory.rank{r}.pickle" for r in range(ranks)]
    assert (report["world_size"], report["missing_ranks"], report["exit_code"]) == (ranks, [], 0)
    found = peaks(report)
    assert [p - found[0] for p in found] == [r * 8 * MiB for r in range(ranks)]
    assert report["imbalance"]["highest_rank"] == ranks - 1
    assert report["imbalance"]["lowest_rank"] == 0
    assert all(r["host"] == socket.gethostname() and r["error"] is None for r in report["ranks"])
    assert f"torchmem: memory per rank ({ranks} ranks on 1 host, exit code 0)" in err
    assert err.count("torchmem: memory per rank") == 1  # rank 0 alone prints
    assert f"Imbalance on cpu: rank {ranks - 1} peaked at" in err
    assert f"Rank {ranks - 1}, the highest peak, in detail:" in err


def test_a_rank_that_raises_fails_the_job_and_the_others_still_report(tmp_path: Path) -> None:
    code, _, err = torchmem_job(tmp_path, "--json", "ranks.json", env={"RAISE": "1"})
    assert code != 0
    assert 'raise ValueError(f"boom on rank {rank}")' in err  # the rank's own traceback
    assert "ValueError: boom on rank 1" in err
    assert "Rank 1 raised ValueError: boom on rank 1 (the traceback is in rank 1's output)." in err
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert [(r["rank"], r["exit_code"]) for r in report["ranks"]] == [(0, 0), (1, 1)]
    assert report["ranks"][1]["error"] == "ValueError: boom on rank 1"
    assert peaks(report)[1] - peaks(report)[0] == 8 * MiB


def test_a_rank_that_fails_while_the_others_wait_for_it_reports_itself(tmp_path: Path) -> None:
    code, _, err = torchmem_job(tmp_path, "--json", "ranks.json", env={"STUCK": "1"})
    assert code != 0
    assert "MemoryError: out of memory on rank 1" in err
    assert "Rank 0 sent no report: it died, or had not finished by then." in err
    assert "Rank 1 raised MemoryError: out of memory on rank 1" in err
    # Rank 1 printed, and wrote, what had arrived. Rank 0's all_reduce may then fail too
    # (gloo sees rank 1 go) before the launcher stops it: its own table follows, and its
    # JSON replaces rank 1's.
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert report["ranks"][-1]["rank"] == 1
    assert report["ranks"][-1]["error"] == "MemoryError: out of memory on rank 1"
    assert peaks(report)[-1] == 16 * MiB


def test_a_rank_that_dies_is_reported_missing(tmp_path: Path) -> None:
    code, _, err = torchmem_job(tmp_path, "--json", "ranks.json", env={"DIE": "1"})
    assert code != 0
    assert "Rank 1 sent no report: it died, or had not finished by then." in err
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert ([r["rank"] for r in report["ranks"]], report["missing_ranks"]) == ([0], [1])


def test_two_nodes_gather_four_ranks(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    words = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    words += [f"--rdzv-endpoint={endpoint}", "--rdzv-id=torchmem-test"]
    nodes = [
        torchrun(
            *words, "-m", "torchmem", "run", "--json", f"node{n}.json", "job.py", cwd=job(tmp_path)
        )
        for n in range(2)
    ]
    results = [finished(node) for node in nodes]
    assert [code for code, _, _ in results] == [0, 0], results
    written = [path for path in tmp_path.glob("node*.json")]
    assert len(written) == 1  # by rank 0, on whichever node it was
    report = json.loads(written[0].read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    found = peaks(report)
    assert [p - found[0] for p in found] == [r * 8 * MiB for r in range(4)]


def test_a_launcher_without_torchruns_agent_shares_rank_zeros_store(tmp_path: Path) -> None:
    """Ranks started by hand (or by mpirun, a Kubernetes job, ...) with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT: rank 0 hosts the store, and the script's own
    init_process_group on rank 0 shares it."""
    port = str(free_port())
    environ = {key: value for key, value in os.environ.items() if "TORCHELASTIC" not in key}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "torchmem", "run", "--json", f"rank{r}.json", "job.py"],
            cwd=job(tmp_path),
            env={
                **environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
            },
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    results = [finished(rank) for rank in ranks]
    assert [code for code, _, _ in results] == [0, 0], results
    assert "torchmem: memory per rank (2 ranks on 1 host, exit code 0)" in results[0][2]
    assert "torchmem: memory per rank" not in results[1][2]
    assert not (tmp_path / "rank1.json").exists()
    report = json.loads((tmp_path / "rank0.json").read_text())
    found = peaks(report)
    assert found[1] - found[0] == 8 * MiB


API = textwrap.dedent(
    """\
    import json

    import torch
    import torch.distributed as dist

    import torchmem

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with torchmem.record("cpu") as rec:
        x = torch.zeros((rank + 1) * 2 * 2**20)
        del x
    on_zero = torchmem.gather_reports(rec.report())
    everywhere = torchmem.gather_reports(rec.report(), dst=None)
    with open(f"rank{rank}.json", "w") as file:  # the ranks' prints may interleave
        json.dump({
            "on_zero": None if on_zero is None else on_zero.to_json(),
            "everywhere": [r.report.devices["cpu"].peak_bytes for r in everywhere.ranks],
        }, file)
    if rank == 0:
        print(on_zero)
    dist.destroy_process_group()
    """
)


def test_gather_reports_inside_a_training_script(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(API)
    code, out, err = finished(
        torchrun("--standalone", "--nproc-per-node=2", "train.py", cwd=tmp_path)
    )
    assert code == 0, err
    lines = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert lines[1]["on_zero"] is None
    on_zero = lines[0]["on_zero"]
    assert [r["rank"] for r in on_zero["ranks"]] == [0, 1]
    found = peaks(on_zero)
    assert found[1] - found[0] == 8 * MiB
    assert lines[0]["everywhere"] == lines[1]["everywhere"] == found
    assert "torchmem: memory per rank (2 ranks on 1 host)" in out


@pytest.mark.cuda
def test_two_ranks_sharing_one_cuda_gpu(tmp_path: Path) -> None:
    code, _, err = torchmem_job(tmp_path, "--json", "ranks.json", env={"DEVICE": "cuda:0"})
    assert code == 0, err
    print(err)
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["main_device"] for r in report["ranks"]] == ["cuda:0", "cuda:0"]
    found = peaks(report)
    assert found[1] - found[0] == 8 * MiB
    assert report["imbalance"]["kind"] == "cuda"
    assert report["elsewhere"] == []  # both ranks' GPU is cuda:0
    for rank in report["ranks"]:  # NVML, where it shares process ids with this container
        if rank["gpu_process_bytes"]:
            context = rank["gpu_process_bytes"]["cuda:0"]
            assert context > rank["devices"]["cuda:0"]["reserved_peak_bytes"]


def readme_sample() -> list[str]:
    section = (Path(__file__).resolve().parent.parent / "docs" / "distributed.md").read_text()
    return section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def machine_masked(line: str) -> str:
    """`line` without this machine's name, its RAM peak and durations."""
    cells = re.sub(r"\d+\.\d\ds\b", "<seconds>", line).split()
    if cells and cells[0].isdigit() and len(cells) == 9:
        cells[1], cells[7] = "<host>", "<ram>"
    return " ".join(cells)


# Beside other tests on a loaded machine (3 parallel runs of 3), the sample's 7.11M site at
# ddp.py:49 was missing from rank 0's list, while its peak and categories matched to the
# byte; run alone it has always matched. The ranks' timing decides it: which thread makes
# that allocation (gloo's, or the line's) is the likely cause, not yet shown.
@pytest.mark.alone
def test_the_readmes_torchrun_sample_is_what_the_example_prints(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    code, _, err = finished(
        torchrun(
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "torchmem",
            "run",
            "examples/ddp.py",
            cwd=root,
        )
    )
    assert code == 0, err
    printed = [machine_masked(line) for line in err.splitlines()]
    for line in readme_sample():
        if line != "...":
            assert machine_masked(line) in printed
