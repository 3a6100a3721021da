"""The run report's renderers, exact to the character on hand-made records."""

from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from torchmem.records.run import CATEGORIES, DeviceRun, Held, ModulePeak, RunRecord, Site
from torchmem.render import chart, run as render
from torchmem.units import readable_size

M = 2**20
SVG = "{http://www.w3.org/2000/svg}"

CPU = DeviceRun(
    device="cpu",
    start_bytes=1 * M,
    peak_bytes=300 * M,
    peak_time=2.41,
    end_bytes=40 * M,
    timeline=((0.5, 10 * M), (1.0, 40 * M), (2.0, 120 * M), (2.41, 300 * M), (4.0, 40 * M)),
    categories_at_peak={
        "parameters": 8 * M,
        "gradients": 8 * M,
        "optimizer_state": 8 * M,
        "activations": 20 * M,
        "other": 256 * M,
    },
    categories_at_end={
        "parameters": 8 * M,
        "gradients": 8 * M,
        "optimizer_state": 16 * M,
        "activations": 0,
        "other": 8 * M,
    },
    sites_at_peak=(
        Site("train.py", 42, "step", 256 * M),
        Site("model.py", 10, "Net.forward", 20 * M),
        Site("<before recording>", 0, "<module>", 1 * M),
    ),
    largest_at_peak=(
        Held("big", 256 * M, "other", (1024, 65536), "torch.float32", "train.py:42"),
        Held("fc1.weight", 8 * M, "parameters", (2048, 1024), "torch.float32"),
        Held("Tensor@train.py:7", 512, "other"),
    ),
)
RAM = DeviceRun(
    "ram", 100 * M, 500 * M, 2.5, 450 * M, ((1.0, 200 * M), (2.5, 500 * M)), exact=False
)
MODULES = (
    ModulePeak("", "Net", "cpu", 280 * M, 300 * M, 1),
    ModulePeak("fc1", "Linear", "cpu", 100 * M, 290 * M, 3),
    ModulePeak("relu", "ReLU", "cpu", 120 * M, None, 3),
)
RECORD = RunRecord(
    devices={"cpu": CPU, "ram": RAM},
    modules=MODULES,
    duration=4.0,
    exit_code=0,
    command=("train.py", "--name", "a b"),
    notes=("Allocations by other processes are not counted.",),
)

EXPECTED = """\
torchmem: where the memory went (4.00s, exit code 0)
command: train.py --name 'a b'

device    start      peak     at      end
cpu       1.00M   300.00M  2.41s   40.00M
ram     100.00M  ~500.00M  2.50s  450.00M
~ sampled, not exact: the true peak may be higher.

What the memory on cpu was:
  category         at the peak  at the end
  parameters             8.00M       8.00M
  gradients              8.00M       8.00M
  optimizer_state        8.00M      16.00M
  activations           20.00M       0.00B
  other                256.00M       8.00M

Allocation sites alive at the peak on cpu:
  256.00M  train.py:42         step
   20.00M  model.py:10         Net.forward
    1.00M  <before recording>  <module>

Largest allocations alive at the peak on cpu:
  256.00M  big                other       (1024, 65536)  torch.float32  train.py:42
    8.00M  fc1.weight         parameters  (2048, 1024)   torch.float32  -
  512.00B  Tensor@train.py:7  other       -              -              -

Modules: highest memory in use on cpu while each ran:
  module  type    forward  backward  calls
  (top)   Net     280.00M   300.00M      1
  fc1     Linear  100.00M   290.00M      3
  relu    ReLU    120.00M         -      3

Notes:
  - Allocations by other processes are not counted."""


def test_text_of_a_full_record() -> None:
    assert render.text(RECORD) == EXPECTED


