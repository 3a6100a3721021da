#!/usr/bin/env bash
# Install PyTorch and torchmem, then show the memory of every GPU and of this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m pip install --quiet "torch==2.13.0"
"$PYTHON" -m pip install --quiet -e .
"$PYTHON" -m torchmem devices
