"""The example notebook, executed in a real Jupyter kernel on CPU tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

pytestmark = pytest.mark.slow  # a real Jupyter kernel

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


@pytest.fixture(scope="module")
def outputs() -> dict[str, list[dict]]:
    """Each code cell's first line -> its outputs, from a fresh run with no GPU visible."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the kernel inherits it: CPU tensors
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    return {
        cell.source.splitlines()[0]: cell.outputs
        for cell in notebook.cells
        if cell.cell_type == "code"
    }


def text(cell_outputs: list[dict]) -> str:
    return "".join(
        o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell_outputs
    )


def test_no_cell_fails(outputs):
    assert not [o for cell in outputs.values() for o in cell if o["output_type"] == "error"]


def test_the_trace(outputs):
    assert text(outputs["with torchmem.MemTrace(ctx='forward and backward', device=device):"]) == (
        "△Used Peaked MB:      4      1 (forward and backward: exit)\n"
    )


def test_a_site_in_a_cell_is_named_after_the_cell(outputs):
    # ipykernel's file of the cell's code, /tmp/ipykernel_<pid>/<hash>.py:2, before.
    assert text(outputs["with torchmem.record(device) as recording:"]) == "In [2], line 2: 8.00M\n"


def test_the_line_profile_shows_as_html_and_text(outputs):
    (result,) = outputs["%mlrun -f train_step train_step()"]
    assert result["data"]["text/html"].startswith(
        '<h3><span style="font-family: monospace">train_step</span></h3><div><table'
    )
    lines = result["data"]["text/plain"].splitlines()
    assert lines[:5] == [
        "## train_step",
        "",
        "active_bytes active_bytes hits line code",
        "         all          all",
        "        peak        delta",
    ]
    # The peak is the process's CPU tensors, as on a GPU: the parameters, the gradients
    # zero_grad frees and the batch, all made before profiling.
    assert lines[6] == "       9.09M       -4.04M    1    4     optimizer.zero_grad()"


def test_the_tensor_report(outputs):
    report = text(outputs["reporter = torchmem.MemReporter(model)"]).splitlines()
    assert report[3] == "0.weight                                        (1024, 1024)     4.00M"
    assert report[4] == "0.weight.grad                                   (1024, 1024)     4.00M"
    assert "Adam.0.weight.exp_avg                           (1024, 1024)     4.00M" in report
    assert report[-2] == "Total Tensors: 4501805 \tUsed Memory: 17.17M"


def test_the_cell_log(outputs):
    log = text(outputs["kept = torch.zeros(1024, 1024, device=device)  # 4 MiB, kept"])
    lines = log.splitlines()
    assert lines[0].startswith("RAM:         Consumed Peaked  Used Total  in ")
    assert lines[0].endswith("s (In [8])")
    # Used: every CPU tensor of the kernel, the 17.17M the reporter listed plus these 4 MiB
    assert lines[2] == "CPU tensors:        4      0     21 MB"
    assert text(outputs["%memlog off"]) == ""