def test_top_cuts_the_lists_and_says_what_was_left_out() -> None:
    head = EXPECTED[: EXPECTED.index("Allocation sites")]
    assert render.text(RECORD, top=2) == head + (
        """\
Allocation sites alive at the peak on cpu:
  256.00M  train.py:42  step
   20.00M  model.py:10  Net.forward
  ... and 1 more site (1.00M)

Largest allocations alive at the peak on cpu:
  256.00M  big         other       (1024, 65536)  torch.float32  train.py:42
    8.00M  fc1.weight  parameters  (2048, 1024)   torch.float32  -
  ... and 1 more allocation (512.00B)

Modules: highest memory in use on cpu while each ran:
  module  type    forward  backward  calls
  (top)   Net     280.00M   300.00M      1
  fc1     Linear  100.00M   290.00M      3
  ... and 1 more module

Notes:
  - Allocations by other processes are not counted."""
    )


def test_top_sorts_modules_by_their_highest_peak_when_it_cuts() -> None:
    lines = render.text(RECORD, top=1).splitlines()
    start = lines.index("Modules: highest memory in use on cpu while each ran:")
    assert lines[start : start + 4] == [
        "Modules: highest memory in use on cpu while each ran:",
        "  module  type  forward  backward  calls",
        "  (top)   Net   280.00M   300.00M      1",
        "  ... and 2 more modules",
    ]
    second = render.text(RECORD, top=2).splitlines()
    assert "  fc1     Linear  100.00M   290.00M      3" in second  # 290M beats relu's 120M
    assert not any(line.startswith("  relu") for line in second)


def test_top_zero_shows_no_rows_but_says_how_many_there_were() -> None:
    out = render.text(RECORD, top=0)
    assert "  ... and 3 more sites (277.00M)" in out
    assert "  ... and 3 more allocations (264.00M)" in out
    assert "  ... and 3 more modules" in out


def test_a_recorded_block_without_devices() -> None:
    record = RunRecord(devices={}, modules=(), duration=0.5)
    assert render.text(record) == (
        "torchmem: where the memory went (0.50s)\n\nNo device was recorded."
    )


def test_a_device_without_event_log_shows_no_categories() -> None:
    record = RunRecord(devices={"ram": RAM}, modules=(), duration=2.5, exit_code=1)
    assert render.text(record) == (
        "torchmem: where the memory went (2.50s, exit code 1)\n"
        "\n"
        "device    start      peak     at      end\n"
        "ram     100.00M  ~500.00M  2.50s  450.00M\n"
        "~ sampled, not exact: the true peak may be higher."
    )


def test_categories_of_every_device_missing_end_and_reserved_peak() -> None:
    """Where the end is not known (the pytest plugin's peak), only the peak's column."""
    gpu = DeviceRun(
        "cuda:0",
        0,
        4 * M,
        0.25,
        1024,
        ((0.25, 4 * M),),
        categories_at_peak={"parameters": 1024, "activations": 4 * M - 1024, "odd": 1},
        reserved_peak_bytes=20 * M,
    )
    cpu = DeviceRun("cpu", 0, 2048, 0.1, 0, (), categories_at_peak={"other": 2048})
    record = RunRecord({"cuda:0": gpu, "cpu": cpu}, (), 0.3, exit_code=None)
    assert render.text(record) == (
        "torchmem: where the memory went (0.30s)\n"
        "\n"
        "device  start   peak     at    end  reserved peak\n"
        "cuda:0  0.00B  4.00M  0.25s  1.00K         20.00M\n"
        "cpu     0.00B  2.00K  0.10s  0.00B              -\n"
        "\n"
        "What the memory on cuda:0 was:\n"
        "  category         at the peak\n"
        "  parameters             1.00K\n"
        "  gradients                  -\n"
        "  optimizer_state            -\n"
        "  activations            4.00M\n"
        "  other                      -\n"
        "  odd                    1.00B\n"
        "\n"
        "What the memory on cpu was:\n"
        "  category         at the peak\n"
        "  parameters                 -\n"
        "  gradients                  -\n"
        "  optimizer_state            -\n"
        "  activations                -\n"
        "  other                  2.00K"
    )


