"""The scaling benchmark's figures and its model of a step, from measured runs (pure: no cluster, no timing).

`benchmarks/scaling.py` runs the configurations and hands each run's numbers here: `config_figures` turns
them into the table's row (throughput, step, the fixed cost of a step two ways, the scaling efficiency),
`fit_fixed_cost` fits the fixed cost's model to the rows, and `predict` says what the model gives for a
number of workers nobody measured. `markdown` and `plot` write them for docs/benchmarks.md.

The model. A sync step of N compute workers (one micro-batch each) over S data servers holding P bytes of
parameters between them takes

    step(N, S) = compute + fixed(N, S),   fixed(N, S) = a + b * N * P / S

where `compute` is one worker's forward and backward of its micro-batch, `a` is what a step costs whatever
N and S (a worker's own pull and push of the whole model, the waits between the step's messages) and
`b` is the cost per byte a data server takes in per step: every one of the N workers pushes each shard its
P / S bytes of gradients and takes back P / S bytes of parameters, and a shard, one thread, handles those
one after another before and around its update. `a` and `b` are fitted by least squares to the fixed costs
measured (step time minus the loops' own compute phase). The model assumes each compute worker and each
data server has a core of its own (a GPU of its own), that the links between them do not saturate beyond
the shard's own handling, that the slowest of N workers is no slower than a typical one (no stragglers),
and that nothing else grows with N (the coordinator's per-step work is small against the shards').
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1e6


def samples_for(steps: int, workers: int, servers: int, batch: int) -> int:
    """The dataset size that gives a sync job of `workers` micro-batches a step, over `servers` data
    servers, at least `steps` steps in one epoch: every partition holds whole batches (the schedule drops
    a partition's last partial batch), and the partitions are equal."""
    per_server = math.ceil(steps * workers / servers)
    return servers * per_server * batch


def median_repeat(steps_ms: list[float]) -> int:
    """The index of the repeat whose step is the median one (of two middle ones, the faster: the one the
    machine's other work disturbed less)."""
    order = sorted(range(len(steps_ms)), key=lambda i: steps_ms[i])
    return order[(len(order) - 1) // 2]


@dataclass(frozen=True)
class FixedCostModel:
    """fixed(N, S) = base_ms + per_mb_ms * N * P / S (P in MB): see the module's docstring."""

    base_ms: float
    per_mb_ms: float
    points: int

    def fixed_ms(self, workers: int, servers: int, param_bytes: int) -> float:
        return self.base_ms + self.per_mb_ms * shard_load_mb(workers, servers, param_bytes)


def shard_load_mb(workers: int, servers: int, param_bytes: int) -> float:
    """The MB of gradients each data server takes in per step (as many again go back as parameters)."""
    return workers * param_bytes / servers / MB


def fit_fixed_cost(points: list[tuple[float, float]]) -> FixedCostModel:
    """Least squares of `fixed_ms = base + per_mb * load_mb` over (load_mb, fixed_ms) points. Two
    different loads at least: with one, the growth with the load is not measured."""
    loads = [x for x, _ in points]
    if len(set(loads)) < 2:
        raise ValueError(
            f"the fixed cost's growth needs configurations of at least two loads per data server (N*P/S), "
            f"got {sorted(set(loads))}"
        )
    mean_x = statistics.fmean(loads)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x in loads)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return FixedCostModel(base_ms=mean_y - slope * mean_x, per_mb_ms=slope, points=len(points))


@dataclass(frozen=True)
class Prediction:
    workers: int
    servers: int
    step_ms: float
    fixed_ms: float
    samples_per_s: float
    efficiency: float  # its throughput over `workers` times the model's one worker with the same servers


def predict(
    model: FixedCostModel, compute_ms: float, workers: int, servers: int, param_bytes: int, batch: int
) -> Prediction:
    fixed = model.fixed_ms(workers, servers, param_bytes)
    step = compute_ms + fixed
    one = compute_ms + model.fixed_ms(1, servers, param_bytes)
    return Prediction(
        workers=workers,
        servers=servers,
        step_ms=step,
        fixed_ms=fixed,
        samples_per_s=1000 * workers * batch / step,
        efficiency=one / step,
    )


def config_figures(
    run: dict[str, Any], one_worker: dict[str, Any] | None, plain: dict[str, Any]
) -> dict[str, Any]:
    """One configuration's row: `run` is its elastic run (`samples_per_s`, `step_ms`, `compute_ms`,
    `workers`), `one_worker` the run of one worker with as many data servers (None if not measured) and
    `plain` the plain loop measured next to it (`samples_per_s`, `step_ms`: the same per-worker batch)."""
    workers = run["workers"]
    return {
        "samples_per_s": run["samples_per_s"],
        "step_ms": run["step_ms"],
        "compute_ms": run["compute_ms"],
        "plain_step_ms": plain["step_ms"],
        # The brief's fixed cost: what a step takes beyond the plain loop's step of the same batch.
        "fixed_over_plain_ms": run["step_ms"] - plain["step_ms"],
        # Beyond the loops' own compute: what the model fits (the compute's slowdown when processes share
        # cores is left out of it).
        "fixed_ms": None if run["compute_ms"] is None else run["step_ms"] - run["compute_ms"],
        "efficiency": None
        if one_worker is None
        else run["samples_per_s"] / (workers * one_worker["samples_per_s"]),
        "over_plain": run["samples_per_s"] / (workers * plain["samples_per_s"]),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _loads(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def markdown(r: dict[str, Any], plot: str | None) -> str:
    """The block between the scaling marks of docs/benchmarks.md."""
    m = r["machine"]
    load = r["load"]
    lines = [
        f"Made by `{r['command']}`; raw figures in [`{r['raw_rel']}`]({r['raw_rel']}).",
        "",
        f"Machine: {m['cpus']} cores ({m['cpu_model']}), {m['memory_gib']:.0f} GiB, {m['device']}; "
        f"Python {m['python']}, torch {m['torch']}. Load averages (1, 5, 15 min) before the run "
        f"{_loads(load['before'])}, after it {_loads(load['after'])}. "
        f"Workload {r['workload']} ({r['param_bytes'] / MB:.1f} MB of parameters), a micro-batch of "
        f"{r['batch']} per worker and step, {r['steps']} steps a run (the first 5 left out), one torch "
        f"thread per process, every data server on a static worker of its own, the compute workers' loops "
        f"on {', '.join(r['devices']) or '?'}.",
        "",
        "| data servers | compute workers | samples/s | step ms | loop's compute ms | plain step ms | "
        "fixed over plain ms | fixed over compute ms | scaling efficiency | over N x plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["configs"]:
        f = c["figures"]
        lines.append(
            f"| {c['servers']} | {c['workers']} | {f['samples_per_s']:.1f} | {_ms(f['step_ms'])} | "
            f"{_ms(f['compute_ms'])} | {_ms(f['plain_step_ms'])} | {_ms(f['fixed_over_plain_ms'])} | "
            f"{_ms(f['fixed_ms'])} | {_ratio(f['efficiency'])} | {_ratio(f['over_plain'])} |"
        )
    errors = r.get("errors") or {}
    lines += [""] + [f"- {name} failed: {why}" for name, why in errors.items()]
    fit = r.get("model")
    if fit is None:
        lines += ["", f"No prediction: {r.get('model_error', 'no fit')}."]
    else:
        lines += [
            "",
            f"The fixed cost's model fitted to these {fit['points']} configurations: fixed(N, S) = "
            f"{fit['base_ms']:.1f} ms + {fit['per_mb_ms']:.3f} ms x N x P / S (P / S in MB: what each data "
            f"server takes in per step); compute = {r['compute_ms']:.1f} ms (one worker's compute phase).",
            "",
            "| predicted: data servers | compute workers | MB into each data server a step | step ms | "
            "fixed ms | samples/s | scaling efficiency |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in r["predictions"]:
            lines.append(
                f"| {p['servers']} | {p['workers']} | {p['load_mb']:.0f} | {p['step_ms']:.0f} | "
                f"{p['fixed_ms']:.0f} | {p['samples_per_s']:.0f} | {p['efficiency']:.2f} |"
            )
    if plot:
        lines += ["", f"![scaling by compute workers and data servers]({plot})"]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    """Left: throughput by compute workers, a line per count of data servers, beside N x one worker's.
    Right: the fixed cost against the MB each data server takes in per step, and the fitted line."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.get_cmap("tab10")
    for i, servers in enumerate(sorted({c["servers"] for c in r["configs"]})):
        rows = sorted((c for c in r["configs"] if c["servers"] == servers), key=lambda c: c["workers"])
        n = [c["workers"] for c in rows]
        left.plot(
            n, [c["figures"]["samples_per_s"] for c in rows], "o-", color=colors(i), label=f"S={servers}"
        )
        one = next((c for c in rows if c["workers"] == 1), None)
        if one:
            ideal = one["figures"]["samples_per_s"]
            left.plot(n, [k * ideal for k in n], ":", color=colors(i), lw=1)
        for c in rows:
            if c["figures"]["fixed_ms"] is not None:
                right.plot(c["load_mb"], c["figures"]["fixed_ms"], "o", color=colors(i))
                right.annotate(f"N={c['workers']}", (c["load_mb"], c["figures"]["fixed_ms"]), fontsize=7,
                               xytext=(3, 3), textcoords="offset points")  # fmt: skip
    left.set_xticks(sorted({c["workers"] for c in r["configs"]}))
    left.set_xlabel("compute workers (N)")
    left.set_ylabel("samples/s (dotted: N x one worker's)")
    left.set_title(f"Throughput, {r['workload']}")
    left.legend(fontsize=8)
    fit = r.get("model")
    loads = [c["load_mb"] for c in r["configs"]]
    if fit and loads:
        xs = [0.0, max(loads)]
        right.plot(xs, [fit["base_ms"] + fit["per_mb_ms"] * x for x in xs], "-", color="gray", lw=1,
                   label=f"{fit['base_ms']:.1f} + {fit['per_mb_ms']:.3f} x MB")  # fmt: skip
        right.legend(fontsize=8)
    right.set_xlabel("MB each data server takes in per step (N x P / S)")
    right.set_ylabel("fixed cost, ms (step minus compute)")
    right.set_title("The fixed cost of a step and its model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
