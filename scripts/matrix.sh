#!/usr/bin/env bash
# The test suite on the edges of what pyproject.toml admits, each in its own virtual
# environment under .matrix/:
#   newest:  Python 3.12 with the newest PyTorch (sys.monitoring line tracing, IPython 9)
#   oldest:  Python 3.10 with the oldest PyTorch admitted (settrace line tracing, IPython 8)
# Run it when a tracing or meter change lands, and record its summary in CHANGELOG.md.
# Each edge's pytest output is also kept in .matrix/<edge>.log.
# Off a machine with a CPU build on disk, each PyTorch is a download of several GB; pip's
# cache keeps it for the next run. Extra arguments go to pytest (e.g. -m "not slow").
# Choose the interpreters with PYTHON_NEWEST and PYTHON_OLDEST (default: python3.12 and
# python3.10 on PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

TORCH_FLOOR="2.10.0"  # the oldest PyTorch in pyproject.toml's range (torch>=2.10)
declare -A PYTHONS=([newest]="${PYTHON_NEWEST:-python3.12}" [oldest]="${PYTHON_OLDEST:-python3.10}")
declare -A TORCHES=([newest]="torch" [oldest]="torch==$TORCH_FLOOR")
declare -A OUTCOMES=()
passed=()

for edge in newest oldest; do
    env=".matrix/$edge"
    python="${PYTHONS[$edge]}"
    if [[ ! -x "$env/bin/python" ]]; then
        "$python" -m venv "$env" || { OUTCOMES[$edge]="no $python"; continue; }
    fi
    # torch first, alone: resolved with the project, a newer torch would win the range.
    "$env/bin/python" -m pip install --quiet --upgrade "${TORCHES[$edge]}" \
        && "$env/bin/python" -m pip install --quiet -e ".[dev]" "${TORCHES[$edge]}" \
        || { OUTCOMES[$edge]="install failed"; continue; }
    versions="$("$env/bin/python" -c '
import platform, torch, IPython
print(f"Python {platform.python_version()}, torch {torch.__version__}, IPython {IPython.__version__}")')"
    echo "== $edge: $versions"
    "$env/bin/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$env.log"
    [[ "${PIPESTATUS[0]}" == 0 ]] && passed+=("$edge")
    summary="$(tail -n 1 "$env.log")"
    OUTCOMES[$edge]="$versions: $summary"
done

echo
echo "Version matrix, $(date +%Y-%m-%d):"
for edge in newest oldest; do
    echo "- $edge: ${OUTCOMES[$edge]}"
done
[[ "${#passed[@]}" == 2 ]]  # the exit status: 0 only where both edges passed