def test_modules_and_notes_without_devices() -> None:
    record = RunRecord({}, (ModulePeak("", "Net", "cpu", 3, None, 2),), 1.0, notes=("n.",))
    assert render.text(record) == (
        "torchmem: where the memory went (1.00s)\n"
        "\n"
        "No device was recorded.\n"
        "\n"
        "Modules: highest memory in use on cpu while each ran:\n"
        "  module  type  forward  backward  calls\n"
        "  (top)   Net     3.00B         -      2\n"
        "\n"
        "Notes:\n"
        "  - n."
    )


# -- SVG -------------------------------------------------------------------------------------


def parse_svg(markup: str) -> ET.Element:
    root = ET.fromstring(markup)
    assert root.tag == f"{SVG}svg"
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def points(root: ET.Element) -> list[tuple[float, float]]:
    (line,) = root.iter(f"{SVG}polyline")
    pairs = line.attrib["points"].split()
    return [(float(x), float(y)) for x, y in (p.split(",") for p in pairs)]


def test_svg_is_a_step_chart_with_the_peak_marked() -> None:
    root = parse_svg(chart.timeline(CPU))
    assert root.attrib["width"] == "720" and root.attrib["height"] == "180"
    labels = texts(root)
    assert "peak 300.00M at 2.41s" in labels
    assert labels[0] == "cpu: highest bytes in use per interval"
    assert len(points(root)) == 2 * len(CPU.timeline)  # each interval: its start and end
    xs = [x for x, _ in points(root)]
    assert xs == sorted(xs)
    (dot,) = root.iter(f"{SVG}circle")
    peak_y = {y for (x, y) in points(root) if x == float(dot.attrib["cx"])}
    assert float(dot.attrib["cy"]) in peak_y  # the dot sits on the line at the peak


def test_svg_axis_labels_are_readable_sizes_and_seconds() -> None:
    labels = texts(parse_svg(chart.timeline(CPU)))
    sizes = [label for label in labels if re.fullmatch(r"\d+\.\d\d[BKMGTP]", label)]
    assert sizes == ["0.00B", "100.00M", "200.00M", "300.00M", "400.00M"]
    assert 3 <= len(sizes) <= 5
    assert [label for label in labels if re.fullmatch(r"[\d.]+s", label)] == [
        "0s",
        "1s",
        "2s",
        "3s",
        "4s",
    ]


@pytest.mark.parametrize("peak", [0, 1, 3, 1000, 1023, 1025, 5 * 2**30, 3 * 2**50])
def test_svg_has_three_to_five_size_ticks_covering_the_peak(peak: int) -> None:
    run = DeviceRun("cpu", 0, peak, 1.0, 0, ((1.0, peak),))
    labels = texts(parse_svg(chart.timeline(run)))
    sizes = [label for label in labels if re.fullmatch(r"-?\d+\.\d\d[BKMGTP]", label)]
    assert 3 <= len(sizes) <= 5
    assert sizes[0] == "0.00B"
    assert f"peak {readable_size(peak)} at 1.00s" in labels


def test_svg_of_an_empty_timeline_and_of_one_point() -> None:
    empty = DeviceRun("cuda:1", 0, 5 * M, 0.0, 0, ())
    root = parse_svg(chart.timeline(empty, width=300, height=100))
    assert list(root.iter(f"{SVG}polyline")) == []
    assert "No timeline was recorded; peak 5.00M at 0.00s" in texts(root)

    single = DeviceRun("cpu", 0, 5 * M, 0.0, 0, ((0.0, 5 * M),))
    root = parse_svg(chart.timeline(single))
    assert len(points(root)) == 2
    assert "peak 5.00M at 0.00s" in texts(root)


def test_svg_escapes_the_device_name() -> None:
    run = DeviceRun('<&"dev">', 0, 1, 0.5, 0, ((0.5, 1),))
    assert texts(parse_svg(chart.timeline(run)))[0] == '<&"dev">: highest bytes in use per interval'


# -- HTML ------------------------------------------------------------------------------------


