"""docs/benchmarks.md and its plots, from the raw results of `benchmarks.run`: the summary table's rows for
the shared cluster's scenarios here, the other groups' in `report_rows.py`, the targets in `targets.py`, the
plots in `report_plots.py`."""

from __future__ import annotations

import statistics
from pathlib import Path

from .report_plots import plot_fixed_cost, plot_ratios, plot_timeline
from .report_rows import async_rows, standby_rows, tls_rows
from .targets import (
    BEFORE,
    DDP_AIM,
    DDP_TARGETS,
    FIXED_COST_TARGET_MS,
    MEMORY_PER_BYTE,
    STEADY_TARGETS,
    Results,
    fmt,
    repeats_spread,
    verdict_of,
)
from .workloads import WORKLOADS


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
                + repeats_spread(s.get("pair_ratios", [])),
                "reported" if target is None else f"≥ {target:.2f}",
                "reported" if target is None else verdict_of(ratio >= target),
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
                + repeats_spread(c.get("repeats", []))
                + f"; phases per step: {phases}"
                + (f"; on the shards per step ({shards})" if shards else "")
                + f"; the plain loop's step {c['plain_step_ms']:.2f}",
                f"≤ {FIXED_COST_TARGET_MS:.0f} ms",
                verdict_of(c["fixed_ms"] <= FIXED_COST_TARGET_MS),
            )
        )
    for w, d in r.get("ddp", {}).items():
        rows.append(
            (
                f"steady throughput, 2 compute workers over torchrun DDP with 2 processes, gloo ({w})",
                f"{d['ratio']:.2f} (median of the repeats' ratios; median samples/s {d['elastic']:.0f} and "
                f"{d['ddp']:.0f}; {d['steps']} steps of 2 x {WORKLOADS[w].batch})"
                + repeats_spread(d.get("pair_ratios", [])),
                f"≥ {DDP_TARGETS[w]:.1f}" if w in DDP_TARGETS else f"reported; aim ≥ {DDP_AIM:.1f}",
                verdict_of(d["ratio"] >= DDP_TARGETS.get(w, DDP_AIM)),
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
                f"{median:.3f} s; torchrun {fmt(tr_median, 3)} s; {fmt(speedup, 1)}x faster",
                f"≤ 1 s, ≥ 5x faster than torchrun, {before}",
                verdict_of(median <= 1.0 and no_worse and (speedup is not None and speedup >= 5)),
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
                verdict_of(worst <= bound and no_worse),
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
                f"{fmt(f.get('gap_after_cont_s'))} s",
                f"≤ 2 liveness intervals + one step = {f['bound_s']:.2f} s",
                verdict_of(f["longest_gap_s"] <= f["bound_s"]),
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
                verdict_of(max(v["in_run"] for v in snaps.values()) <= 0.02),
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
                    verdict_of(s["marginal_ratio"] <= MEMORY_PER_BYTE),
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
