#!/usr/bin/env bash
# Sets everything up, then trains a CNN on the digits on a local cluster while a worker is killed and
# another joins, and checks the result against a run without failures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m prefect_elastic.local.demo "$@"