def test_html_has_the_tables_and_one_chart_per_device() -> None:
    fragment = render.html(RECORD)
    root = ET.fromstring(fragment)
    assert len(list(root.iter("svg"))) == 2  # inline in HTML: no namespace, no URL
    assert "http" not in fragment
    cells = ["".join(c.itertext()) for c in root.iter("td")]
    assert cells[7:9] == ["~500.00M", "2.50s"]
    assert "(1024, 65536)" in cells and "Net.forward" in cells
    assert "Allocations by other processes are not counted." in "".join(root.itertext())
    assert "<script" not in fragment


def test_html_escapes_what_the_record_holds() -> None:
    held = Held("<b>x</b>", 4, "other", site="a&b.py:1")
    run = DeviceRun("cpu", 0, 4, 0.1, 0, ((0.1, 4),), largest_at_peak=(held,))
    record = RunRecord({"cpu": run}, (), 0.1, command=("<script>",), notes=("a < b",))
    fragment = render.html(record)
    ET.fromstring(fragment)
    assert "<b>" not in fragment and "<script>" not in fragment
    assert "&lt;b&gt;x&lt;/b&gt;" in fragment


def test_html_of_an_empty_record() -> None:
    fragment = render.html(RunRecord({}, (), 0.0))
    assert "No device was recorded." in "".join(ET.fromstring(fragment).itertext())


def test_page_is_a_standalone_document_without_network_references() -> None:
    document = render.page(RECORD)
    assert document.startswith("<!DOCTYPE html>\n")
    assert '<meta charset="utf-8"/>' in document
    assert "<title>torchmem: where the memory went: train.py --name &#x27;a b&#x27;</title>" in (
        document
    )
    assert "http" not in document
    assert "//" not in document
    assert "<script" not in document and "<link" not in document
    assert "url(" not in document and "@import" not in document and "src=" not in document
    root = ET.fromstring(document)  # well-formed: parses as XML too
    assert root.tag == "html"
    assert [child.tag for child in root] == ["head", "body"]
    assert len(list(root.iter("svg"))) == 2


def test_dataframe_has_a_row_per_device() -> None:
    pd = pytest.importorskip("pandas")
    frame = render.dataframe(RECORD)
    assert list(frame.columns) == [
        "device",
        "start_bytes",
        "peak_bytes",
        "peak_time",
        "end_bytes",
        *(f"{c}_at_peak" for c in CATEGORIES),
    ]
    assert frame["device"].tolist() == ["cpu", "ram"]
    assert frame["peak_bytes"].tolist() == [300 * M, 500 * M]
    assert frame["peak_time"].tolist() == [2.41, 2.5]
    assert frame["other_at_peak"].iloc[0] == 256 * M
    assert pd.isna(frame["other_at_peak"].iloc[1])
    assert render.dataframe(RunRecord({}, (), 0.0)).shape == (0, 5 + len(CATEGORIES))


# -- In a browser ----------------------------------------------------------------------------

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH")


def screenshot(path: Path, png: Path) -> list[str]:
    """Open `path` in headless Chromium, save a screenshot to `png`, and return the lines of
    its log that report the page's console messages and uncaught errors (``INFO:CONSOLE``)."""
    done = subprocess.run(
        [
            browser(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={png}",
            "--window-size=1000,1400",
            "--enable-logging=stderr",
            "--v=0",
            path.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_the_console_check_catches_a_broken_page(tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    broken.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>x</title></head>'
        "<body><p>x</p><script>undefinedFunction();</script></body></html>"
    )
    errors = screenshot(broken, tmp_path / "broken.png")
    assert any("Uncaught ReferenceError" in line for line in errors)


def test_page_renders_in_a_browser_without_errors(tmp_path: Path) -> None:
    report = tmp_path / "run_report.html"
    report.write_text(render.page(RECORD), encoding="utf-8")
    png = tmp_path / "run_report.png"
    assert screenshot(report, png) == []
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert png.stat().st_size > 20_000  # a blank 1000x1400 page is a few kilobytes
