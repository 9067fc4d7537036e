#!/usr/bin/env bash
# Updates the Prefect UI screenshots in docs/img/ that the README shows (flow-run.png,
# progress-artifact.png): runs tests/test_ui.py (a real Prefect server, a real cluster, headless
# Chromium) with its screenshots written there. The only thing that writes docs/img/ screenshots: in the
# test suite they go to a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-browser.sh
exec .venv/bin/python -m pytest tests/test_ui.py -q --screenshots docs/img "$@"
