#!/usr/bin/env bash
# Installs what the compose stack and its test need on a Debian bookworm host: the Docker engine, Debian's
# docker-compose (1.29.2; compose v2 is not reachable here) and debootstrap (no image registry is reachable,
# so scripts/build-image.sh makes the base image from a Debian rootfs). Only missing packages are installed,
# so running it again costs nothing.
set -euo pipefail
exec bash "$(dirname "$0")/apt-install.sh" docker.io docker-compose debootstrap
