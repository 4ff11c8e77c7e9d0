#!/usr/bin/env bash
# Install (first run only) and run the demo: a private redis-server, a tiny local model,
# the worker draining a few jobs, results printed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/sluiceway ]; then
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[worker]"
fi
exec .venv/bin/sluiceway demo "$@"
