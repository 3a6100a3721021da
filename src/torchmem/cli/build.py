"""``torchmem build``: build the counting CPU allocator ahead of time."""

from __future__ import annotations

import argparse

from torchmem.cli.command import Command
from torchmem.errors import BuildError, CommandError


class BuildCommand(Command):
    name = "build"
    help = "build the counting CPU allocator now (for container images)"
    description = (
        "Build torchmem's counting CPU allocator for the installed torch with this machine's"
        " C++ compiler ($CXX, else c++, g++ or clang++), cache it (in $TORCHMEM_CACHE_DIR,"
        " else $XDG_CACHE_HOME/torchmem, else ~/.cache/torchmem), load it and self-test it."
        " Otherwise the first use of a CPU meter builds it (about a second)."
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--force", action="store_true", help="rebuild even if cached")

    def run(self, args: argparse.Namespace) -> int:
        from torchmem.meters import native

        try:
            path = native.build(force=args.force)
            native.load()
        except BuildError as exc:
            raise CommandError(f"cannot build the counting CPU allocator: {exc}") from None
        print(f"built and self-tested: {path}")
        return 0
