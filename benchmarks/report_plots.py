"""The plots of docs/benchmarks.md: throughput and loss through a kill and a join, the throughput ratios
against their targets, and where a step's time goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from .targets import DDP_AIM, DDP_TARGETS, FIXED_COST_TARGET_MS, STEADY_TARGETS, Results


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
