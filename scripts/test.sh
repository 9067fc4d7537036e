#!/usr/bin/env bash
# Sets everything up, then runs the linters, the type checker and the whole test suite (real Dask
# processes, a real Prefect server on SQLite and on PostgreSQL, headless Chromium, a real SLURM cluster, a
# real S3 server; the suite about 11 minutes on 2 cores, and the set-up 3 more on a fresh machine). The heavy
# tests (marker `heavy`) and the docker-compose test (marker `compose`: it builds an image) run from .ci/run
# after this; `bash scripts/test.sh -m heavy` or `-m compose` runs them alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-browser.sh  # headless Chromium for the Prefect UI test
# The services the tests start themselves: SLURM (a controller and two nodes on 127.0.0.1) and PostgreSQL
# (a Prefect server on it), from Debian's packages.
bash scripts/install-slurm.sh
bash scripts/apt-install.sh postgresql-15 iptables iproute2  # iptables and ip: the network-partition tests
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
