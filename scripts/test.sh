#!/usr/bin/env bash
# Install PyTorch and torchmem with its development tools, then lint, type-check and run the
# tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k tensor).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m pip install --quiet "torch==2.13.0"
"$PYTHON" -m pip install --quiet -e ".[dev]"
"$PYTHON" -m ruff check src tests benchmarks
"$PYTHON" -m ruff format --check src tests benchmarks
"$PYTHON" -m mypy
"$PYTHON" -m pytest "$@"
