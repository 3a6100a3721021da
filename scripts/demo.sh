#!/usr/bin/env bash
# Install PyTorch and torchmem, show the memory of every GPU and of this machine, then run the
# example training script under `torchmem run`: where its memory went.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m pip install --quiet "torch==2.13.0"
"$PYTHON" -m pip install --quiet -e .
"$PYTHON" -m torchmem devices
"$PYTHON" -m torchmem run examples/train.py
