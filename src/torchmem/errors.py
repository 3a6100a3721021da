"""torchmem's exceptions."""


class TorchmemError(Exception):
    """Base class of the errors torchmem raises itself."""


class CommandError(TorchmemError):
    """A ``torchmem`` command cannot do what was asked: the command line prints the message
    as one line and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TorchmemWarning(UserWarning):
    """Something torchmem could not do as well as it would have liked (it says what it
    does instead)."""
