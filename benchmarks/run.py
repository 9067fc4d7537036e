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
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dask
import torch

from . import async_mode, baseline, calls, elastic, report, standby, tls
from .plain import plain_process
from .workloads import BATCH, THREADS, WORKLOADS, write_dataset

ROOT = Path(__file__).resolve().parent.parent
SCALED = ("cnn", "mlp")  # the workloads measured with 1, 2 and 4 compute workers
FROZEN_WORKLOAD = "cnn-20"  # a light step: the bound on the frozen worker's stall is tightest there


NO_SNAPSHOTS = 1e6  # a liveness interval longer than any run

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


@dataclass(frozen=True)
class Sizes:
    samples: int = 16384  # 128 steps of 128 per epoch
    memory_samples: int = 60000  # a data server must hold 94 MB of it
    # Epochs of a steady-state run, by workload: about 20 s each on 2 cores, so a run holds 20 snapshots.
    # (The machine's speed drifts: on 2026-11-23 the plain cnn took 150 to 230 ms a step, not 90.)
    steady_epochs: tuple[tuple[str, int], ...] = (("cnn", 1), ("cnn-20", 5), ("transformer", 5), ("mlp", 10))
    # The workloads of the bench extra, measured only when named (`--workloads`), on data of their own shape
    # of `extra_samples` samples: the resnet18, 128 steps of 32 an epoch (about 15 s of the plain loop's
    # steps on 2 idle cores, at its 114 ms a step).
    extra_steady_epochs: tuple[tuple[str, int], ...] = (("resnet18", 2),)
    extra_samples: int = 4096
    repeats: int = 3  # runs of each steady-state figure, interleaved; medians are reported
    # The same for the workloads of a step of about 15 to 20 ms: their ratio over plain lies within this
    # machine's noise of its 0.90 target (3 repeats gave cnn-20 0.88 in one run, 0.98 in another).
    light_repeats: int = 7
    light: tuple[str, ...] = ("cnn-20", "transformer")
    # 2 compute workers against torchrun DDP with 2 processes: epochs of 64 steps of 2 x 128 samples (the
    # resnet18, named with `--workloads`: 64 steps of 2 x 32 of `extra_samples` CIFAR-shaped samples).
    ddp_epochs: tuple[tuple[str, int], ...] = (("cnn-20", 8), ("cnn", 2))
    extra_ddp_epochs: tuple[tuple[str, int], ...] = (("resnet18", 1),)
    ddp_repeats: int = 3
    kills: int = 5
    recovery_epochs: int = 8
    # Recovery and scale-up side by side with the code before issue 9 (`--baseline`): alternating pairs of
    # runs, each on a cluster of its own, `kills` SIGKILLs each; 4 epochs hold the 5 kills with room to spare.
    baseline_pairs: int = 3
    baseline_epochs: int = 4
    # Frozen worker: SIGSTOP after `frozen_settle` steps together, SIGCONT `freeze_s` s later.
    frozen_epochs: int = 12
    freeze_s: float = 8.0
    frozen_settle: int = 20
    frozen_policies: tuple[str, ...] = ("reassign", "rollback")
    # A data server's static worker SIGKILLed, a standby promoted (issue 10): kills in one run of the cnn.
    standby_kills: int = 5
    standby_epochs: int = 7  # 5 epochs ended before the 5th kill (4 measured)
    standby_settle: int = 30  # steps on a placement, and a snapshot of half-way, before the next kill
    standby_ready_s: float = standby.STANDBY_READY_S  # a standby listed this long before a kill onto it
    restart_epochs: int = 1
    coordinator_kills: int = 5
    restore_repeats: int = 5  # a 200 MB shard from the peer's memory, and from a checkpoint file
    restore_model: str = "benchmarks.workloads:wide_mlp"  # (the 200 MB shard)
    replica_epochs: int = 5  # cnn-20: about 15 s a run
    replica_repeats: int = 5  # the pairs spread by ±5%: more pairs than 3 steady the median, not enough
    scaling_workers: tuple[int, ...] = (1, 2, 4)
    scaling_epochs: int = 3
    timeline_epochs: int = 6
    kill_at: float = 4.0
    join_at: float = 8.0
    torchrun_duration: float = 40.0  # s after its first step, as kill_at and join_at
    call_repeats: int = 200
    # Async mode (issue 11): 4 compute workers, one 3x slower, sync against async to a target loss; and 1
    # worker in async mode over the plain loop (mlp, communication-bound).
    # (the transformer: a 15 to 20 ms step, and its loss falls within the run; cnn-20's hardly moves in 4
    # epochs of the synthetic data)
    straggler_workload: str = "transformer"
    straggler_workers: int = 4
    straggler_epochs: int = 4
    straggler_repeats: int = 1
    async_steady_epochs: int = 10
    async_steady_repeats: int = 3
    # Final accuracy, async against sync, on held-out digits (same data and epochs, 4 compute workers):
    # 20 epochs, where sync has converged (at 10, async was still 1 to 2 points behind, 2026-11-27).
    accuracy_workers: int = 4
    accuracy_epochs: int = 20
    accuracy_repeats: int = 3
    # TLS on every connection against none (steady, 1 worker), alternating pairs.
    tls_epochs: dict[str, int] = field(default_factory=lambda: {"cnn-20": 3, "mlp": 6})
    tls_repeats: int = 3


