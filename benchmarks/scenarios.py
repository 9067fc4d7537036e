"""The groups of scenarios of the benchmark suite (`benchmarks.run`): each runs its scenarios, a failure
recorded instead of ending the suite (`attempt`), and puts their figures into the results."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import async_mode, baseline, calls, elastic, frozen, memory, standby, tls
from .plain import plain_process
from .sizes import Sizes
from .workloads import BATCH, WORKLOADS

SCALED = ("cnn", "mlp")  # the workloads measured with 1, 2 and 4 compute workers
FROZEN_WORKLOAD = "cnn-20"  # a light step: the bound on the frozen worker's stall is tightest there
NO_SNAPSHOTS = 1e6  # a liveness interval longer than any run


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
    # The first job on a fresh cluster runs slower in every phase (workers still settling, caches cold; by
    # how much: docs/benchmarks.md, "How each figure is measured"): one short job first, not counted.
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
            # runs of the ratio over plain come next to each other either way: this machine's speed moves
            # within minutes (docs/benchmarks.md, "What the figures say": this machine drifts).
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
            results, f"elastic frozen worker ({policy})", frozen.frozen, pool, FROZEN_WORKLOAD, data, policy,
            sizes.frozen_epochs, sizes.freeze_s, 1.0, sizes.frozen_settle,
        )  # fmt: skip


def standby_figures(results: dict[str, Any], data: str, big: str, sizes: Sizes) -> None:
    """A data server's static worker lost: promotion of a standby, against failing and running again;
    what the replicas cost in steady state and in memory."""
    results["memory"] = attempt(results, "data server memory", memory.memory, "mlp", big, data, 1)
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
