#!/usr/bin/env bash
# Sets everything up, then runs the linters, the type checker and the whole test suite (real Dask
# processes, a real Prefect server on SQLite and on PostgreSQL, headless Chromium, a real SLURM cluster, a
# real S3 server; the suite about 11 minutes on 2 cores, and the set-up 3 more on a fresh machine). The heavy
# tests (marker `heavy`) and the docker-compose test (marker `compose`: it builds an image) run from .ci/run
# after this; `bash scripts/test.sh -m heavy` or `-m compose` runs them alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# mypy takes most of a minute on a clean checkout (no cache yet): it runs while apt fetches the services.
.venv/bin/mypy >.venv/mypy.log 2>&1 &
mypy=$!
# The services the tests start themselves, from Debian's packages, in one apt run: SLURM (a controller and
# two nodes on 127.0.0.1: what scripts/install-slurm.sh installs), PostgreSQL (a Prefect server on it),
# headless Chromium (the Prefect UI test; scripts/install-browser.sh), iptables and ip (the network
# partitions).
bash scripts/apt-install.sh slurmctld slurmd slurm-client munge postgresql-15 chromium iptables iproute2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
wait "$mypy" || { cat .venv/mypy.log; exit 1; }
cat .venv/mypy.log
exec .venv/bin/python -m pytest "$@"
