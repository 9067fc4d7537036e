"""docs/benchmarks.md and its plots, from the raw results of `benchmarks.run`."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from .workloads import WORKLOADS

Results = dict[str, Any]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


# Steady throughput over the plain loop, 1 worker: the targets of issue 9.
# The transformer has a step like cnn-20's (5 to 30 ms), from modules this repository did not write: the
# same target, since a target must hold for the models users bring.
STEADY_TARGETS = {"cnn-20": 0.90, "transformer": 0.90, "cnn": 0.95, "mlp": 0.60, "resnet18": 0.90}
FIXED_COST_TARGET_MS = 3.0
DDP_AIM = 0.9  # 2 workers over torchrun DDP with 2 processes: reported, with this aim
# ... and the ResNet-18's target (issue 37: the overlapped step), where the step moves 45 MB each way.
DDP_TARGETS = {"resnet18": 1.0}
# The last run before the step path of issue 9 (docs/benchmarks.md of 2026-11-21, 2 cores): recovery and
# scale-up must be no worse than these. Judged against them only when the run has no side-by-side
# comparison with that code (`recovery_baseline`, benchmarks/baseline.py): the machine's speed drifts by half.
BEFORE = {"recovery_s": 0.297, "scale_up_s": 0.286}


def no_worse_than_before(r: Results, key: str, median: float) -> tuple[str, bool]:
    """What `median` (of `key`: recovery_s or scale_up_s) is compared with to be "no worse than before
    issue 9", and whether it is: the same kills run side by side with that code in this run if there were
    (the ratio of the medians at most 1), else the stored figure."""
    side = (r.get("recovery_baseline") or {}).get(key) or {}
    if side.get("ratio") is None:
        return f"no worse than before issue 9 ({BEFORE[key]} s, stored)", median <= BEFORE[key]
    pairs = side.get("pair_ratios") or []
    spread = f", pairs {min(pairs):.2f} to {max(pairs):.2f}" if len(pairs) > 1 else ""
    return (
        f"no worse than before issue 9, side by side ({r['recovery_baseline']['baseline']}: "
        f"{side['baseline']:.3f} s against {side['this']:.3f} s, {side['n'][0]} and {side['n'][1]} kills; "
        f"ratio {side['ratio']:.2f}{spread})",
        side["ratio"] <= 1.0,
    )


def _spread(values: list[float], digits: int = 2) -> str:
    return f"; repeats {min(values):.{digits}f} to {max(values):.{digits}f}" if len(values) > 1 else ""


STANDBY_TARGET_S = 2.0
RESTART_SPEEDUP = 10.0
REPLICA_COST = 0.01
MEMORY_PER_BYTE = 3.0  # issue 10: a data server's growth per byte it must hold, replica included
RESTORE_SPEEDUP = 5.0  # issue 10: a 200 MB shard from the peer's memory against from a checkpoint file


def standby_rows(r: Results) -> list[tuple[str, str, str, str]]:
    """A data server's static worker SIGKILLed: a standby promoted, against failing and running again."""
    sb = r.get("standby") or {}
    promo, restart = sb.get("promotion"), sb.get("restart")
    if not promo or not promo.get("recovery_s"):
        return []
    rec = promo["recovery_s"]
    parts = promo["parts_median_s"]
    redone = [k["steps_redone"] for k in promo["per_kill"] if k.get("steps_redone") is not None]
    named = {
        "detection": "detect_s",
        "suspend": "suspend_s",
        "start on the standby (partition read)": "start_s",
        "shard from the peer's replica": "adopt_s",
        "every shard to the snapshot": "promote_s",
        "first step": "first_step_s",
    }
    measured = (
        f"{rec['median']:.3f} s, max {rec['max']:.3f} s; parts (median): "
        + ", ".join(f"{name} {parts[key]:.3f}" for name, key in named.items())
        + f"; steps redone per kill {_spread_list(redone)}; a step {promo['step_s']:.3f} s"
    )
    rows = [
        (
            f"SIGKILL of a data server's static worker to the next committed step, a standby promoted "
            f"({promo['workload']}, 2 compute workers, median of {rec['n']})",
            measured,
            f"≤ {STANDBY_TARGET_S:g} s",
            _verdict(rec["median"] <= STANDBY_TARGET_S),
        )
    ]
    if restart:
        same = restart["recovery_s"] / rec["median"]
        in_process = (
            f"the failure {restart['fail_s']:.3f} s after the kill, then a new run's start to its first step "
            f"{restart['rerun_to_first_step_s']:.3f} s, in the same process, its imports warm"
        )
        if "recovery_new_process_s" in restart:
            # What a user does: the job's process ended with the error, and a new one runs it again.
            speedup = restart["recovery_new_process_s"] / rec["median"]
            measured = (
                f"{restart['recovery_new_process_s']:.3f} s run again in a new process, as a user's script "
                f"or `prefect-elastic train` is (the failure, then the process's start to its first step "
                f"{restart['new_process_to_first_step_s']:.3f} s): the standby is {speedup:.1f}x faster; "
                f"{restart['recovery_s']:.3f} s run again in the same process ({in_process}), the floor of "
                f"any run again: {same:.1f}x"
            )
        else:
            speedup = same
            measured = f"{restart['recovery_s']:.3f} s ({in_process}); the standby is {speedup:.1f}x faster"
        rows.append(
            (
                "the same, against failing and running the job again from its persistent checkpoint",
                measured,
                f"≥ {RESTART_SPEEDUP:g}x faster",
                _verdict(speedup >= RESTART_SPEEDUP),
            )
        )
    coordinator = sb.get("coordinator")
    if coordinator and coordinator.get("recovery_s"):
        crec, cparts = coordinator["recovery_s"], coordinator["parts_median_s"]
        cnamed = {
            "detection": "detect_s",
            "coordinator rebuilt": "rebuild_s",
            "data server 0 promoted (start, shard from the replica, every shard to the snapshot)": None,
            "first step": "first_step_s",
        }
        promoted = sum(cparts.get(k, 0.0) for k in ("suspend_s", "start_s", "adopt_s", "promote_s"))
        rows.append(
            (
                f"SIGKILL of the coordinator's static worker (which holds data server 0 too) to the next "
                f"committed step ({coordinator['workload']}, 2 compute workers, median of {crec['n']})",
                f"{crec['median']:.3f} s, max {crec['max']:.3f} s; parts (median): "
                + ", ".join(
                    f"{name} {cparts[key] if key else promoted:.3f}"
                    for name, key in cnamed.items()
                    if key is None or key in cparts
                ),
                f"≤ {STANDBY_TARGET_S:g} s",
                _verdict(crec["median"] <= STANDBY_TARGET_S),
            )
        )
    restore = sb.get("restore")
    if restore:
        rows.append(
            (
                f"restore of a {restore['shard_mb']:.0f} MB shard on a standby: from the peer's memory "
                f"against from a checkpoint file on the local disk "
                f"({restore['checkpoint_file_mb']:.0f} MB; both include the data server's start)",
                f"{restore['peer_s']['median']:.3f} s (max {restore['peer_s']['max']:.3f}) against "
                f"{restore['file_cold_s']['median']:.3f} s with the page cache emptied "
                f"({restore['file_warm_s']['median']:.3f} s warm): {restore['speedup_cold']:.1f}x "
                f"({restore['speedup_warm']:.1f}x warm), median of {restore['peer_s']['n']}, each on a "
                f"static worker just started, as a real promotion is; runs {_values(restore['peer_s'])} s",
                f"≥ {RESTORE_SPEEDUP:g}x faster",
                _verdict(restore["speedup_cold"] >= RESTORE_SPEEDUP),
            )
        )
    cost = sb.get("replica_cost")
    if cost and "in_run_with" in cost:
        # Measured inside each run, as the snapshots' own cost is: the verdict is on this one, since the
        # pairs of runs below spread by more than the 1% they are held to.
        rows.append(
            (
                f"cost of peer replicas in steady state ({cost['workload']}, 1 worker, snapshots every "
                "second), inside each run: what snapshots and their copies to the peer cost together",
                f"{100 * cost['in_run_with']:.2f}% (median of {len(cost['ratios'])} runs; snapshots alone, "
                f"in the runs without replicas: {100 * cost['in_run_without']:.2f}%)",
                f"≤ {100 * REPLICA_COST:g}%",
                _verdict(cost["in_run_with"] <= REPLICA_COST),
            )
        )
    if cost:
        # Between runs: the verdict where no in-run figure was stored (runs before it existed).
        label = "cost of peer replicas in steady state ({}, 1 worker, snapshots every second)".format(
            cost["workload"]
        )
        target, verdict = f"≤ {100 * REPLICA_COST:g}%", _verdict(cost["cost"] <= REPLICA_COST)
        if "in_run_with" in cost:
            label = "the same, between runs"
            target, verdict = "reported: run-to-run noise is larger than 1% here", "reported"
        rows.append(
            (
                f"{label}: 1 - throughput with / without",
                f"{100 * cost['cost']:.1f}% (median of {len(cost['ratios'])} pairs; ratios "
                + ", ".join(f"{x:.3f}" for x in cost["ratios"])
                + ")",
                target,
                verdict,
            )
        )
    return rows


