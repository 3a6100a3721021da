"""The stacks at the peak as an icicle: exact bytes from the root, the peak, to the leaves."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from torchmem.records.run import DeviceRun, Site, SiteStack
from torchmem.render import icicle

M = 2**20
TORCH = "/usr/lib/python3/site-packages/torch/nn/modules/linear.py"


def device(model: Path) -> DeviceRun:
    """Three sites under one script, one without a stack, and 1,000 bytes no site names."""
    sites = (
        Site(
            "train.py",
            41,
            "main",
            4 * M,
            stacks=(SiteStack(4 * M, (("train.py", 41, "main"), ("train.py", 90, "<module>"))),),
            source="losses.append(loss)",
        ),
        Site(
            str(model),
            2,
            "Net.forward",
            M,
            stacks=(
                SiteStack(
                    M,
                    (
                        (TORCH, 125, "forward"),
                        (str(model), 2, "Net.forward"),
                        ("train.py", 40, "main"),
                        ("train.py", 90, "<module>"),
                    ),
                ),
            ),
        ),
        Site("train.py", 30, "main", 3 * M + 7),  # no stack: under the root
        Site("<before recording>", 0, "", 8192),
        Site("train.py", 31, "main", 4000),  # under 1/2000 of the peak: not drawn
    )
    peak = sum(s.bytes for s in sites) + 8000
    return DeviceRun("cpu", 0, peak, 1.0, 0, ((1.0, peak),), sites_at_peak=sites)


def model_file(tmp_path: Path) -> Path:
    model = tmp_path / "model.py"
    model.write_text("def forward(self, x):\n    return self.fc(x)  # the line\n")
    return model


def test_the_boxes_sum_to_the_peak_exactly(tmp_path: Path) -> None:
    run = device(model_file(tmp_path))
    boxes = icicle.boxes(icicle.tree(run))
    assert boxes[0].node.frame is None and boxes[0].node.bytes == run.peak_bytes
    leaves = [b.node.bytes for b in boxes if not b.node.children]
    assert sum(leaves) == run.peak_bytes == 8 * M + 7 + 8192 + 4000 + 8000
    for box in boxes:  # a box holds exactly what lies under it (no site ends inside here)
        if box.node.children:
            assert sum(c.bytes for c in box.node.children.values()) == box.node.bytes


def test_outermost_frame_on_top_and_each_site_at_its_own_line(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    root = icicle.tree(device(model))
    assert [(f, n.bytes) for f, n in root.children.items()] == [
        (("train.py", 90, "<module>"), 5 * M),
        (("train.py", 30, "main"), 3 * M + 7),
        (("<before recording>", 0, ""), 8192),
        (("train.py", 31, "main"), 4000),
        ((icicle.UNNAMED, 0, ""), 8000),
    ]
    script = root.children[("train.py", 90, "<module>")]
    assert [(f, n.bytes) for f, n in script.children.items()] == [
        (("train.py", 41, "main"), 4 * M),
        (("train.py", 40, "main"), M),
    ]
    forward = script.children[("train.py", 40, "main")].children[(str(model), 2, "Net.forward")]
    assert list(forward.children) == [(TORCH, 125, "forward")]  # the library's line, innermost


def test_boxes_lie_within_their_parent_left_to_right(tmp_path: Path) -> None:
    boxes = icicle.boxes(icicle.tree(device(model_file(tmp_path))))
    where = {id(b.node): b for b in boxes}
    for box in boxes:
        offset = box.offset
        for child in sorted(box.node.children.values(), key=lambda c: -c.bytes):
            placed = where[id(child)]
            assert (placed.depth, placed.offset) == (box.depth + 1, offset)
            offset += child.bytes
        assert offset <= box.offset + box.node.bytes


def test_html_has_a_box_per_frame_with_its_line_on_hover(tmp_path: Path) -> None:
    model = model_file(tmp_path)
    run = device(model)
    root = ET.fromstring(icicle.html(run))
    boxes = [d for d in root.iter("div") if d.get("class") == "torchmem-box"]
    assert len(boxes) == len(icicle.boxes(icicle.tree(run))) - 1 == 9  # train.py:31 too small
    assert "main (train.py:31)" not in [b.text for b in boxes]
    (top,) = (b for b in boxes if b.attrib["data-depth"] == "0")
    assert int(top.attrib["data-bytes"]) == run.peak_bytes
    assert top.text == "all alive at the peak: 8,408,807 bytes (8.02M)"
    titles = {b.text: b.attrib["title"] for b in boxes}
    assert titles["main (train.py:41)"] == (
        "main\ntrain.py:41\n4,194,304 bytes (4.00M)\nlosses.append(loss)"
    )
    # A user's line the record has no text for is read from its file.
    assert titles["Net.forward (model.py:2)"].endswith("\nreturn self.fc(x)  # the line")
    # Library lines name their frame only.
    assert titles["forward (linear.py:125)"] == f"forward\n{TORCH}:125\n1,048,576 bytes (1.00M)"
    assert titles["<before recording>"] == "<before recording>\n8,192 bytes (8.00K)"


def test_no_sites_no_icicle() -> None:
    assert icicle.html(DeviceRun("ram", 0, 5, 1.0, 0, ((1.0, 5),))) == ""


def test_a_line_reached_two_ways_draws_each_way_with_its_own_bytes() -> None:
    """Two callers of one line, and bytes of the line that kept no stack."""
    line = ("model.py", 9, "forward")
    train = (line, ("train.py", 18, "train_step"), ("train.py", 30, "<module>"))
    evaluate = (line, ("train.py", 12, "evaluate"), ("train.py", 30, "<module>"))
    site = Site(*line, 7 * M, (SiteStack(4 * M, train), SiteStack(2 * M, evaluate)))
    root = icicle.tree(DeviceRun("cpu", 0, 7 * M, 1.0, 0, ((1.0, 7 * M),), sites_at_peak=(site,)))
    assert [(f, n.bytes) for f, n in root.children.items()] == [
        (("train.py", 30, "<module>"), 6 * M),
        (line, M),  # no stack: under the root
    ]
    script = root.children[("train.py", 30, "<module>")]
    assert [(f, n.bytes, list(n.children)) for f, n in script.children.items()] == [
        (("train.py", 18, "train_step"), 4 * M, [line]),
        (("train.py", 12, "evaluate"), 2 * M, [line]),
    ]
