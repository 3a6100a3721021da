"""``python -m torchmem``: the same command line as the ``torchmem`` script."""

from torchmem.cli import run

if __name__ == "__main__":
    run()