def tls_rows(r: Results) -> list[tuple[str, str, str, str]]:
    """What TLS on every connection costs (issue 13: reported)."""
    rows: list[tuple[str, str, str, str]] = []
    for workload, cost in (r.get("tls") or {}).items():
        if not cost:
            continue
        pairs = cost["pairs"]
        rows.append(
            (
                f"cost of TLS on every connection (Dask's and the step path's), steady state ({workload}, 1 "
                "worker): 1 - throughput with / without",
                f"{100 * cost['cost']:.1f}% (median of {len(cost['ratios'])} pairs; samples/s with "
                + ", ".join(f"{p['tls']:.0f}" for p in pairs)
                + ", without "
                + ", ".join(f"{p['plain']:.0f}" for p in pairs)
                + ")",
                "reported",
                "reported",
            )
        )
    return rows


ASYNC_STRAGGLER_RATIO = 0.6  # issue 11: time to a target loss, async over sync, one worker of 4 3x slower
ASYNC_STEADY_MLP = 0.85  # issue 11: async mode's steady throughput over plain PyTorch, mlp, 1 worker
ASYNC_ACCURACY_POINTS = 1.0  # issue 11: final accuracy, async against sync, within this many points


def async_rows(r: Results) -> list[tuple[str, str, str, str]]:
    """Async mode against sync mode, with and without a straggler; async over the plain loop."""
    a = r.get("async") or {}
    rows: list[tuple[str, str, str, str]] = []
    st = a.get("straggler")
    if st:
        times = st["time_to_target_s"]

        def case(name: str) -> str:
            sync_t, async_t = times.get(f"sync-{name}"), times.get(f"async-{name}")
            runs = st["runs"].get(f"async-{name}") or [{}]
            share = statistics.median(x.get("candidate_steps", 0) / max(1, x.get("batches", 1)) for x in runs)
            refused = statistics.median(x.get("stale_refusals", 0) for x in runs)

            def final(mode: str) -> str:
                losses = [x["final_loss"] for x in st["runs"].get(f"{mode}-{name}", [])]
                return _fmt(statistics.median(losses) if losses else None, 3)

            def whole(mode: str) -> str:
                spans = [x["train_s"] for x in st["runs"].get(f"{mode}-{name}", [])]
                return _fmt(statistics.median(spans) if spans else None, 1)

            return (
                f"{_fmt(st.get(f'ratio_{name}'))} (async {_fmt(async_t, 2)} s, sync {_fmt(sync_t, 2)} s to a "
                f"mean loss of {st['target_loss']:.3f} over the last 2048 samples, where the sync run "
                f"without a straggler stands half-way; the whole run: async {whole('async')} s, sync "
                f"{whole('sync')} s; "
                f"loss at the end: async {final('async')}, sync {final('sync')}; candidate steps "
                f"{100 * share:.0f}%, gradients refused as stale {refused:.0f})"
            )

        ratio = st.get("ratio_straggler")
        rows.append(
            (
                f"time to a target loss, async over sync, {st['workers']} compute workers, one "
                f"{st['factor']:.0f}x slower ({st['workload']})",
                case("straggler"),
                f"≤ {ASYNC_STRAGGLER_RATIO}",
                _verdict(None if ratio is None else ratio <= ASYNC_STRAGGLER_RATIO),
            )
        )
        rows.append(
            (
                f"the same without a straggler ({st['workload']})",
                case("even"),
                "reported (async should not be slower)",
                "reported",
            )
        )
        runs = [x for key in ("async-straggler", "async-even") for x in st["runs"].get(key, [])]
        merged: dict[str, int] = {}
        for x in runs:
            for k, n in x.get("staleness", {}).items():
                merged[str(k)] = merged.get(str(k), 0) + n
        total = sum(merged.values()) or 1
        shown = ", ".join(
            f"{k}: {100 * n / total:.0f}%" for k, n in sorted(merged.items(), key=lambda i: int(i[0]))
        )
        rows.append(
            (
                "staleness of the applied gradients, async runs above (versions a shard moved on)",
                shown or "n/a",
                "reported",
                "reported",
            )
        )
    sd = a.get("steady")
    if sd:
        ratios = [p["ratio"] for p in sd["pairs"]]
        rows.append(
            (
                "steady throughput, 1 worker, async mode over plain PyTorch (mlp, communication-bound)",
                f"{sd['ratio']:.2f} (median of the pairs; candidate steps {100 * sd['candidate_share']:.0f}%)"
                + _spread(ratios),
                f"≥ {ASYNC_STEADY_MLP}",
                _verdict(sd["ratio"] >= ASYNC_STEADY_MLP),
            )
        )
    acc = a.get("accuracy")
    if acc:
        each = "; ".join(
            f"{mode} " + ", ".join(f"{100 * v:.1f}%" for v in acc["runs"][mode]) for mode in acc["runs"]
        )
        rows.append(
            (
                f"final accuracy on {acc['held_out']} held-out digits, async against sync, same data and "
                f"epochs ({acc['workers']} compute workers, {acc['epochs']} epochs, the demo's digits CNN; "
                f"async's learning rate divided by the {acc['workers']} micro-batches a sync step averages)",
                f"{acc['points']:+.1f} points (async {100 * acc['async']:.1f}%, sync "
                f"{100 * acc['sync']:.1f}%, medians; runs: {each})",
                f"reported; within {ASYNC_ACCURACY_POINTS:.0f} point",
                _verdict(abs(acc["points"]) <= ASYNC_ACCURACY_POINTS),
            )
        )
    return rows


