#!/usr/bin/env bash
# Installs what the SLURM tests and examples need on a Debian bookworm host: SLURM's controller, node
# daemon and client commands (Debian's slurm-wlm 22.05) and munge, which SLURM authenticates with (its
# package makes /etc/munge/munge.key). Nothing is started here: the test harness
# (prefect_elastic/local/slurm.py) starts munged, slurmctld and one slurmd per node itself. Only missing
# packages are installed, so running it again costs nothing. dask-jobqueue is a Python package: it comes
# with the project's test extra, not from here.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${packages[@]}"; do
  # dpkg-query prints "install ok installed" only for a fully installed package.
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
