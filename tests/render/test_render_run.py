"""The run report's renderers, exact to the character on hand-made records."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from torchmem.records.run import (
    CATEGORIES,
    DeviceRun,
    Held,
    ModulePeak,
    RunRecord,
    Site,
    SiteStack,
)
from torchmem.render import chart, kit, run as render

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
        "buffers": 2 * M,
        "activations": 20 * M,
        "other": 256 * M,
    },
    categories_at_end={
        "parameters": 8 * M,
        "gradients": 8 * M,
        "optimizer_state": 16 * M,
        "buffers": 2 * M,
        "activations": 0,
        "other": 8 * M,
    },
    sites_at_peak=(
        Site("train.py", 42, "step", 256 * M, source="big = torch.empty(1024, 65536)"),
        Site("model.py", 10, "Net.forward", 20 * M, source="h = torch.relu(self.fc1(x))"),
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
    ModulePeak("", "Net", "cpu", 280 * M, 300 * M, 1, 20 * M, 24 * M),
    ModulePeak("fc1", "Linear", "cpu", 100 * M, 290 * M, 3, 12 * M, 10 * M),
    ModulePeak("relu", "ReLU", "cpu", 120 * M, None, 3, 16 * M, None),
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
  buffers                2.00M       2.00M
  activations           20.00M       0.00B
  other                256.00M       8.00M

Allocation sites alive at the peak on cpu:
  256.00M  train.py:42         step         big = torch.empty(1024, 65536)
   20.00M  model.py:10         Net.forward  h = torch.relu(self.fc1(x))
    1.00M  <before recording>  <module>

Largest allocations alive at the peak on cpu:
  256.00M  big                other       (1024, 65536)  torch.float32  train.py:42
    8.00M  fc1.weight         parameters  (2048, 1024)   torch.float32  -
  512.00B  Tensor@train.py:7  other       -              -              -

Modules on cpu: what a forward call added and kept, how far a backward rose:
  module  type    forward kept  backward rise  calls
  (top)   Net           20.00M         24.00M      1
  relu    ReLU          16.00M              -      3
  fc1     Linear        12.00M         10.00M      3

Notes:
  - Allocations by other processes are not counted."""


def test_text_of_a_full_record() -> None:
    assert render.text(RECORD, width=100) == EXPECTED


def test_top_cuts_the_lists_and_says_what_was_left_out() -> None:
    head = EXPECTED[: EXPECTED.index("Allocation sites")]
    assert render.text(RECORD, top=2, width=100) == head + (
        """\
Allocation sites alive at the peak on cpu:
  256.00M  train.py:42  step         big = torch.empty(1024, 65536)
   20.00M  model.py:10  Net.forward  h = torch.relu(self.fc1(x))
  ... and 1 more site (1.00M)

Largest allocations alive at the peak on cpu:
  256.00M  big         other       (1024, 65536)  torch.float32  train.py:42
    8.00M  fc1.weight  parameters  (2048, 1024)   torch.float32  -
  ... and 1 more allocation (512.00B)

Modules on cpu: what a forward call added and kept, how far a backward rose:
  module  type  forward kept  backward rise  calls
  (top)   Net         20.00M         24.00M      1
  relu    ReLU        16.00M              -      3
  ... and 1 more module

Notes:
  - Allocations by other processes are not counted."""
    )


def test_modules_by_what_their_forward_kept_ties_in_order_of_first_call() -> None:
    modules = (
        ModulePeak("a", "Linear", "cpu", 900 * M, 950 * M, 1, 4096, 8192),
        ModulePeak("b", "ReLU", "cpu", 10 * M, None, 1, 8192, None),
        ModulePeak("c", "Linear", "cpu", 800 * M, 990 * M, 2, 4096, 0),
    )
    lines = render.text(RunRecord({}, modules, 1.0), width=100).splitlines()
    start = lines.index(
        "Modules on cpu: what a forward call added and kept, how far a backward rose:"
    )
    assert lines[start + 1 :] == [
        "  module  type    forward kept  backward rise  calls",
        "  b       ReLU           8.00K              -      1",
        "  a       Linear         4.00K          8.00K      1",
        "  c       Linear         4.00K          0.00B      2",
    ]  # the absolute peaks (900M, 990M, ...) stay in the JSON


