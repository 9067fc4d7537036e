#!/usr/bin/env bash
# Installs the Debian packages named as arguments, only those missing (running it again costs nothing):
# the services the tests start themselves (SLURM, PostgreSQL, the Docker engine) come from here.
set -euo pipefail

missing=()
for p in "$@"; do
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
echo "installing ${missing[*]} (apt-get)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
