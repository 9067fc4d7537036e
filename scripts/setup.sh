#!/usr/bin/env bash
# Creates .venv and installs prefect-elastic with its dev tools. Safe to run again: it only installs what
# is missing. torch is installed first and pinned, so that pip takes the local CPU wheel instead of pulling
# the newest CUDA build (several GB) to satisfy the package's torch requirement. Everything else is installed
# with constraints.txt: the combination of versions this project is tested with (the package itself only
# asks for ranges; see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
