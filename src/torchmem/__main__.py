"""``python -m torchmem``: the same command line as the ``torchmem`` script."""

import sys

from torchmem.cli import main

if __name__ == "__main__":
    sys.exit(main())
