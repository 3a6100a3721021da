# Sourced by demo.sh and test.sh: choose the Python environment and make sure it has PyTorch.
#
# - Inside an active virtual or conda environment, use it. Otherwise create (once) and use the
#   project's own `.venv`, so that no system or user Python is changed.
# - Keep a PyTorch that is already there if torchmem supports it; install torch 2.13.0 only
#   where there is none. A torch older than torchmem supports stops the script: it is the
#   user's, and replacing it is their call.
# Sets PY to that environment's python and says what it did; install_dev installs torchmem
# with its development tools there.

TORCH_FLOOR="2.10"      # as in pyproject.toml's `torch>=2.10`
TORCH_DEFAULT="2.13.0"  # what a fresh environment gets
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
    echo "torchmem setup: using the active virtual environment $VIRTUAL_ENV"
elif [[ -n "${CONDA_PREFIX:-}" && "${CONDA_DEFAULT_ENV:-}" != base ]]; then
    PY="$CONDA_PREFIX/bin/python"
    echo "torchmem setup: using the active conda environment $CONDA_PREFIX"
else
    if [[ ! -x .venv/bin/python ]]; then
        echo "torchmem setup: creating the virtual environment .venv with ${PYTHON:-python3}"
        "${PYTHON:-python3}" -m venv .venv || {
            echo "torchmem setup: could not create .venv (on Debian or Ubuntu: apt install python3-venv)" >&2
            exit 1
        }
    fi
    PY="$PWD/.venv/bin/python"
    echo "torchmem setup: using .venv (activate it with: source .venv/bin/activate)"
fi

torch_version="$("$PY" - <<'EOF'
import importlib.metadata
try:
    print(importlib.metadata.version("torch"))
except importlib.metadata.PackageNotFoundError:
    pass
EOF
)"
if [[ -z "$torch_version" ]]; then
    echo "torchmem setup: no PyTorch here; installing torch==$TORCH_DEFAULT"
    "$PY" -m pip install --quiet "torch==$TORCH_DEFAULT"
elif "$PY" -c "import re, sys; v, floor = (re.match(r'(\d+)\.(\d+)', a).groups() for a in sys.argv[1:]); sys.exit((int(v[0]), int(v[1])) < (int(floor[0]), int(floor[1])))" "$torch_version" "$TORCH_FLOOR"; then
    echo "torchmem setup: keeping the installed torch $torch_version"
else
    echo "torchmem setup: this environment has torch $torch_version; torchmem needs torch>=$TORCH_FLOOR." >&2
    echo "Upgrade it, or deactivate the environment to let the script use .venv." >&2
    exit 1
fi

# torchmem with its development tools. uv installs their hundred-odd packages in seconds,
# where pip takes over a minute; PyTorch is already here (above), and uv keeps it.
install_dev() {
    "$PY" -m pip install --quiet uv
    "$PY" -m uv pip install --quiet --python "$PY" -e ".[dev]"
}
