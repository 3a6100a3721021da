"""The ``torchmem`` command line: ``main(argv) -> exit code``, one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchmem import __version__
from torchmem.cli import devices

_COMMANDS = {"devices": devices}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); return the exit code."""
    parser = argparse.ArgumentParser(
        prog="torchmem", description="PyTorch memory: devices, peaks, profiles."
    )
    parser.add_argument("--version", action="version", version=f"torchmem {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in _COMMANDS.items():
        module.add_parser(commands, name)
    try:
        args = parser.parse_args(argv)
        return _COMMANDS[args.command].run(args)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2


def run() -> None:
    """Entry point of the installed ``torchmem`` script."""
    sys.exit(main())
