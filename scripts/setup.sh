#!/usr/bin/env bash
# Creates .venv and installs prefect-elastic with its dev tools. Safe to run again: it only installs what
# is missing. torch is installed first and pinned, so that the local CPU wheel is taken instead of the newest
# CUDA build (several GB) that the package's torch requirement would otherwise pull. Everything else is
# installed with constraints.txt: the combination of versions this project is tested with (the package
# itself only asks for ranges; see pyproject.toml).
#
# torch comes from pip, which honours the machine's pip configuration (a local CPU wheel in its find-links,
# say). The rest is installed by uv (itself installed with pip) where it can be had: it resolves, fetches and
# unpacks in parallel, 45 s here where pip takes 80. It writes bytecode as pip does (otherwise, with
# PYTHONDONTWRITEBYTECODE set, every worker process would compile the sources of what it imports again).
# Where uv cannot be installed, pip installs the rest too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -m uv --version >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "uv==0.13.9" || echo "setup: uv could not be installed; using pip"
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
if .venv/bin/python -m uv --version >/dev/null 2>&1; then
  .venv/bin/python -m uv pip install --quiet --python .venv/bin/python --compile-bytecode -c constraints.txt \
    -e ".[dev]"
else
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
fi
