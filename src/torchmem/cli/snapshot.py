"""``torchmem snapshot``: read a PyTorch memory snapshot safely and say what it holds;
``torchmem snapshot diff A B``: what changed between two."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from torchmem.cli.command import Command
from torchmem.errors import CommandError
from torchmem.records import TOP

if TYPE_CHECKING:
    from torchmem.snapshot import Snapshot, SnapshotDiff


class SnapshotCommand(Command):
    name = "snapshot"
    help = "read a PyTorch memory snapshot safely and say what it holds"
    intermixed = True  # torchmem snapshot diff --json OUT A B
    description = (
        "Read a memory snapshot (torch.cuda.memory._dump_snapshot) without running anything"
        " from it, and print what the caching allocator held: per device the bytes"
        " allocated, active and reserved, the peak of its trace and when, the allocation"
        " sites alive at the peak, each segment with the bytes free inside it and its"
        " largest free block, and the out of memory event of the trace where it has one."
        " With --what-if, each device's trace is also replayed through a model of the caching"
        " allocator under other settings (expandable_segments:True, max_split_size_mb:64,"
        " garbage_collection_threshold:0.6, PyTorch's defaults): the reserved peak each"
        " would have given, and how fragmented the memory was at the peak."
        " 'torchmem snapshot diff A B' prints what changed from A to B (a file named diff"
        " is ./diff)."
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = "%(prog)s [options] PATH\n       %(prog)s diff [options] A B"
        parser.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
        parser.add_argument("--html", metavar="OUT", help="write a self-contained HTML page to OUT")
        parser.add_argument(
            "--top",
            type=int,
            default=TOP,
            metavar="N",
            help="list N sites and segments (default: %(default)s)",
        )
        parser.add_argument(
            "--what-if",
            action="store_true",
            help="replay each trace under other allocator settings: the reserved peak each"
            " would have given, and the fragmentation at the peak",
        )
        parser.add_argument("paths", nargs="*", metavar="PATH", help="a snapshot (a pickle)")

    def run(self, args: argparse.Namespace) -> int:
        from torchmem.render import snapshot

        if args.top < 1:
            raise CommandError(f"--top must be at least 1, not {args.top}", 2)
        paths: list[str] = args.paths
        if not paths:
            raise CommandError("nothing to read: give a snapshot PATH, or diff A B", 2)
        if paths[0] == "diff":
            if len(paths) != 3:
                raise CommandError("diff compares two snapshots: diff A B", 2)
            if args.html or args.what_if:
                option = "--html" if args.html else "--what-if"
                raise CommandError(f"{option} shows one snapshot, not a diff", 2)
            diff = _load(paths[1]).diff(_load(paths[2]))
            _save_json(args.json, diff)
            print(snapshot.diff_text(diff, args.top))
            return 0
        if len(paths) != 1:
            raise CommandError(f"one snapshot at a time (or diff A B), not {len(paths)}", 2)
        loaded = _load(paths[0], args.what_if)
        _save_json(args.json, loaded)
        if args.html:
            dataclasses.replace(loaded, top=args.top).save_html(args.html)
        print(snapshot.text(loaded, args.top))
        return 0


def _load(path: str, what_if: bool = False) -> Snapshot:
    from torchmem.errors import SnapshotError
    from torchmem.snapshot import load_snapshot

    try:
        return load_snapshot(path, what_if)
    except SnapshotError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None


def _save_json(path: str | None, report: Snapshot | SnapshotDiff) -> None:
    """Write `report` as JSON to `path`, where one is given: only then is it made (the JSON
    of a snapshot can be far larger than its file)."""
    if path:
        Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")
