#!/usr/bin/env bash
# Set up the environment (see env.sh), install torchmem with its development tools, then lint,
# type-check, build the documentation (strict, into a temporary directory) and run the test
# suite's lanes in parallel under coverage, printing the 30 slowest tests of each run.
# Extra arguments go to pytest (e.g. scripts/test.sh -k tensor).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Python's bytecode caches (the gitignored __pycache__ folders) are written even where
# PYTHONDONTWRITEBYTECODE is set: without them every one of the hundreds of processes the
# tests start compiles torchmem anew, and every pytest process rewrites every test module.
unset PYTHONDONTWRITEBYTECODE
install_dev
"$PY" -m ruff check src tests benchmarks
"$PY" -m ruff format --check src tests benchmarks
# The type check and the manual's build run beside the unit lane (they use one core, for
# half a minute); what they print comes after it.
checks="$(mktemp)"
("$PY" -m mypy && "$PY" -m mkdocs build --strict --site-dir "$(mktemp -d)") >"$checks" 2>&1 &
checking=$!
"$PY" -m coverage erase
# The lanes (tests/lanes.py) on every core: the unit lane first, by itself, where its guard
# sees any process or counting allocator a unit test starts; then the other two, together so
# that the workers stay busy; then the tests marked `alone`, one at a time. pytest's exit
# code 5 is "no test selected" (an -m or -k that leaves a run empty).
unit=0
"$PY" -m coverage run -m pytest --lane unit -m "not alone" -n auto --durations=30 "$@" || unit=$?
checked=0
wait "$checking" || checked=$?
cat "$checks"
rm -f "$checks"
[[ $checked == 0 && ($unit == 0 || $unit == 5) ]]
"$PY" -m coverage run -m pytest --lane integration --lane slow -m "not alone" -n auto \
    --durations=30 "$@" || [[ $? == 5 ]]
"$PY" -m coverage run -m pytest -m alone "$@" || [[ $? == 5 ]]
"$PY" -m coverage combine --quiet
"$PY" -m coverage report
