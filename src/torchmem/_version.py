"""torchmem's version: read from the installed package's metadata, whose one source is
``pyproject.toml``. Imports nothing heavy, so ``torchmem --version`` stays fast."""

from importlib import metadata

try:
    __version__ = metadata.version("torchmem")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
