"""The ``torchmem`` command line: ``main(argv) -> exit code``, one module per subcommand.

A new subcommand is one module here with a :class:`~torchmem.cli.command.Command`, and one
entry in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol, TextIO

from torchmem._version import __version__
from torchmem.cli.build import BuildCommand
from torchmem.cli.command import Command
from torchmem.cli.devices import DevicesCommand
from torchmem.cli.estimate import EstimateCommand
from torchmem.cli.run import RunCommand
from torchmem.cli.snapshot import SnapshotCommand
from torchmem.errors import CommandError

COMMANDS: list[Command] = [
    RunCommand(),
    EstimateCommand(),
    SnapshotCommand(),
    DevicesCommand(),
    BuildCommand(),
]
"""Every subcommand, in the order ``torchmem --help`` lists them."""

BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE if hasattr(signal, "SIGPIPE") else 1
"""The exit code when the reader of the output went away (``torchmem devices | head -0``):
what a shell reports for a tool that SIGPIPE ended (141), 1 where there is no SIGPIPE."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); return the exit code
    (130 where Ctrl-C ended it: :func:`run`, the installed command, dies by SIGINT then).

    Without a command, print the help. The words before the command are torchmem's own
    options; the words after it go to the command's parser, so a usage error shows the
    usage of the part that was wrong.

    Output that cannot be written (a full disk, ``> /dev/full``) ends it with one line on
    stderr and exit code 1; a reader that went away (a broken pipe) ends it quietly with
    :data:`BROKEN_PIPE_EXIT`.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: Sequence[str] | None) -> int:
    """:func:`main`, but Ctrl-C raises KeyboardInterrupt out of it."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(
        prog="torchmem",
        description=(
            "PyTorch memory: where a script's memory went, estimates, snapshots, devices, builds."
        ),
        epilog="Run 'torchmem COMMAND --help' for a command's options.",
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="show program's version number and exit"
    )
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
    prog = parser.prog
    try:
        try:
            parser.parse_args(words[:at])  # never reaches a command's parser: no command word
            if at == len(words):
                parser.print_help()
                return _flushed(0)
            command, command_parser = commands[words[at]]
            prog = command_parser.prog
            parse = (
                command_parser.parse_intermixed_args
                if command.intermixed
                else command_parser.parse_args
            )
            args = parse(words[at + 1 :])
        except SystemExit as exc:  # argparse after --help, --version or a usage error
            return _flushed(int(exc.code or 0))
        try:
            return _flushed(command.run(args))
        except CommandError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exc.exit_code
    except OSError as exc:
        return _output_failed(exc, prog)


class _Writer(Protocol):
    def write(self, text: str, /) -> object: ...


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but its help goes out through a plain ``write``: argparse itself
    ignores a failed write, and ``torchmem --help > /dev/full`` would exit 0."""

    def print_help(self, file: _Writer | None = None) -> None:
        (sys.stdout if file is None else file).write(self.format_help())


class _Version(argparse.Action):
    """``--version``: print it through a plain ``write`` (see :class:`_Parser`), exit 0."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        sys.stdout.write(f"torchmem {__version__}\n")
        parser.exit()


def _flushed(code: int) -> int:
    """`code`, once what was printed to stdout is written: a failure shows here, not as
    a traceback when Python flushes at exit."""
    if sys.stdout is not None:
        sys.stdout.flush()
    return code


def _output_failed(error: OSError, prog: str) -> int:
    """Say why in one line on stderr (nothing for a broken pipe), and return the exit
    code. stdout or stderr, where it is the stream that failed, is pointed at the null
    device, so that Python's own flush at exit fails no more."""
    _unwritable(sys.stdout)
    stderr_failed = _unwritable(sys.stderr)
    if isinstance(error, BrokenPipeError):
        return BROKEN_PIPE_EXIT
    if not stderr_failed:
        # A file of ours (--json PATH) is named in the error; stdout has no name.
        why = error if error.filename is not None else error.strerror or error
        with contextlib.suppress(OSError, ValueError):
            print(f"{prog}: error: {why}", file=sys.stderr, flush=True)
    return 1


def _unwritable(stream: TextIO | None) -> bool:
    """Whether `stream` fails to flush; if so, its file descriptor now goes to the null
    device (where it has one), and what it held is dropped there."""
    if stream is None:
        return False
    try:
        stream.flush()
    except (OSError, ValueError):  # ValueError: closed
        pass
    else:
        return False
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)
    return True


def run() -> None:
    """Entry point of the installed ``torchmem`` script (and ``python -m torchmem``).

    Ctrl-C ends it as it ends ``python``: once the atexit handlers have run, the process
    dies by SIGINT, so that the shell (a loop over runs) sees the interrupt. What was
    interrupted has said so already (``torchmem run`` shows the script's traceback and
    the report): Python's own traceback of it is left out.
    """
    try:
        code = _main(None)
    except KeyboardInterrupt:
        sys.excepthook = _quiet_about_interrupts(sys.excepthook)
        raise  # Python's exit for an uncaught KeyboardInterrupt is a death by SIGINT
    sys.exit(code)


def _quiet_about_interrupts(hook: Callable[..., object]) -> Callable[..., object]:
    """`hook` (``sys.excepthook``), but silent for KeyboardInterrupt."""

    def quiet(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            hook(kind, error, tb)

    return quiet