def _spread_list(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)} to {max(values)}"


def figures(r: Results) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, verdict) rows of the summary table."""
    rows: list[tuple[str, str, str, str]] = []
    steady = r["steady"]
    for w in [w for w in STEADY_TARGETS if w in steady] + [w for w in steady if w not in STEADY_TARGETS]:
        s = steady[w]
        ratio = s["ratio"]
        target = STEADY_TARGETS.get(w)
        rows.append(
            (
                f"steady throughput, 1 worker, over plain PyTorch ({w}, {r['workloads'].get(w, '')})",
                f"{ratio:.2f} (median of the repeats' ratios; median samples/s {s['elastic']:.0f} and "
                f"{s['plain']:.0f})"
                + (
                    f"; over plain with the workers' allocator settings {s['ratio_tuned']:.2f}"
                    if "ratio_tuned" in s
                    else ""
                )
                + _spread(s.get("pair_ratios", [])),
                "reported" if target is None else f"≥ {target:.2f}",
                "reported" if target is None else _verdict(ratio >= target),
            )
        )
    for w, c in r.get("fixed_cost", {}).items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in c["phase_ms"].items())
        shards = "; ".join(
            f"shard {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases_i.items())
            for i, phases_i in enumerate(c.get("shard_ms", []))
        )
        rows.append(
            (
                f"fixed cost of a step, 1 worker ({w}): step time minus its compute, ms",
                f"{c['fixed_ms']:.2f} (step {c['step_ms']:.2f} - compute {c['compute_ms']:.2f})"
                + _spread(c.get("repeats", []))
                + f"; phases per step: {phases}"
                + (f"; on the shards per step ({shards})" if shards else "")
                + f"; the plain loop's step {c['plain_step_ms']:.2f}",
                f"≤ {FIXED_COST_TARGET_MS:.0f} ms",
                _verdict(c["fixed_ms"] <= FIXED_COST_TARGET_MS),
            )
        )
    for w, d in r.get("ddp", {}).items():
        rows.append(
            (
                f"steady throughput, 2 compute workers over torchrun DDP with 2 processes, gloo ({w})",
                f"{d['ratio']:.2f} (median of the repeats' ratios; median samples/s {d['elastic']:.0f} and "
                f"{d['ddp']:.0f}; {d['steps']} steps of 2 x {WORKLOADS[w].batch})"
                + _spread(d.get("pair_ratios", [])),
                f"≥ {DDP_TARGETS[w]:.1f}" if w in DDP_TARGETS else f"reported; aim ≥ {DDP_AIM:.1f}",
                _verdict(d["ratio"] >= DDP_TARGETS.get(w, DDP_AIM)),
            )
        )
    rec = r["recovery"].get("reassign")
    tr = r.get("torchrun", {}).get("recovery")
    tr_times = [k["recovery_s"] for k in (tr or {}).get("kills", []) if k.get("recovered")]
    tr_median = statistics.median(tr_times) if tr_times else None
    if rec and rec["recovery_s"]:
        median = rec["recovery_s"]["median"]
        speedup = tr_median / median if tr_median else None
        before, no_worse = no_worse_than_before(r, "recovery_s", median)
        rows.append(
            (
                f"recovery, SIGKILL of 1 of 2 workers to next commit (median of {rec['recovery_s']['n']})",
                f"{median:.3f} s; torchrun {_fmt(tr_median, 3)} s; {_fmt(speedup, 1)}x faster",
                f"≤ 1 s, ≥ 5x faster than torchrun, {before}",
                _verdict(median <= 1.0 and no_worse and (speedup is not None and speedup >= 5)),
            )
        )
    rows += standby_rows(r)
    rows += async_rows(r)
    rows += tls_rows(r)
    if rec and rec["scale_up_s"]:
        bound = rec["liveness_interval"] + 0.5
        worst = rec["scale_up_s"]["max"]
        before, no_worse = no_worse_than_before(r, "scale_up_s", rec["scale_up_s"]["median"])
        rows.append(
            (
                f"scale-up, registration to first committed batch (median, max of {rec['scale_up_s']['n']})",
                f"{rec['scale_up_s']['median']:.3f} s, max {worst:.3f} s",
                f"max ≤ liveness interval + 0.5 s = {bound:.1f} s; median {before}",
                _verdict(worst <= bound and no_worse),
            )
        )
    for policy, f in r.get("frozen", {}).items():
        if not f or not f.get("frozen") or f.get("longest_gap_s") is None:
            continue
        left = (
            f"out of the membership {f['left_after_s']:.2f} s after the SIGSTOP ({f['left_kind']})"
            if f.get("left_after_s") is not None
            else "never out of the membership"
        )
        woken = (
            f"rejoined {f['rejoined_after_cont_s']:.2f} s after the SIGCONT"
            if f.get("rejoined_after_cont_s") is not None
            else "did not rejoin"
        )
        rows.append(
            (
                f"frozen worker, SIGSTOP of 1 of 2 for {f['freeze_s']:.0f} s ({f['workload']}, {policy}): "
                "longest time without a committed step",
                f"{f['longest_gap_s']:.2f} s; {left}; a step alone {1000 * f['step_alone_s']:.0f} ms; "
                f"steps undone {sum(f['steps_lost'])}; {woken}, longest gap from then "
                f"{_fmt(f.get('gap_after_cont_s'))} s",
                f"≤ 2 liveness intervals + one step = {f['bound_s']:.2f} s",
                _verdict(f["longest_gap_s"] <= f["bound_s"]),
            )
        )
    snaps = {w: v for w, v in r["snapshot"].items() if "in_run" in v}
    if snaps:
        rows.append(
            (
                "snapshot overhead at a 1 s liveness interval, measured inside each run ("
                + " / ".join(snaps)
                + ")",
                " / ".join(f"{100 * v['in_run']:.2f}%" for v in snaps.values())
                + "; the same measure without snapshots: "
                + " / ".join(f"{100 * v['placebo']:.2f}%" for v in snaps.values()),
                "≤ 2%",
                _verdict(max(v["in_run"] for v in snaps.values()) <= 0.02),
            )
        )
        rows.append(
            (
                "the same, from runs with and without snapshots (" + " / ".join(snaps) + ")",
                " / ".join(f"{100 * v['overhead']:+.1f}%" for v in snaps.values())
                + "; pairs spread "
                + " / ".join(
                    f"{100 * min(v['pair_overheads']):+.1f} to {100 * max(v['pair_overheads']):+.1f}%"
                    for v in snaps.values()
                ),
                "reported: run-to-run noise is larger than 2% here",
                "reported",
            )
        )
    for policy in ("rollback", "reassign"):
        p = r["recovery"].get(policy)
        if p:
            rows.append(
                (
                    f"work lost per failure, {policy}",
                    f"{p['lost_steps_per_failure']:.2f} steps, {p['lost_seconds_per_failure']:.3f} s",
                    "reported",
                    "reported",
                )
            )
    c = r.get("calls")
    if c:
        sizes = " / ".join(f"{label} ({c['bytes'][label] / 1e3:.0f} KB)" for label in c["ms"])
        first = next(iter(c["ms"].values()))
        if "channel" in first:
            rows.append(
                (
                    "the step path's exchange (wire/channel.py: a frame to both shards, one back from "
                    f"each), median ms: {sizes}",
                    " / ".join(f"{v['channel']:.2f}" for v in c["ms"].values())
                    + (
                        "; over TCP (as from another machine) "
                        + " / ".join(f"{v['channel_tcp']:.2f}" for v in c["ms"].values())
                        if "channel_tcp" in first
                        else ""
                    ),
                    "reported: the floor under the fixed cost of a step",
                    "reported",
                )
            )
        what = {"send_one": "to one shard", "send_all": "to both at once", "receive_all": "from both at once"}
        rows.append(
            (
                "a Dask actor call from the compute worker (the step path's transport before "
                f"wire/channel.py), median ms: {sizes}",
                "; ".join(
                    f"{text} " + " / ".join(f"{v[key]:.2f}" for v in c["ms"].values())
                    for key, text in what.items()
                ),
                "reported",
                "reported",
            )
        )
    mem = r.get("memory")
    if mem:
        for s in mem["servers"]:
            rows.append(
                (
                    f"data server {s['server']} peak memory over what it must hold ({mem['workload']}"
                    + (", with its peer's replica)" if s.get("replica_bytes") else ")"),
                    f"{s['ratio']:.2f} ({s['growth'] / 2**20:.0f} MiB / {s['must_hold'] / 2**20:.0f} MiB); "
                    f"per extra byte held: {s['marginal_ratio']:.2f}",
                    f"per extra byte held ≤ {MEMORY_PER_BYTE:g}; explain > 2 overall",
                    _verdict(s["marginal_ratio"] <= MEMORY_PER_BYTE),
                )
            )
    for w, runs in r.get("scaling", {}).items():
        text = ", ".join(f"{x['workers']}: {x['samples_per_s']:.0f}" for x in runs)
        rows.append((f"throughput by compute workers ({w}), samples/s", text, "reported", "reported"))
    return rows


def markdown(r: Results, plots: dict[str, str]) -> str:
    m = r["machine"]
    lines = [
        f"Made by `{r['command']}` (`bash scripts/bench.sh` sets up and runs it); raw results, with when "
        f"each group was measured, in [`{r['raw_rel']}`]({r['raw_rel']})."
        + "".join(
            f" The {p['only']} rows were measured alone (`python -m benchmarks.run --only {p['only']}`)."
            # The latest run of each group measured alone.
            for p in {p["only"]: p for p in r.get("partial_runs", [])}.values()
        ),
        "",
        f"Machine: {m['cpus']} cores ({m['cpu_model']}), {m['memory_gib']:.0f} GiB, {m['device']}; "
        f"Python {m['python']}, torch {m['torch']}, dask {m['dask']}. Every training process runs "
        f"{r['threads']} torch thread; prefect-elastic runs 2 static workers (2 data servers, the "
        "coordinator) and its compute workers as separate processes on the same cores (the standby rows: "
        "3 static workers, one of them a standby).",
        "",
        "| figure | measured | target | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in figures(r)]
    lines += [""]
    for name, path in plots.items():
        lines += [f"![{name}]({path})", ""]
    return "\n".join(lines)


def _rate(steps: list[dict[str, Any]], window: float = 1.0) -> tuple[list[float], list[float]]:
    """Samples per second over a sliding window, at each step's time."""
    ts = [s["t"] for s in steps]
    out_t: list[float] = []
    out_r: list[float] = []
    lo = 0
    total = 0
    for i, s in enumerate(steps):
        if i and ts[i] - ts[i - 1] > window:
            # No step for longer than the window: draw the stall as zero, not as a line across it.
            out_t += [ts[i - 1] + window, ts[i]]
            out_r += [0.0, 0.0]
        total += s["samples"]
        while ts[i] - ts[lo] > window:
            total -= steps[lo]["samples"]
            lo += 1
        span = ts[i] - ts[lo]
        if span > 0.2:
            out_t.append(ts[i])
            out_r.append((total - steps[lo]["samples"]) / span)
    return out_t, out_r


