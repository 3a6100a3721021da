"""Launching ``torchrun`` jobs from tests: real launchers in subprocesses, one thread per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(*words: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", *words]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        command, cwd=cwd, env=environ, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=240)
    return process.returncode, out, err
