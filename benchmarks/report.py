"""docs/benchmarks.md and its plots, from the raw results of `benchmarks.run`."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

Results = dict[str, Any]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def figures(r: Results) -> list[tuple[str, str, str, str]]:
    """(figure, measured, target, verdict) rows of the summary table."""
    rows: list[tuple[str, str, str, str]] = []
    for w in ("cnn", "mlp", "cnn-tiny"):
        s = r["steady"].get(w)
        if s is None:
            continue
        ratio = s["ratio"]
        target = "≥ 0.85" if w == "cnn" else "reported"
        rows.append(
            (
                f"steady throughput, 1 worker, over plain PyTorch ({w}, {r['workloads'][w]})",
                f"{ratio:.2f} (median of the repeats' ratios; median samples/s {s['elastic']:.0f} and "
                f"{s['plain']:.0f})"
                + (
                    f"; over plain with the workers' allocator settings {s['ratio_tuned']:.2f}"
                    if "ratio_tuned" in s
                    else ""
                )
                + (
                    f"; repeats {min(s['pair_ratios']):.2f} to {max(s['pair_ratios']):.2f}"
                    if len(s.get("pair_ratios", [])) > 1
                    else ""
                ),
                target,
                _verdict(ratio >= 0.85) if w == "cnn" else "reported",
            )
        )
    rec = r["recovery"].get("reassign")
    tr = r.get("torchrun", {}).get("recovery")
    tr_times = [k["recovery_s"] for k in (tr or {}).get("kills", []) if k.get("recovered")]
    tr_median = statistics.median(tr_times) if tr_times else None
    if rec and rec["recovery_s"]:
        median = rec["recovery_s"]["median"]
        speedup = tr_median / median if tr_median else None
        rows.append(
            (
                f"recovery, SIGKILL of 1 of 2 workers to next commit (median of {rec['recovery_s']['n']})",
                f"{median:.3f} s; torchrun {_fmt(tr_median, 3)} s; {_fmt(speedup, 1)}x faster",
                "≤ 1 s and ≥ 5x faster than torchrun",
                _verdict(median <= 1.0 and (speedup is not None and speedup >= 5)),
            )
        )
    if rec and rec["scale_up_s"]:
        bound = rec["liveness_interval"] + 0.5
        worst = rec["scale_up_s"]["max"]
        rows.append(
            (
                f"scale-up, registration to first committed batch (median, max of {rec['scale_up_s']['n']})",
                f"{rec['scale_up_s']['median']:.3f} s, max {worst:.3f} s",
                f"≤ liveness interval + 0.5 s = {bound:.1f} s",
                _verdict(worst <= bound),
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
        what = {"send_one": "to one shard", "send_all": "to both at once", "receive_all": "from both at once"}
        rows.append(
            (
                f"a Dask actor call from the compute worker, median ms: {sizes}",
                "; ".join(
                    f"{text} " + " / ".join(f"{v[key]:.2f}" for v in c["ms"].values())
                    for key, text in what.items()
                ),
                "reported: the floor under the fixed cost of a step",
                "reported",
            )
        )
    mem = r.get("memory")
    if mem:
        for s in mem["servers"]:
            rows.append(
                (
                    f"data server {s['server']} peak memory over what it must hold ({mem['workload']})",
                    f"{s['ratio']:.2f} ({s['growth'] / 2**20:.0f} MiB / {s['must_hold'] / 2**20:.0f} MiB); "
                    f"per extra byte held: {s['marginal_ratio']:.2f}",
                    "reported; explain > 2",
                    "reported",
                )
            )
    for w, runs in r.get("scaling", {}).items():
        text = ", ".join(f"{x['workers']}: {x['samples_per_s']:.0f}" for x in runs)
        rows.append((f"throughput by compute workers ({w}), samples/s", text, "reported", "reported"))
    return rows


def markdown(r: Results, plots: dict[str, str]) -> str:
    m = r["machine"]
    lines = [
        f"Made by `{r['command']}` (`bash scripts/bench.sh` sets up and runs it) on {r['started']}; "
        f"raw results in [`{r['raw_rel']}`]({r['raw_rel']}).",
        "",
        f"Machine: {m['cpus']} cores ({m['cpu_model']}), {m['memory_gib']:.0f} GiB, {m['device']}; "
        f"Python {m['python']}, torch {m['torch']}, dask {m['dask']}. Every training process runs "
        f"{r['threads']} torch thread; prefect-elastic runs 2 static workers (2 data servers, the "
        "coordinator) and its compute workers as separate processes on the same cores.",
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
    for w in ("cnn", "mlp", "cnn-tiny"):
        if w in r["steady"]:
            labels.append(f"throughput\n/ plain\n({w})")
            values.append(r["steady"][w]["ratio"])
            targets.append(0.85 if w == "cnn" else None)
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
    fig, ax = plt.subplots(figsize=(11, 3.8))
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
    block = f"{START}\n{markdown(r, plots)}\n{END}"
    text = docs.read_text() if docs.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise ValueError(f"{docs} lacks the marks {START!r} and {END!r}; put them where the results go")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    docs.write_text(head + block + tail)
