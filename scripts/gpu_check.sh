#!/usr/bin/env bash
# On a machine with a CUDA GPU: run every test marked `cuda`, the CUDA benchmarks, and record
# real-GPU ground truth (snapshots of known training steps with the allocator's counters)
# into tests/data/gpu_truth/recorded/, which the CPU tests then check against. Commit what it
# changed in tests/data/ and benchmarks/RESULTS-cuda.md.
#
#   bash scripts/gpu_check.sh             # install torchmem with its dev tools first (test.sh's way)
#   bash scripts/gpu_check.sh --offline   # use the python on PATH and its packages as they are
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--offline" ]]; then
    PY="${PYTHON:-python3}"
    "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .
else
    source scripts/env.sh
    install_dev
fi
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU here')"
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
status=0
"$PY" -m pytest -m cuda -q -rs -p no:cacheprovider tests || status=$?
"$PY" scripts/gpu_truth.py || status=$?
"$PY" -m benchmarks.cuda || status=$?
exit $status