SMOKE = Sizes(
    samples=2048,
    memory_samples=4096,  # must differ from samples: the memory figure compares the two
    steady_epochs=(("cnn", 1), ("cnn-20", 1), ("transformer", 1), ("mlp", 1)),
    extra_steady_epochs=(("resnet18", 1),),
    extra_samples=1024,  # 32 steps of the resnet18
    repeats=1,
    light_repeats=1,
    ddp_epochs=(("cnn-20", 2),),  # 16 steps: a throughput needs more than 5 after the first
    ddp_repeats=1,
    kills=1,
    recovery_epochs=4,
    baseline_pairs=0,  # (a smoke run checks this code, not an older one)
    frozen_epochs=20,  # long enough for a freeze of 3 s to start and end inside the run
    freeze_s=3.0,
    frozen_settle=5,
    frozen_policies=("reassign",),
    scaling_workers=(1, 2),
    scaling_epochs=2,
    timeline_epochs=3,
    kill_at=0.3,
    standby_kills=1,
    standby_epochs=8,  # 64 steps: the kill comes after about 10, and its recovery takes about as many
    standby_settle=6,
    standby_ready_s=1.0,
    restart_epochs=5,  # 40 steps: the kill (at step 6) comes well before the end
    coordinator_kills=1,
    restore_repeats=1,
    restore_model="benchmarks.workloads:wide_mlp_smoke",
    replica_epochs=2,
    replica_repeats=1,
    join_at=0.6,
    torchrun_duration=14.0,
    call_repeats=5,
    straggler_epochs=1,
    straggler_workers=2,
    async_steady_epochs=1,
    async_steady_repeats=1,
    accuracy_workers=2,
    accuracy_epochs=1,
    accuracy_repeats=1,
    tls_epochs={"cnn-20": 1, "mlp": 1},
    tls_repeats=1,
)


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


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def attempt(results: dict[str, Any], name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one scenario; a failure is recorded in the results (and shown) instead of ending the suite."""
    say(f"{name} ...")
    started = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:
        traceback.print_exc()
        results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        say(f"{name} FAILED: {exc}")
        return None
    say(f"{name} done in {time.monotonic() - started:.1f} s")
    return value


def steady_figures(
    results: dict[str, Any],
    pool: elastic.ClusterPool,
    data: str,
    sizes: Sizes,
    workloads: list[str] | None = None,
) -> None:
    """Plain loop vs one compute worker (snapshots every 1 s), and the same without snapshots; the plain
    loop also with the workers' allocator settings. On `workloads` if given (of `sizes.steady_epochs` and
    `sizes.extra_steady_epochs`), else on those of `sizes.steady_epochs`."""
    default = dict(sizes.steady_epochs)
    extra = dict(sizes.extra_steady_epochs)
    # The first job on a fresh cluster ran up to 20% slower in every phase (workers still settling, caches
    # cold): one short job first, not counted.
    attempt(results, "warm-up", elastic.steady, pool, "cnn-20", data, 1, NO_SNAPSHOTS)
    for w in workloads or default:  # (not cnn-gpu: too slow on CPUs; benchmarks/gpu.py measures it)
        if w in default:
            epochs, shaped = default[w], data
            steps = epochs * (sizes.samples // WORKLOADS[w].batch)
        else:  # (its own shape: written beside the MNIST-shaped data)
            epochs, shaped = extra[w], WORKLOADS[w].dataset(Path(data).parent, sizes.extra_samples)
            steps = epochs * (sizes.extra_samples // WORKLOADS[w].batch)
        plain: list[float] = []
        tuned: list[float] = []
        with_snap: list[float] = []
        without: list[float] = []
        runs: list[dict[str, Any]] = []
        for i in range(sizes.light_repeats if w in sizes.light else sizes.repeats):
            # Odd repeats run in the opposite order, so a drift of the machine over time (or the first run
            # after another kind of run being slower) weighs on both sides of each ratio alike. The two
            # runs of the ratio over plain come next to each other either way: this machine's speed moved
            # by up to a fifth within minutes (the plain transformer's step 13.8 to 18.5 ms in one A/B).
            order = ["tuned", "plain", "snapshots", "none"]
            got: dict[str, Any] = {}
            for kind in order if i % 2 == 0 else order[::-1]:
                if kind in ("plain", "tuned"):
                    got[kind] = attempt(
                        results, f"plain {w} {kind} #{i}", plain_process, w, shaped, steps, kind == "tuned"
                    )
                else:
                    # A liveness interval longer than the run: survival detection runs only on worker
                    # events, so there are no periodic snapshots.
                    interval = 1.0 if kind == "snapshots" else NO_SNAPSHOTS
                    got[kind] = attempt(
                        results, f"elastic {w} {kind} #{i}", elastic.steady, pool, w, shaped, epochs, interval
                    )
            p, t, a, b = got["plain"], got["tuned"], got["snapshots"], got["none"]
            if p and t and a and b:
                plain.append(p["samples_per_s"])
                tuned.append(t["samples_per_s"])
                with_snap.append(a["samples_per_s"])
                without.append(b["samples_per_s"])
                runs += [p, t, a, b]
        if not plain:
            continue
        # Each repeat's runs are next to each other in time: the ratio is the median of the repeats'
        # ratios, which a drift of the machine between repeats does not move.
        pair_ratios = [a / p for a, p in zip(with_snap, plain, strict=True)]
        results["steady"][w] = {
            "plain": statistics.median(plain),
            "elastic": statistics.median(with_snap),
            "ratio": statistics.median(pair_ratios),
            "pair_ratios": pair_ratios,
            "plain_tuned": statistics.median(tuned),
            "ratio_tuned": statistics.median(a / t for a, t in zip(with_snap, tuned, strict=True)),
            "runs": runs,
        }
        snap_runs = [x for x in runs if x.get("liveness_interval") == 1.0]
        bare_runs = [x for x in runs if x.get("liveness_interval") == NO_SNAPSHOTS]
        results["snapshot"][w] = {
            "with": statistics.median(with_snap),
            "without": statistics.median(without),
            # Each repeat's pair of runs, for the spread of the comparison between runs.
            "overhead": 1 - statistics.median(a / b for a, b in zip(with_snap, without, strict=True)),
            "pair_overheads": [1 - a / b for a, b in zip(with_snap, without, strict=True)],
            "snapshots": max(r.get("snapshots", 0) for r in runs),
            # The figure measured inside each run (see elastic.snapshot_excess), and the same measure on
            # the runs without snapshots, where it should read zero.
            "in_run": statistics.median(x["in_run"]["overhead"] for x in snap_runs),
            "placebo": statistics.median(x["placebo"]["overhead"] for x in bare_runs),
            "window_s": statistics.median(x["in_run"]["window_s"] for x in snap_runs),
        }
        # The fixed cost of a step, from the runs with snapshots (the default configuration): the median
        # over the repeats of each figure, and every phase per step.
        plain_runs = [x for x in runs if x.get("allocator") == "default"]
        costs = [x for x in snap_runs if x.get("fixed_ms") is not None]
        if costs:
            names = list(dict.fromkeys(k for x in costs for k in x["phase_ms"]))  # the loop's order
            results["fixed_cost"][w] = {
                "fixed_ms": statistics.median(x["fixed_ms"] for x in costs),
                "step_ms": statistics.median(x["step_ms"] for x in costs),
                "compute_ms": statistics.median(x["compute_ms"] for x in costs),
                "phase_ms": {k: statistics.median(x["phase_ms"].get(k, 0.0) for x in costs) for k in names},
                "repeats": [x["fixed_ms"] for x in costs],
                # Each shard's side of the step path, per step (median over the repeats).
                "shard_ms": [
                    {
                        k: statistics.median(x["shard_ms"][i].get(k, 0.0) for x in costs)
                        for k in costs[0]["shard_ms"][i]
                    }
                    for i in range(min(len(x.get("shard_ms", [])) for x in costs))
                ],
                # How each shard received its frames with tensors in the last repeat (`wire/inbox.py`).
                "shard_bodies": costs[-1].get("shard_bodies", []),
                # The plain loop's step in the same repeats: what the framework adds over it, compute
                # included (the workers' compute may differ from the plain loop's: allocator, threads).
                "plain_step_ms": statistics.median(x["step_ms"] for x in plain_runs),
            }


def ddp_figures(
    results: dict[str, Any],
    pool: elastic.ClusterPool,
    data: str,
    workdir: Path,
    sizes: Sizes,
    workloads: list[str] | None = None,
) -> None:
    """2 compute workers (2 micro-batches of the workload's batch a step: one each) against torchrun DDP
    with 2 processes (a batch each a step), the same global batch and number of steps, alternating,
    `ddp_repeats` times; the ratio is the median of the repeats' ratios. The idle Dask cluster stays up
    during torchrun's runs. On `workloads` if given (of `sizes.ddp_epochs` and `sizes.extra_ddp_epochs`),
    else on those of `sizes.ddp_epochs`."""
    from . import torchrun_bench

    default, extra = dict(sizes.ddp_epochs), dict(sizes.extra_ddp_epochs)
    for w in workloads or default:
        if w in default:
            epochs, shaped = default[w], data
            steps = epochs * (sizes.samples // (2 * BATCH))
        else:  # (its own shape: written beside the MNIST-shaped data)
            epochs, shaped = extra[w], WORKLOADS[w].dataset(Path(data).parent, sizes.extra_samples)
            steps = epochs * (sizes.extra_samples // (2 * WORKLOADS[w].batch))
        ours: list[float] = []
        theirs: list[float] = []
        runs: list[dict[str, Any]] = []
        for i in range(sizes.ddp_repeats):
            got: dict[str, Any] = {}
            order = ["elastic", "ddp"] if i % 2 == 0 else ["ddp", "elastic"]
            for kind in order:
                if kind == "elastic":
                    got[kind] = attempt(
                        results, f"elastic {w} x2 #{i}", elastic.steady, pool, w, shaped, epochs, 1.0,
                        workers=2,
                    )  # fmt: skip
                else:
                    got[kind] = attempt(
                        results, f"torchrun ddp {w} #{i}", torchrun_bench.steady, w, shaped,
                        workdir / "torchrun-ddp", steps=steps, limit=120.0 + 2.0 * steps,
                    )  # fmt: skip
            a, b = got["elastic"], got["ddp"]
            if a and b and b["samples_per_s"] and b["finished"]:
                ours.append(a["samples_per_s"])
                theirs.append(b["samples_per_s"])
                runs += [a, {k: v for k, v in b.items() if k != "steps"}]
            elif b and not b["finished"]:
                results.setdefault("errors", {})[f"torchrun ddp {w} #{i}"] = (
                    f"did not finish: {b['steps_done']} of {steps} steps, agent exit {b['agent_exit']}"
                )
        if ours:
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            results["ddp"][w] = {
                "elastic": statistics.median(ours),
                "ddp": statistics.median(theirs),
                "ratio": statistics.median(ratios),
                "pair_ratios": ratios,
                "steps": steps,
                "runs": runs,
            }


def run_elastic(
    results: dict[str, Any],
    pool: elastic.ClusterPool,
    data: str,
    big: str,
    workdir: Path,
    sizes: Sizes,
    torchrun: bool = True,
) -> None:
    steady_figures(results, pool, data, sizes)
    if torchrun:
        ddp_figures(results, pool, data, workdir, sizes)
    recovery_figures(results, pool, data, sizes)
    elastic_figures(results, pool, data, sizes)
    frozen_figures(results, pool, data, sizes)


def elastic_figures(results: dict[str, Any], pool: elastic.ClusterPool, data: str, sizes: Sizes) -> None:
    """What an actor call costs, throughput over 1 and more compute workers, and the timeline of a kill and
    a join."""
    results["calls"] = attempt(results, "actor calls", calls.calls, pool, sizes.call_repeats)
    for w in SCALED:
        runs = [
            attempt(results, f"elastic {w} x{n}", elastic.scaling, pool, w, data, n, sizes.scaling_epochs)
            for n in sizes.scaling_workers
        ]
        results["scaling"][w] = [x for x in runs if x]
    results["timeline"] = attempt(
        results, "elastic timeline", elastic.timeline, pool, "cnn", data, sizes.timeline_epochs,
        sizes.kill_at, sizes.join_at,
    )  # fmt: skip


def recovery_figures(results: dict[str, Any], pool: elastic.ClusterPool, data: str, sizes: Sizes) -> None:
    """Recovery after a SIGKILL of one of two compute workers and the scale-up when it rejoins, with
    each policy."""
    for policy in ("reassign", "rollback"):
        results["recovery"][policy] = attempt(
            results, f"elastic recovery ({policy})", elastic.recovery, pool, "cnn", data, policy, sizes.kills,
            sizes.recovery_epochs,
        )  # fmt: skip


def baseline_figures(results: dict[str, Any], data: str, workdir: Path, sizes: Sizes, commit: str) -> None:
    """Recovery and scale-up of this code against `commit`'s, side by side (`benchmarks/baseline.py`)."""
    if not sizes.baseline_pairs or commit == "none":
        # (A comparison stored from an earlier run would judge this run's figures: dropped.)
        results.pop("recovery_baseline", None)
        return
    results["recovery_baseline"] = attempt(
        results, f"recovery side by side with {commit}", baseline.side_by_side, commit, workdir, data,
        sizes.baseline_pairs, sizes.kills, sizes.baseline_epochs,
    )  # fmt: skip


def frozen_figures(results: dict[str, Any], pool: elastic.ClusterPool, data: str, sizes: Sizes) -> None:
    """One of two compute workers SIGSTOPped, then woken, with each policy."""
    # Last on the shared cluster: a worker that was frozen and woken may leave it unsettled.
    for policy in sizes.frozen_policies:
        results["frozen"][policy] = attempt(
            results, f"elastic frozen worker ({policy})", elastic.frozen, pool, FROZEN_WORKLOAD, data, policy,
            sizes.frozen_epochs, sizes.freeze_s, 1.0, sizes.frozen_settle,
        )  # fmt: skip


def standby_figures(results: dict[str, Any], data: str, big: str, sizes: Sizes) -> None:
    """A data server's static worker lost: promotion of a standby, against failing and running again;
    what the replicas cost in steady state and in memory."""
    results["memory"] = attempt(results, "data server memory", elastic.memory, "mlp", big, data, 1)
    results["standby"] = {
        "promotion": attempt(
            results, "standby promotion", standby.standby_recovery, "cnn", data, sizes.standby_kills,
            sizes.standby_epochs, settle=sizes.standby_settle, ready_s=sizes.standby_ready_s,
        ),
        "restart": attempt(
            results, "restart from the checkpoint", standby.restart_from_checkpoint, "cnn", data,
            sizes.restart_epochs, kill_at=sizes.standby_settle,
        ),
        "coordinator": attempt(
            results, "coordinator lost", standby.standby_recovery, "cnn", data, sizes.coordinator_kills,
            sizes.standby_epochs, settle=sizes.standby_settle, role="coordinator",
            ready_s=sizes.standby_ready_s,
        ),
        "restore": attempt(
            results, "shard restore", standby.shard_restore, data, sizes.restore_repeats, sizes.restore_model
        ),
        "replica_cost": attempt(
            results, "replica cost", standby.replica_cost, "cnn-20", data, sizes.replica_epochs,
            sizes.replica_repeats,
        ),
    }  # fmt: skip


def async_figures(results: dict[str, Any], data: str, sizes: Sizes) -> None:
    """Async mode against sync mode with a straggler, and its steady throughput over the plain loop."""
    results["async"] = {
        "straggler": attempt(
            results, "async straggler", async_mode.straggler, sizes.straggler_workload, data,
            sizes.straggler_workers, 3.0,
            sizes.straggler_epochs, sizes.straggler_repeats,
        ),
        "steady": attempt(
            results, "async steady", async_mode.steady, "mlp", data, sizes.async_steady_epochs,
            sizes.async_steady_repeats,
        ),
        "accuracy": attempt(
            results, "async accuracy", async_mode.accuracy, str(Path(data).parent), sizes.accuracy_workers,
            sizes.accuracy_epochs, sizes.accuracy_repeats,
        ),
    }  # fmt: skip


def tls_figures(results: dict[str, Any], data: str, sizes: Sizes) -> None:
    """What TLS on every connection costs in steady state, on a light model and a communication-bound one."""
    results["tls"] = attempt(results, "tls", tls.tls_costs, sizes.tls_epochs, data, sizes.tls_repeats) or {}


def torchrun_figures(results: dict[str, Any], data: str, workdir: Path, sizes: Sizes) -> None:
    from . import torchrun_bench

    rec = attempt(
        results, "torchrun recovery", torchrun_bench.recovery, "cnn", data, workdir / "torchrun-recovery",
        kills=sizes.kills,
    )  # fmt: skip
    tl = attempt(
        results, "torchrun timeline", torchrun_bench.timeline, "cnn", data, workdir / "torchrun-timeline",
        kill_at=sizes.kill_at, join_at=sizes.join_at, duration=sizes.torchrun_duration,
    )  # fmt: skip
    results["torchrun"] = {"recovery": rec, "timeline": tl}


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