def plot_timeline(r: Results, path: Path) -> None:
    runs = [("prefect-elastic", r.get("timeline"), "tab:blue")]
    tr = r.get("torchrun", {}).get("timeline")
    if tr:
        runs.append(("torchrun", tr, "tab:orange"))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, run, color in runs:
        if not run or not run.get("steps"):
            continue
        # Both runs on one clock: seconds since their first step (torchrun's log starts at its launch).
        origin = min(x["t"] for x in run["steps"])
        steps = sorted(({**x, "t": x["t"] - origin} for x in run["steps"]), key=lambda x: x["t"])
        run = {**run, "steps": steps, "events": [{**e, "t": e["t"] - origin} for e in run.get("events", [])]}
        t, rate = _rate(run["steps"])
        top.plot(t, rate, color=color, label=label)
        bottom.plot([s["t"] for s in run["steps"]], [s["loss"] for s in run["steps"]], color=color, lw=0.8)
        for e in run.get("events", []):
            kind = e.get("kind", e.get("event"))  # torchrun_bench names it "event"
            if kind in ("kill", "join"):
                style = "--" if kind == "kill" else ":"
                for ax in (top, bottom):
                    ax.axvline(e["t"], color=color, ls=style, lw=1)
                top.annotate(f"{label} {kind}", (e["t"], 0), rotation=90, fontsize=7, color=color,
                             xytext=(2, 5), textcoords="offset points")  # fmt: skip
    top.set_ylabel("samples/s (1 s window)")
    top.legend(loc="upper right")
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("seconds since the first step")
    top.set_title(f"Through a SIGKILL (dashed) and a join (dotted), {r['timeline_workload']} workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ratios(r: Results, path: Path) -> None:
    labels: list[str] = []
    values: list[float] = []
    targets: list[float | None] = []
    for w, s in r["steady"].items():
        labels.append(f"throughput\n/ plain\n({w})")
        values.append(s["ratio"])
        targets.append(STEADY_TARGETS.get(w))
    for w, d in r.get("ddp", {}).items():
        labels.append(f"2 workers\n/ DDP x2\n({w})")
        values.append(d["ratio"])
        targets.append(DDP_TARGETS.get(w, DDP_AIM))
    for w, v in r["snapshot"].items():
        if "in_run" in v:
            labels.append(f"kept with\nsnapshots\n({w})")
            values.append(1 - v["in_run"])
            targets.append(0.98)
    for w, runs in r.get("scaling", {}).items():
        if not runs:
            continue
        base = runs[0]["samples_per_s"]
        for x in runs[1:]:
            labels.append(f"{x['workers']} workers\n/ 1\n({w})")
            values.append(x["samples_per_s"] / base)
            targets.append(None)
    fig, ax = plt.subplots(figsize=(12, 3.8))
    bars = ax.bar(range(len(values)), values, color="tab:blue")
    for i, (bar, target) in enumerate(zip(bars, targets, strict=True)):
        ax.annotate(f"{values[i]:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    xytext=(0, 2), textcoords="offset points", fontsize=8)  # fmt: skip
        if target is not None:
            ax.hlines(target, bar.get_x(), bar.get_x() + bar.get_width(), color="tab:red", lw=2)
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("ratio (red: target)")
    ax.set_title("Throughput ratios")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fixed_cost(r: Results, path: Path) -> None:
    """Per workload, a step's time by phase (ms, stacked), its compute left out, beside the fixed cost."""
    costs = r["fixed_cost"]
    names = list(dict.fromkeys(k for c in costs.values() for k in c["phase_ms"] if k != "compute"))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.8 * len(costs)))
    colors = plt.get_cmap("Set2")  # no red: red is the target
    for row, c in enumerate(costs.values()):
        left = 0.0
        for i, name in enumerate(names):
            width = c["phase_ms"].get(name, 0.0)
            ax.barh(row, width, left=left, color=colors(i), label=name if row == 0 else None)
            left += width
        ax.plot([c["fixed_ms"]], [row], marker="D", color="black", label="fixed cost" if row == 0 else None)
    ax.axvline(FIXED_COST_TARGET_MS, color="tab:red", lw=2, label="target")
    ax.set_yticks(range(len(costs)), [f"{w}\n(compute {c['compute_ms']:.0f} ms)" for w, c in costs.items()])
    ax.set_xlabel("ms per step, besides the compute phase")
    ax.set_title("The phases of a step other than compute, and the fixed cost (step time minus compute)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


START = "<!-- results:start (written by python -m benchmarks.run; edit outside these marks) -->"
END = "<!-- results:end -->"


def write(r: Results, docs: Path, img: Path) -> None:
    """Write the plots and put the results between the marks of `docs`, keeping the text around them."""
    img.mkdir(parents=True, exist_ok=True)
    plots = {}
    if r.get("timeline"):
        plot_timeline(r, img / "bench-timeline.png")
        plots["throughput and loss through a kill and a join"] = f"{img.name}/bench-timeline.png"
    plot_ratios(r, img / "bench-ratios.png")
    plots["throughput ratios"] = f"{img.name}/bench-ratios.png"
    if r.get("fixed_cost"):
        plot_fixed_cost(r, img / "bench-fixed-cost.png")
        plots["where a step's time goes, 1 worker"] = f"{img.name}/bench-fixed-cost.png"
    if not docs.exists():
        docs.write_text(f"# Benchmarks\n\n{START}\n{END}\n")
    replace_between(docs, START, END, markdown(r, plots))


def replace_between(docs: Path, start: str, end: str, block: str) -> None:
    """Put `block` between the marks `start` and `end` of `docs`, keeping the text around them."""
    text = docs.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{docs} lacks the marks {start!r} and {end!r}; put them where the figures go")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    docs.write_text(f"{head}{start}\n{block}\n{end}{tail}")


def _values(summary: dict[str, Any]) -> str:
    return ", ".join(f"{v:.2f}" for v in summary["values"])
