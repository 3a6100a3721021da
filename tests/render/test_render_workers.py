"""A run's DataLoader workers in its report: the text's section after the devices, the
HTML's table, the JSON, exact to the character on hand-made records."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from torchmem.records.run import DeviceRun, RunRecord
from torchmem.records.workers import Worker, Workers
from torchmem.render import run as render

M = 2**20
CPU = DeviceRun("cpu", 0, 8 * M, 1.5, 4 * M, ((1.5, 8 * M), (2.0, 4 * M)))
WORKERS = Workers((Worker(4242, 300 * M, 0.35, 1.9), Worker(4243, 2 * 2**30, 0.4, 1.95)), 0.05)
RECORD = RunRecord({"cpu": CPU}, (), 2.0, exit_code=0, command=("train.py",), workers=WORKERS)

EXPECTED = """\
torchmem: where the memory went (2.00s, exit code 0)
command: train.py

device  start   peak     at    end
cpu     0.00B  8.00M  1.50s  4.00M

DataLoader workers (processes of their own):
  worker pid  peak RSS  first seen  last seen
  4243          ~2.00G       0.40s      1.95s
  4242        ~300.00M       0.35s      1.90s
  ~ sampled: read from /proc every 0.05s (a rise after the last reading is missed); RSS\
 counts the pages a worker shares with this process (inherited at fork, batches in shared\
 memory)."""


def test_text_shows_each_worker_after_the_devices() -> None:
    assert render.text(RECORD, width=100) == EXPECTED


def test_top_lists_the_highest_peaks_and_says_how_many_more() -> None:
    head = EXPECTED[: EXPECTED.index("DataLoader workers")]
    assert render.text(RECORD, top=1, width=100) == head + (
        """\
DataLoader workers (processes of their own):
  worker pid  peak RSS  first seen  last seen
  4243          ~2.00G       0.40s      1.95s
  ... and 1 more worker. ~ sampled: read from /proc every 0.05s (a rise after the last\
 reading is missed); RSS counts the pages a worker shares with this process (inherited at\
 fork, batches in shared memory)."""
    )


def test_no_worker_seen_or_none_looked_for_shows_nothing() -> None:
    for workers in (None, Workers((), 0.05)):
        record = RunRecord({"cpu": CPU}, (), 2.0, exit_code=0, workers=workers)
        assert "DataLoader workers" not in render.text(record, width=100)


def test_html_has_the_workers_table_after_the_devices_and_their_charts() -> None:
    root = ET.fromstring(render.html(RECORD))
    children = list(root)
    titles = [i for i, c in enumerate(children) if c.tag == "h4"]
    first = children[titles[0]]
    assert "".join(first.itertext()) == "DataLoader workers (processes of their own):"
    charts = [i for i, c in enumerate(children) if c.tag == "svg" or c.find(".//svg") is not None]
    assert charts and max(charts) < titles[0]
    cells = ["".join(c.itertext()) for c in root.iter("td")]
    assert cells[-8:] == ["4243", "~2.00G", "0.40s", "1.95s", "4242", "~300.00M", "0.35s", "1.90s"]


def test_the_json_holds_the_workers_and_reads_back() -> None:
    data = json.loads(json.dumps(RECORD.to_json()))
    assert data["workers"] == {
        "interval_s": 0.05,
        "exact": False,
        "processes": [
            {"pid": 4242, "peak_rss_bytes": 300 * M, "first_seen_s": 0.35, "last_seen_s": 1.9},
            {"pid": 4243, "peak_rss_bytes": 2 * 2**30, "first_seen_s": 0.4, "last_seen_s": 1.95},
        ],
    }
    assert RunRecord.from_json(data).workers == WORKERS
    older = {k: v for k, v in data.items() if k != "workers"}
    assert RunRecord.from_json(older).workers is None
