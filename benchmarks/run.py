"""Run the benchmark suite: `python -m benchmarks.run [--smoke]`.

`python -m benchmarks.run --only steady --workloads resnet18` measures transformers' ResNet-18 (the bench
extra: `pip install -e ".[bench]"`) against the plain loop, and `--only ddp --workloads resnet18` two
compute workers on it against torchrun DDP; the suite leaves it out unless it is named.

Every figure of docs/benchmarks.md, measured in this one invocation on this machine: the plain PyTorch
loop, prefect-elastic, torchrun DDP and torchrun elastic on the same workloads (benchmarks/workloads.py).
Writes the raw results as JSON (`--raw`) and the table and plots into `--docs`. `--smoke` runs every
scenario at tiny sizes (the test suite does, to keep this code working); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dask
import torch

from . import baseline, elastic, report, standby
from .scenarios import (
    async_figures,
    attempt,
    baseline_figures,
    ddp_figures,
    elastic_figures,
    frozen_figures,
    recovery_figures,
    run_elastic,
    say,
    standby_figures,
    steady_figures,
    tls_figures,
    torchrun_figures,
)
from .sizes import SMOKE, Sizes
from .workloads import BATCH, THREADS, WORKLOADS, write_dataset

ROOT = Path(__file__).resolve().parent.parent

# The groups of scenarios `--only` runs alone (together they are the whole suite; the smoke test of CI runs
# one a run, in turn).
GROUPS = {
    "steady": "one compute worker against the plain loop, snapshots and the fixed cost of a step",
    "ddp": "two compute workers against torchrun DDP",
    "recovery": "SIGKILLs under both policies, a frozen worker, and the same kills with --baseline's code",
    "elastic": "actor calls, scaling over 1 and 2 workers, the timeline of a kill and a join",
    "standby": "a data server's or the coordinator's static worker lost, the replicas' cost and memory",
    "replicas": "what the peer replicas cost in steady state (one row of the standby group)",
    "async": "async against sync with a straggler, its steady throughput, its final accuracy",
    "tls": "what TLS on every connection costs",
    "torchrun": "torchrun elastic's recovery and timeline, the baseline of the recovery rows",
}


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown CPU"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": pages / 2**30,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dask": dask.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code, not the speed")
    parser.add_argument("--data-dir", default="/tmp/prefect-elastic-bench", help="datasets and scratch")
    parser.add_argument("--raw", default=str(ROOT / "docs" / "benchmarks" / "results.json"))
    parser.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--no-torchrun", action="store_true", help="leave out the torchrun baseline")
    parser.add_argument("--report-only", action="store_true", help="rewrite --docs from --raw; run nothing")
    parser.add_argument(
        "--only",
        choices=list(GROUPS),
        help="run this group of scenarios alone, and merge its results into --raw (the rest stay as stored)",
    )
    parser.add_argument(
        "--workloads",
        help="with --only steady or --only ddp: these workloads (comma-separated) instead of the default "
        f"ones; of {', '.join(dict(Sizes().steady_epochs) | dict(Sizes().extra_steady_epochs))} "
        f"(steady) and {', '.join(dict(Sizes().ddp_epochs) | dict(Sizes().extra_ddp_epochs))} (ddp)",
    )
    parser.add_argument(
        "--baseline",
        default=baseline.BEFORE_ISSUE_9,
        metavar="COMMIT",
        help="the commit whose recovery and scale-up this code's are compared with, side by side in the run "
        f"(default {baseline.BEFORE_ISSUE_9}, the last before issue 9; 'none' to leave the comparison out)",
    )
    args = parser.parse_args(argv)
    if args.workloads is not None:
        sizes = Sizes()
        known = {
            "steady": dict(sizes.steady_epochs) | dict(sizes.extra_steady_epochs),
            "ddp": dict(sizes.ddp_epochs) | dict(sizes.extra_ddp_epochs),
        }
        of = known.get(args.only or "", {})
        unknown = [w for w in args.workloads.split(",") if w not in of]
        if not of or unknown:
            parser.error(
                "--workloads goes with --only steady (of "
                f"{', '.join(known['steady'])}) or --only ddp (of {', '.join(known['ddp'])}); "
                f"unknown here: {unknown or args.workloads}"
            )
    if args.report_only:
        stored: dict[str, Any] = json.loads(Path(args.raw).read_text())
        report.write(stored, Path(args.docs), Path(args.docs).parent / "img")
        return 0
    if args.only:
        return run_only(args)
    sizes = SMOKE if args.smoke else Sizes()
    workdir = Path(args.data_dir)
    raw, docs = Path(args.raw), Path(args.docs)
    data = write_dataset(workdir / f"synthetic-{sizes.samples}.npz", sizes.samples)
    big = write_dataset(workdir / f"synthetic-{sizes.memory_samples}.npz", sizes.memory_samples)
    command = "python -m benchmarks.run" + (" --smoke" if args.smoke else "")
    results: dict[str, Any] = {
        "command": command,
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "smoke": args.smoke,
        "machine": machine(),
        "threads": THREADS,
        "batch": BATCH,
        "workloads": {w.name: w.kind for w in WORKLOADS.values()},
        "sizes": sizes.__dict__,
        "steady": {},
        "snapshot": {},
        "fixed_cost": {},
        "ddp": {},
        "recovery": {},
        "frozen": {},
        "scaling": {},
        "timeline_workload": "cnn",
    }
    say(f"benchmarks on {results['machine']['cpus']} cores; dataset {data}")
    pool = elastic.ClusterPool()
    try:
        run_elastic(results, pool, data, big, workdir, sizes, torchrun=not args.no_torchrun)
    finally:
        pool.close()
    baseline_figures(results, data, workdir, sizes, args.baseline)
    standby_figures(results, data, big, sizes)
    async_figures(results, data, sizes)
    tls_figures(results, data, sizes)
    if not args.no_torchrun:
        torchrun_figures(results, data, workdir, sizes)
    raw.parent.mkdir(parents=True, exist_ok=True)
    results["raw_rel"] = os.path.relpath(raw, docs.parent)
    raw.write_text(json.dumps(results, indent=1, default=str))
    report.write(results, docs, docs.parent / "img")
    say(f"wrote {raw} and {docs}")
    for row in report.figures(results):
        print(" | ".join(row))
    if results.get("errors"):
        say(f"{len(results['errors'])} scenario(s) failed: {', '.join(results['errors'])}")
        return 1
    return 0


def run_only(args: argparse.Namespace) -> int:
    """One group of scenarios, merged into the stored raw results; the table is written again from them."""
    sizes = SMOKE if args.smoke else Sizes()
    raw, docs = Path(args.raw), Path(args.docs)
    results: dict[str, Any] = json.loads(raw.read_text())
    data = write_dataset(Path(args.data_dir) / f"synthetic-{sizes.samples}.npz", sizes.samples)
    big = write_dataset(Path(args.data_dir) / f"synthetic-{sizes.memory_samples}.npz", sizes.memory_samples)
    results.pop("errors", None)
    if args.only == "steady":
        # (The one-worker steady state against the plain loop, with the fixed cost of a step: the rows a
        # change to the step path moves.)
        workloads = args.workloads.split(",") if args.workloads else None
        results["workloads"] = {w.name: w.kind for w in WORKLOADS.values()}
        pool = elastic.ClusterPool()
        try:
            steady_figures(results, pool, data, sizes, workloads)
        finally:
            pool.close()
    elif args.only in ("ddp", "recovery"):
        # (Two compute workers: against torchrun DDP; or a SIGKILL, a rejoin and a frozen worker, and the
        # same kills side by side with the code of `--baseline`. The torchrun baseline of the recovery row
        # stays as stored.)
        pool = elastic.ClusterPool()
        try:
            if args.only == "ddp":
                workloads = args.workloads.split(",") if args.workloads else None
                ddp_figures(results, pool, data, Path(args.data_dir), sizes, workloads)
            else:
                recovery_figures(results, pool, data, sizes)
                frozen_figures(results, pool, data, sizes)
        finally:
            pool.close()
        if args.only == "recovery":
            baseline_figures(results, data, Path(args.data_dir), sizes, args.baseline)
    elif args.only == "elastic":
        pool = elastic.ClusterPool()
        try:
            elastic_figures(results, pool, data, sizes)
        finally:
            pool.close()
    elif args.only == "torchrun":
        torchrun_figures(results, data, Path(args.data_dir), sizes)
    elif args.only == "async":
        async_figures(results, data, sizes)
    elif args.only == "tls":
        tls_figures(results, data, sizes)
    elif args.only == "replicas":
        # (What the peer replicas cost in steady state, alone: one row of the standby group.)
        results.setdefault("standby", {})["replica_cost"] = attempt(
            results, "replica cost", standby.replica_cost, "cnn-20", data, sizes.replica_epochs,
            sizes.replica_repeats,
        )  # fmt: skip
    else:
        standby_figures(results, data, big, sizes)
    results.setdefault("partial_runs", []).append(
        {
            "only": args.only,
            "at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            **({"workloads": args.workloads} if args.workloads else {}),
        }
    )
    raw.write_text(json.dumps(results, indent=1, default=str))
    report.write(results, docs, docs.parent / "img")
    for row in report.figures(results):
        print(" | ".join(row))
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
