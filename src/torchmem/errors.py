"""torchmem's exceptions."""


class TorchmemError(Exception):
    """Base class of the errors torchmem raises itself."""


class CliError(TorchmemError):
    """A user error on the command line: the message is printed and the CLI exits with `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
