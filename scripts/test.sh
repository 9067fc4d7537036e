#!/usr/bin/env bash
# Sets everything up, then runs the linters, the type checker and the whole test suite (real Dask
# processes, a real Prefect server on SQLite and on PostgreSQL, headless Chromium, a real SLURM cluster, a
# real S3 server; the suite about 10 minutes on 2 cores, and the set-up 1.5 more on a fresh machine). The heavy
# tests (marker `heavy`) and the docker-compose test (marker `compose`: it builds an image) run from .ci/run
# after this; `bash scripts/test.sh -m heavy` or `-m compose` runs them alone.
set -euo pipefail
cd "$(dirname "$0")/.."
# The services the tests start themselves, from Debian's packages, in one apt run beside the Python set-up
# (apt waits on the network and dpkg, the set-up on the package index and the CPU): SLURM (a controller
# and two nodes on 127.0.0.1: what scripts/install-slurm.sh installs), PostgreSQL (a Prefect server on it),
# headless Chromium (the Prefect UI test; scripts/install-browser.sh), iptables and ip (the network
# partitions).
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
bash scripts/apt-install.sh slurmctld slurmd slurm-client munge postgresql-15 chromium iptables iproute2 \
  >"$logs/apt.log" 2>&1 &
apt=$!
bash scripts/setup.sh
wait "$apt" || { cat "$logs/apt.log"; exit 1; }
cat "$logs/apt.log"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy takes most of a minute of CPU on a clean checkout (no cache yet). It runs beside the tests at the
# lowest priority, in the CPU they leave idle (a fifth of it on 2 cores), and its verdict counts as much as
# theirs: a type error fails this command once the tests have run.
nice -n 19 .venv/bin/mypy >"$logs/mypy.log" 2>&1 &
mypy=$!
status=0
.venv/bin/python -m pytest "$@" || status=$?
if ! wait "$mypy"; then
  cat "$logs/mypy.log"
  echo "mypy found type errors (above)" >&2
  exit 1
fi
cat "$logs/mypy.log"
exit "$status"
