#!/usr/bin/env bash
# Sets everything up, then runs the benchmark suite (plain PyTorch, prefect-elastic and torchrun on the same
# workloads, in one invocation) and writes docs/benchmarks.md, its plots and docs/benchmarks/results.json.
# Run it on an otherwise idle machine: the figures are timings. `--smoke` checks the code in a minute or two.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.run "$@"
