#!/usr/bin/env bash
# Sets everything up, then runs the linters, the type checker and the whole test suite (real Dask
# processes, a real Prefect server, headless Chromium; about 6 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-browser.sh  # headless Chromium for the Prefect UI test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
