#!/usr/bin/env bash
# Installs Debian's headless Chromium for the Prefect UI test (tests/test_ui.py), where it is missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-browser: chromium is missing; install Debian's 'chromium' package (the UI test needs it)" >&2
  exit 1
fi
echo "install-browser: installing Debian's chromium ..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
chromium --version
