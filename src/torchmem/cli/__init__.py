"""The ``torchmem`` command line: ``main(argv) -> exit code``, one module per subcommand.

A new subcommand is one module here with a :class:`~torchmem.cli.command.Command`, and one
entry in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchmem._version import __version__
from torchmem.cli.build import BuildCommand
from torchmem.cli.command import Command
from torchmem.cli.devices import DevicesCommand
from torchmem.cli.run import RunCommand
from torchmem.errors import CommandError

COMMANDS: list[Command] = [RunCommand(), DevicesCommand(), BuildCommand()]
"""Every subcommand, in the order ``torchmem --help`` lists them."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); return the exit code.

    Without a command, print the help. The words before the command are torchmem's own
    options; the words after it go to the command's parser, so a usage error shows the
    usage of the part that was wrong.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="torchmem",
        description="PyTorch memory: where a script's memory went, devices, builds.",
        epilog="Run 'torchmem COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"torchmem {__version__}")
    listing = parser.add_subparsers(metavar="COMMAND")
    commands = {}
    for command in COMMANDS:
        command_parser = listing.add_parser(
            command.name, help=command.help, description=command.description
        )
        command.prepare_parser(command_parser)
        commands[command.name] = command, command_parser
    # The first word that names a command ends torchmem's own options.
    at = next((i for i, word in enumerate(words) if word in commands), len(words))
    try:
        parser.parse_args(words[:at])  # never reaches a command's parser: no command word
        if at == len(words):
            parser.print_help()
            return 0
        command, command_parser = commands[words[at]]
        args = command_parser.parse_args(words[at + 1 :])
    except SystemExit as exc:  # argparse after --help, --version or a usage error
        return int(exc.code or 0)
    try:
        return command.run(args)
    except CommandError as exc:
        print(f"{command_parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """Entry point of the installed ``torchmem`` script."""
    sys.exit(main())
