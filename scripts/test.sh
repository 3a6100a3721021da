#!/usr/bin/env bash
# Set up the environment (see env.sh), install torchmem with its development tools, then lint,
# type-check, build the documentation (strict, into a temporary directory) and run the test
# suite under coverage.
# Extra arguments go to pytest (e.g. scripts/test.sh -k tensor).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
"$PY" -m pip install --quiet -e ".[dev]"
"$PY" -m ruff check src tests benchmarks
"$PY" -m ruff format --check src tests benchmarks
"$PY" -m mypy
"$PY" -m mkdocs build --strict --site-dir "$(mktemp -d)"
"$PY" -m coverage run -m pytest "$@"
"$PY" -m coverage report
