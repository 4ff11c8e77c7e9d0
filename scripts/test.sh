#!/usr/bin/env bash
# Install everything (CPU torch, the package with all extras) into .venv and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/pip install -q "torch==2.13.0"  # the CPU build; the GPU image brings its own
.venv/bin/pip install -q -e ".[worker,test,examples]"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
