"""PyTorch's one CUDA allocator history per process, standing in."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch

# CUDA allocator history ---------------------------------------------------------------


class HistoryStandIn:
    """Stand-in for PyTorch's one CUDA allocator history per process
    (``torch.cuda.memory._record_memory_history`` and ``_snapshot``), behaving as measured
    on an H100 with PyTorch 2.11: enabling it again keeps what it holds unless
    ``clear_history``; turning it off (``enabled=None``) discards it; a smaller
    ``max_entries`` drops the oldest entries. :meth:`alloc` stands for the program making
    a tensor on GPU 0 (a trace entry when enabled, with a frame when the context records
    allocation stacks)."""

    def __init__(self) -> None:
        self.enabled: str | None = None
        self.settings: dict[str, Any] = {}
        """The last call's settings (``context``, ``stacks``, ``max_entries``, ...)."""
        self.trace: list[dict[str, Any]] = []
        self.calls: list[tuple[str | None, dict[str, Any]]] = []
        """Every call of the stand-in ``_record_memory_history`` that reached it."""

    def _record_memory_history(
        self,
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        skip_actions: list[str] | None = None,
    ) -> None:
        settings = {"context": context, "stacks": stacks, "max_entries": max_entries}
        if skip_actions is not None:
            settings["skip_actions"] = skip_actions
        self.calls.append((enabled, {**settings, "clear_history": clear_history}))
        self.enabled = enabled
        if enabled is None:
            self.settings, self.trace = {}, []
            return
        self.settings = settings
        if clear_history:
            self.trace = []
        del self.trace[: max(0, len(self.trace) - max_entries)]

    def _snapshot(self, device: Any = None) -> dict[str, Any]:
        return {"segments": [], "device_traces": [list(self.trace)]}

    def alloc(self, address: int, size: int, action: str = "alloc") -> None:
        """The program allocates (or, with `action`, frees) `size` bytes at `address`."""
        if self.enabled != "all" or action in (self.settings.get("skip_actions") or ()):
            return
        entry: dict[str, Any] = {
            "action": action,
            "addr": address,
            "size": size,
            "time_us": time.time_ns() // 1000,
            "frames": [],
        }
        if self.settings["context"] in ("alloc", "all") and action == "alloc":
            entry["frames"] = [{"filename": "/home/me/train.py", "line": 7, "name": "step"}]
        self.trace.append(entry)
        del self.trace[: max(0, len(self.trace) - self.settings["max_entries"])]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> HistoryStandIn:
        monkeypatch.setattr(
            torch.cuda.memory, "_record_memory_history", self._record_memory_history
        )
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self._snapshot)
        monkeypatch.setattr(
            torch._C, "_cuda_isHistoryEnabled", lambda: self.enabled is not None, raising=False
        )
        return self
