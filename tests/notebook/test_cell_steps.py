"""The cell logger's growth per training step, in a real IPython shell (``%memlog steps``).

The GPU row is CPU tensors here, counted by the counting allocator, exact to the byte.
"""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("IPython")  # the notebook extra

from IPython.core.interactiveshell import InteractiveShell

from torchmem.notebook.memlog import register

pytestmark = pytest.mark.counting

SETUP = """\
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.ReLU())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
outputs = []
"""
LOOP = """\
for step in range(6):
    out = model(torch.randn(64, 256))
    outputs.append(out)
    optimizer.zero_grad()
    out.square().mean().backward()
    optimizer.step()
"""
"""Each step keeps its output, 64 x 256 float32 (65,536 bytes), in ``outputs``."""
STEADY = LOOP.replace("    outputs.append(out)\n", "")
RAM = (
    r"cpu grows 64\.00K per step from step 1, exactly at each of 5 steps"
    r" \(RAM [+-]?\d+\.\d\d[BKMGT] per step\):"
)
"""The growth's first line: the process's RAM per step is this machine's."""


def report(shell: InteractiveShell, cell: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    shell.run_cell(cell, store_history=True)
    return capsys.readouterr().out.splitlines()


def test_a_cell_whose_loop_grows_says_by_how_much_from_where_and_why(
    ipython: InteractiveShell, no_gpu: object, capsys: pytest.CaptureFixture[str]
) -> None:
    ipython.run_cell("import torch")
    ipython.user_ns["torch"] = sys.modules["torch"]
    with register(ipython):
        ipython.run_line_magic("memlog", "steps")
        report(ipython, SETUP, capsys)
        lines = report(ipython, LOOP, capsys)
        number = ipython.execution_count - 1
        assert lines[0].startswith("RAM:")
        assert lines[1].startswith("Gen:") and lines[2].startswith("CPU tensors:")
        assert re.fullmatch(RAM, lines[3]), lines[3]
        assert lines[4:] == [
            f"  64.00K each step from In [{number}], line 2"
            " (`out = model(torch.randn(64, 256))`), held by list `outputs`",
            # 6 x (MmBackward0, TBackward0, ReluBackward0) and the weight's accumulator
            "  list `outputs` keeps an autograd graph of each of 6 steps (19 nodes); keep"
            " what it holds detached (`.detach()`, or `.item()` for a number)",
        ]
        assert len(report(ipython, STEADY, capsys)) == 3  # no growth: the table alone
        capsys.readouterr()
        ipython.run_line_magic("memlog", "")
        assert capsys.readouterr().out == "memlog: steps\n"
        ipython.run_line_magic("memlog", "on")
        assert len(report(ipython, LOOP, capsys)) == 3  # not recorded: no growth said
        ipython.run_line_magic("memlog", "off")
