"""The timeline chart, read back from its SVG: x in seconds and y in bytes, exact."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from torchmem.records.run import CATEGORIES, DeviceRun, Phase
from torchmem.render import chart

M = 2**20

RUN = DeviceRun(
    "cpu",
    start_bytes=0,
    peak_bytes=36 * M + 5,
    peak_time=0.7,
    end_bytes=8 * M,
    timeline=((0.25, 8 * M), (0.5, 20 * M + 5), (0.75, 36 * M + 5), (1.0, 8 * M)),
    timeline_categories=(
        (7 * M, 0, 0, M, 0, 0, 0),
        (7 * M, 0, 0, M, 0, 12 * M, 5),
        (7 * M, 8 * M, 16 * M, M, 2 * M, 2 * M, 5),
        (7 * M, 0, 0, M, 0, 0, 0),
    ),
)
PHASES = (
    Phase("forward", 0.25, 0.4),
    Phase("backward", 0.4, 0.6),
    Phase("step", 0.6125, 0.7),
    Phase("forward", 0.8, 0.85),
    Phase("step", 0.9000000000000001, 0.95),
)
RECT = re.compile(r"M([^,]+),(\d+)h([^v]+)v(\d+)h-([^z]+)z")


def svg(block: str) -> ET.Element:
    root = ET.fromstring(block)
    (found,) = root.iter("svg")
    return found


def path(root: ET.Element, cls: str) -> str:
    (found,) = (p for p in root.iter("path") if p.get("class") == cls)
    return found.attrib["d"]


def top_bytes(root: ET.Element) -> int:
    left, top, _, height = root.attrib["viewBox"].split()
    assert (left, top) == ("0", "0")
    return int(height)


def test_each_layer_is_its_categorys_bytes_and_they_sum_to_the_total() -> None:
    root = svg(chart.timeline(RUN, PHASES))
    top = top_bytes(root)
    heights: dict[float, dict[str, int]] = {}
    tops: dict[float, int] = {}
    layers = [p for p in root.iter("path") if p.get("class") == "torchmem-layer"]
    assert [p.attrib["data-category"] for p in layers] == list(CATEGORIES)  # none empty here
    for layer in layers:
        for x, y, width, height, back in RECT.findall(layer.attrib["d"]):
            assert width == back
            heights.setdefault(float(x), {})[layer.attrib["data-category"]] = int(height)
            tops[float(x)] = min(tops.get(float(x), top), int(y))
    starts = [0.0, *(end for end, _ in RUN.timeline[:-1])]
    assert sorted(heights) == starts
    for start, (_, total), row in zip(
        starts, RUN.timeline, RUN.timeline_categories or (), strict=True
    ):
        assert sum(heights[start].values()) == total  # exact, at every interval
        assert heights[start] == {c: b for c, b in zip(CATEGORIES, row, strict=True) if b}
        assert tops[start] == top - total  # the stack's top is the total


def test_the_layers_stack_in_the_order_of_the_categories() -> None:
    root = svg(chart.timeline(RUN))
    top = top_bytes(root)
    below = {}
    for layer in (p for p in root.iter("path") if p.get("class") == "torchmem-layer"):
        for x, y, _, height, _ in RECT.findall(layer.attrib["d"]):
            assert int(y) + int(height) == top - below.get(x, 0)  # sits on the layers before
            below[x] = below.get(x, 0) + int(height)


def test_the_step_marks_sit_at_the_optimizer_steps() -> None:
    root = svg(chart.timeline(RUN, PHASES))
    top = top_bytes(root)
    marks = re.findall(r"M([^,]+),0V(\d+)", path(root, "torchmem-step"))
    assert [float(x) for x, _ in marks] == [0.6125, 0.9000000000000001]
    assert {int(y) for _, y in marks} == {top}  # across the whole plot


def test_forward_and_backward_passes_are_bands_at_their_times() -> None:
    root = svg(chart.timeline(RUN, PHASES))
    bands = {
        p.attrib["data-phase"]: p.attrib["d"] for p in root.iter("path") if p.get("data-phase")
    }
    spans = {
        kind: [(float(x), float(w)) for x, w in re.findall(r"M([^,]+),0h([^v]+)v", d)]
        for kind, d in bands.items()
    }
    assert spans == {
        "forward": [(0.25, 0.4 - 0.25), (0.8, 0.85 - 0.8)],
        "backward": [(0.4, 0.6 - 0.4)],
    }


def test_passes_closer_than_a_thousandth_of_the_run_are_one_band() -> None:
    passes = (Phase("forward", 0.1, 0.2), Phase("forward", 0.2005, 0.3), Phase("forward", 0.5, 0.6))
    d = path(svg(chart.timeline(RUN, passes)), "torchmem-phase")
    assert [(float(x), float(w)) for x, w in re.findall(r"M([^,]+),0h([^v]+)v", d)] == [
        (0.1, 0.3 - 0.1),  # 0.5 ms apart in a 1 s run
        (0.5, 0.6 - 0.5),
    ]


def test_many_steps_are_thinned_to_every_nth() -> None:
    steps = tuple(Phase("step", i / 1000, i / 1000 + 0.0005) for i in range(450))
    block = chart.timeline(RUN, steps)
    marks = re.findall(r"M([^,]+),0V", path(svg(block), "torchmem-step"))
    assert [float(x) for x in marks] == [steps[i].start for i in range(0, 450, 3)]
    assert "optimizer step (every 3)" in "".join(ET.fromstring(block).itertext())


def test_the_peak_is_marked_at_its_time_and_bytes() -> None:
    block = chart.timeline(RUN, PHASES)
    root = svg(block)
    top = top_bytes(root)
    (x, bottom, y) = re.fullmatch(r"M([^,]+),(\d+)V(\d+)", path(root, "torchmem-peak")).groups()
    assert (float(x), int(bottom), int(y)) == (0.7, top, top - RUN.peak_bytes)
    (label,) = (
        e for e in ET.fromstring(block).iter("span") if e.get("class") == "torchmem-peak-label"
    )
    assert label.text == "peak 36.00M at 0.70s (37,748,741 bytes)"


def test_the_chart_is_as_wide_as_the_page_in_seconds_and_bytes() -> None:
    root = svg(chart.timeline(RUN, until=2.0))
    assert root.attrib["width"] == "100%" and root.attrib["preserveAspectRatio"] == "none"
    assert root.attrib["viewBox"] == f"0 0 2.0 {40 * M}"  # to the run's end; ticks of 10M


def test_hover_gives_each_intervals_values_exactly() -> None:
    root = svg(chart.timeline(RUN, PHASES))
    hits = [r for r in root.iter("rect") if r.get("class") == "torchmem-hit"]
    assert [(float(r.attrib["x"]), float(r.attrib["width"])) for r in hits] == [
        (0.0, 0.25),
        (0.25, 0.25),
        (0.5, 0.25),
        (0.75, 0.25),
    ]
    assert hits[2].findtext("title") == (
        "0.500s to 0.750s\n"
        "total: 37,748,741 bytes (36.00M)\n"
        "parameters: 7,340,032 bytes (7.00M)\n"
        "gradients: 8,388,608 bytes (8.00M)\n"
        "optimizer_state: 16,777,216 bytes (16.00M)\n"
        "buffers: 1,048,576 bytes (1.00M)\n"
        "communication: 2,097,152 bytes (2.00M)\n"
        "activations: 2,097,152 bytes (2.00M)\n"
        "other: 5 bytes (5.00B)"
    )


def test_a_device_without_categories_is_one_line() -> None:
    run = DeviceRun("ram", 0, 3 * M, 1.5, M, ((1.0, M), (2.0, 3 * M)), exact=False)
    block = chart.timeline(run)
    root = svg(block)
    top = top_bytes(root)
    assert not [p for p in root.iter("path") if p.get("class") == "torchmem-layer"]
    steps = re.findall(r"H([^V]+)V(\d+)H([^HMVz]+)", path(root, "torchmem-line"))
    assert [(float(a), top - int(y), float(b)) for a, y, b in steps] == [
        (0.0, M, 1.0),
        (1.0, 3 * M, 2.0),
    ]
    (hit, _) = (r for r in root.iter("rect") if r.get("class") == "torchmem-hit")
    assert hit.findtext("title") == "0.000s to 1.000s\ntotal: 1,048,576 bytes (1.00M)"
    assert "ram: bytes in use, highest per interval (sampled)" in "".join(
        ET.fromstring(block).itertext()
    )


def size_labels(block: str) -> list[str]:
    spans = ("".join(s.itertext()) for s in ET.fromstring(block).iter("span"))
    return [t for t in spans if re.fullmatch(r"\d+\.\d\d[BKMGTP]", t)]


@pytest.mark.parametrize("peak", [0, 1, 3, 1000, 1023, 1025, 5 * 2**30, 3 * 2**50])
def test_three_to_five_size_ticks_cover_the_peak(peak: int) -> None:
    run = DeviceRun("cpu", 0, peak, 1.0, 0, ((1.0, peak),))
    block = chart.timeline(run)
    sizes = size_labels(block)
    assert 3 <= len(sizes) <= 5 and sizes[0] == "0.00B"
    assert top_bytes(svg(block)) >= peak


def test_seconds_on_the_time_axis() -> None:
    spans = (
        "".join(s.itertext()) for s in ET.fromstring(chart.timeline(RUN, until=4.0)).iter("span")
    )
    assert [t for t in spans if re.fullmatch(r"[\d.]+s", t)] == ["0s", "1s", "2s", "3s", "4s"]
    assert size_labels(chart.timeline(RUN)) == ["0.00B", "10.00M", "20.00M", "30.00M", "40.00M"]


def test_an_empty_timeline_says_so() -> None:
    block = chart.timeline(DeviceRun("cuda:1", 0, 5 * M, 0.0, 0, ()))
    assert not list(ET.fromstring(block).iter("svg"))
    assert "No timeline was recorded; peak 5.00M at 0.00s (5,242,880 bytes)" in block


def test_markup_in_a_device_name_is_escaped() -> None:
    block = chart.timeline(DeviceRun('<&"dev">', 0, 1, 0.5, 0, ((0.5, 1),)))
    assert '<&"dev">: bytes in use' in "".join(ET.fromstring(block).itertext())


def test_coordinates_read_back_as_the_same_float() -> None:
    for value in (0.1, 1e-05, 2.5e-09, 1234.5678, 3):
        text = chart.number(value)
        assert "e" not in text and float(text) == value
