"""What every ``torchmem`` subcommand provides (one module per subcommand)."""

from __future__ import annotations

import argparse
from typing import Protocol


class Command(Protocol):
    """One subcommand: ``torchmem NAME [options]``.

    Its module imports only what ``--help`` needs; PyTorch and the rest of torchmem are
    imported inside :meth:`run`, so ``torchmem --help`` answers at once.
    """

    name: str
    """The word that selects it: ``torchmem NAME``."""
    help: str
    """One line for the list of commands in ``torchmem --help``."""
    description: str
    """What ``torchmem NAME --help`` says above the options."""
    intermixed: bool = False
    """Whether options may come between its positional words (``torchmem snapshot diff
    --json OUT A B``): parsed with ``parse_intermixed_args``, which a command whose last
    positional takes the rest of the line (``torchmem run``) cannot use."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's options to `parser` (its prog is ``torchmem NAME``)."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the command with the parsed `args`; return the exit code.

        Raise :class:`~torchmem.errors.CommandError` for a failure the user can fix.
        """
