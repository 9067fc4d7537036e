#!/usr/bin/env bash
# Installs what the SLURM tests and examples need on a Debian bookworm host: SLURM's controller, node
# daemon and client commands (Debian's slurm-wlm 22.05) and munge, which SLURM authenticates with (its
# package makes /etc/munge/munge.key). Nothing is started here: the test harness
# (prefect_elastic/local/slurm.py) starts munged, slurmctld and one slurmd per node itself. dask-jobqueue is
# a Python package: it comes with the project's test extra, not from here.
set -euo pipefail
exec bash "$(dirname "$0")/apt-install.sh" slurmctld slurmd slurm-client munge
