"""torchmem's exceptions."""


class TorchmemError(Exception):
    """Base class of the errors torchmem raises itself."""
