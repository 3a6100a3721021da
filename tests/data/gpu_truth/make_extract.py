"""Compact extracts of real CUDA memory snapshots, for tests that run without the snapshots.

An extract keeps what the caching-allocator model and the snapshot reader need, and no
frames: the segments and blocks at the snapshot (address, bytes, stream, pool, each block's
address, bytes and state) and every trace entry of device 0 (action, address, bytes,
stream). :func:`snapshot` turns it back into a snapshot dict without frames or times.

Regenerate after adding a snapshot to the folder (read with torchmem's restricted loader,
so nothing in the files runs)::

    python tests/data/gpu_truth/make_extract.py ../shared/gpu-truth
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")
"""The trace's actions the extract keeps, by their index there; others are left out."""
STATES = ("active_allocated", "active_pending_free", "inactive")


def extract(data: dict[str, Any]) -> dict[str, Any]:
    """The extract of a snapshot dict (``torch.cuda.memory._snapshot()``) with one device."""
    segments = [
        [
            s["address"],
            s["total_size"],
            s["stream"],
            s["segment_type"],
            [[b["address"], b["size"], STATES.index(b["state"])] for b in s["blocks"]],
        ]
        for s in sorted(data["segments"], key=lambda s: s["address"])
    ]
    trace = [
        [ACTIONS.index(e["action"]), e["addr"], e["size"], e["stream"]]
        for e in data["device_traces"][0]
        if e["action"] in ACTIONS
    ]
    return {"segments": segments, "trace": trace}


def snapshot(found: dict[str, Any]) -> dict[str, Any]:
    """A snapshot dict of an extract, in PyTorch's format, without frames and times."""
    segments = [
        {
            "device": 0,
            "address": address,
            "total_size": size,
            "stream": stream,
            "segment_type": pool,
            "blocks": [{"address": a, "size": n, "state": STATES[k]} for a, n, k in blocks],
        }
        for address, size, stream, pool, blocks in found["segments"]
    ]
    trace = [
        {"action": ACTIONS[k], "addr": address, "size": size, "stream": stream}
        for k, address, size, stream in found["trace"]
    ]
    return {"segments": segments, "device_traces": [trace]}


def path_of(name: str) -> Path:
    """The extract of the snapshot file `name` (``x.pickle``): ``x.json.gz`` here."""
    return HERE / f"{Path(name).stem}.json.gz"


def read(name: str) -> dict[str, Any]:
    """The stored extract of the snapshot file `name`."""
    with gzip.open(path_of(name), "rt", encoding="utf-8") as file:
        found: dict[str, Any] = json.load(file)
    return found


def main(folder: str) -> None:
    from torchmem.snapshot import _Unpickler

    for path in sorted(Path(folder).glob("*.pickle")):
        with path.open("rb") as file:
            data = _Unpickler(file, str(path)).load()
        text = json.dumps(extract(data), separators=(",", ":"))
        with gzip.GzipFile(path_of(path.name), "wb", mtime=0) as out:  # the same bytes each time
            out.write(text.encode())
        print(f"{path_of(path.name).name}: {path_of(path.name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