def test_the_source_of_a_site_is_cut_to_the_width() -> None:
    sites = (
        Site("train.py", 41, "main", 4 * M, source="losses.append(loss)  # keeps every graph"),
        Site("/very/long/path/to/the/project/data.py", 7, "load", M, source="x = y"),
    )
    run = DeviceRun("cpu", 0, 5 * M, 1.0, 0, ((1.0, 5 * M),), sites_at_peak=sites)
    record = RunRecord({"cpu": run}, (), 1.0)

    def sites_of(width: int) -> list[str]:
        lines = render.text(record, width=width).splitlines()
        start = lines.index("Allocation sites alive at the peak on cpu:")
        return lines[start + 1 : start + 3]

    assert sites_of(120) == [
        "  4.00M  train.py:41                               main  "
        "losses.append(loss)  # keeps every graph",
        "  1.00M  /very/long/path/to/the/project/data.py:7  load  x = y",
    ]
    assert sites_of(85)[0] == (
        "  4.00M  train.py:41                               main  losses.append(loss)  # ke..."
    )
    assert sites_of(80)[0].endswith("  main  losses.append(loss)...")  # no space before ...
    assert sites_of(20) == sites_of(80)  # however narrow the terminal, the line's start shows


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
        "  buffers                    -\n"
        "  activations            4.00M\n"
        "  other                      -\n"
        "  odd                    1.00B\n"
        "\n"
        "What the memory on cpu was:\n"
        "  category         at the peak\n"
        "  parameters                 -\n"
        "  gradients                  -\n"
        "  optimizer_state            -\n"
        "  buffers                    -\n"
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
        "Modules on cpu: what a forward call added and kept, how far a backward rose:\n"
        "  module  type  forward kept  backward rise  calls\n"
        "  (top)   Net          0.00B              -      2\n"
        "\n"
        "Notes:\n"
        "  - n."
    )


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
    (script,) = root.iter("script")  # the charts' hover, once, inline
    assert script.text == f"\n{chart.SCRIPT}" and not script.attrib
    sources = [c for c in root.iter("td") if c.find("code") is not None]
    assert ["".join(c.itertext()) for c in sources] == [
        "big = torch.empty(1024, 65536)",
        "h = torch.relu(self.fc1(x))",
        "",
    ]


def test_html_shows_the_stacks_at_the_peak_after_the_sites() -> None:
    root = ET.fromstring(render.html(RECORD))
    titles = ["".join(h.itertext()) for h in root.iter("h4")]
    at = titles.index("Allocation sites alive at the peak on cpu:")
    assert titles[at + 1].startswith("Stacks alive at the peak on cpu")
    (icicle,) = (d for d in root.iter("div") if d.get("class") == "torchmem-icicle")
    (top,) = (d for d in icicle if d.get("data-depth") == "0")
    assert int(top.attrib["data-bytes"]) == CPU.peak_bytes  # 23M named by no site: a box too


def test_long_cells_are_cut_in_the_middle_and_shapes_never_wrap() -> None:
    path = "/home/someone/projects/a-rather-long-project-name/src/package/models/transformer.py:120"
    held = Held("w", 4 * M, "parameters", (1024, 1024), "torch.float32", site=path)
    run = DeviceRun("cpu", 0, 4 * M, 0.1, 0, ((0.1, 4 * M),), largest_at_peak=(held,))
    root = ET.fromstring(render.html(RunRecord({"cpu": run}, (), 0.1)))
    (table,) = (t for t in root.iter("table") if "(1024, 1024)" in "".join(t.itertext()))
    assert "white-space: nowrap" in table.attrib["style"]
    (cut,) = (s for s in table.iter("span") if s.get("title") == path)
    assert cut.text == "/home/someone/.../src/package/models/transformer.py:120"
    assert len(cut.text) <= kit.LONG


def test_html_escapes_what_the_record_holds() -> None:
    held = Held("<b>x</b>", 4, "other", site="a&b.py:1")
    run = DeviceRun("cpu", 0, 4, 0.1, 0, ((0.1, 4),), largest_at_peak=(held,))
    record = RunRecord({"cpu": run}, (), 0.1, command=("<script>",), notes=("a < b",))
    fragment = render.html(record)
    ET.fromstring(fragment)
    ours = f"<script>\n{chart.SCRIPT}</script>"
    assert "<b>x" not in fragment and "<script>" not in fragment.replace(ours, "")
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
    assert document.count("<script") == 1 and "<link" not in document
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


def test_a_notebook_cells_site_reads_as_ipython_says_it() -> None:
    stacks = (SiteStack(4 * M, (("In [4]", 3, "<module>"),)),)
    cell = Site("In [4]", 3, "<module>", 4 * M, stacks, source="y = f(x)")
    run = DeviceRun("cpu", 0, 4 * M, 1.0, 0, ((1.0, 4 * M),), sites_at_peak=(cell,))
    record = RunRecord({"cpu": run}, (), 1.0)
    assert "  4.00M  In [4], line 3  <module>  y = f(x)" in render.text(record, width=100)
    boxes = [d for d in ET.fromstring(render.html(record)).iter("div") if d.get("data-depth")]
    assert [b.text for b in boxes][1] == "<module> (In [4], line 3)"
