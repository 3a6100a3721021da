"""Every report has one shape (:class:`torchmem.report.Report`): it prints as text, shows
as HTML in Jupyter, gives a DataFrame, and writes its JSON and a self-contained page."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import torchmem
from standins import MiB
from test_ranks import payload, record
from test_snapshot import snapshot_dict
from torchmem.ranks import RanksReport, assemble
from torchmem.recording import RunReport
from torchmem.report import Report
from torchmem.snapshot import Snapshot

pytestmark = pytest.mark.integration


def made_here() -> None:
    torch.zeros(1024, 1024)  # 4,194,304 bytes


def reports() -> dict[str, Any]:
    with torchmem.record("cpu") as rec:
        made_here()
    return {
        "run": rec.report(),
        "ranks": assemble([payload(0, record(8 * MiB)), payload(1, record(16 * MiB))], range(2)),
        "snapshot": Snapshot.from_dict(snapshot_dict(), "snapshot.pickle"),
        "estimate": torchmem.estimate(made_here, device="cpu"),
    }


def test_every_report_class_is_a_report() -> None:
    classes = (RunReport, RanksReport, Snapshot, torchmem.Estimate)
    assert all(issubclass(c, Report) for c in classes)
    # None writes its own text, HTML, page or JSON: the protocol does, by its renderer.
    shared = ("__str__", "_repr_html_", "to_dataframe", "save_json", "save_html")
    assert [(c.__name__, m) for c in classes for m in shared if m in vars(c)] == []


@pytest.mark.parametrize("kind", ["run", "ranks", "snapshot", "estimate"])
def test_each_report_has_every_form(kind: str, tmp_path: Path) -> None:
    report = reports()[kind]
    assert str(report).startswith("torchmem")
    assert "<table" in report._repr_html_()
    report.save_html(tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "http" not in page and "src=" not in page
    # Only the charts' hover, inline; the snapshot's page has none.
    assert page.count("<script>") == page.count("<script") == (kind != "snapshot")
    report.save_json(tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text()) == report.to_json()
    pytest.importorskip("pandas")
    assert len(report.to_dataframe()) > 0


def test_an_estimates_json_is_exact() -> None:
    data = torchmem.estimate(made_here, device="cpu").to_json()
    assert (data["device"], data["function"]) == ("cpu", "made_here")
    assert (data["peak_bytes"], data["reserved_bytes"]) == (4_194_304, 4_194_304)
    assert data["categories_at_peak"]["other"] == 4_194_304
    assert data["run"]["devices"]["cpu"]["peak_bytes"] == 4_194_304
    assert data["run"]["sites_at_peak"][0]["line"] == inspect.getsourcelines(made_here)[1] + 1


def test_the_page_lists_as_many_as_top_asks(tmp_path: Path) -> None:
    snapshot = Snapshot.from_dict(snapshot_dict(), "snapshot.pickle")
    assert snapshot.top == torchmem.records.TOP
    short = dataclasses.replace(snapshot, top=1)
    short.save_html(tmp_path / "short.html")
    page = (tmp_path / "short.html").read_text()
    assert "... and 2 more sites" in page and "... and 1 more segment" in page
