#!/usr/bin/env bash
# Set up the environment (see env.sh) and install torchmem, show the memory of every GPU and of
# this machine, then run the example training script under `torchmem run`: where its memory went.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
"$PY" -m pip install --quiet -e .
"$PY" -m torchmem devices
"$PY" -m torchmem run examples/train.py
