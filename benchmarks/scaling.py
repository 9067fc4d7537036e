"""Scale shown, not assumed: throughput by compute workers and data servers, beside the plain loop.

    python -m benchmarks.scaling [--workload resnet18] [--workers 1,2,4] [--data-servers 1,2,4]
        [--steps 30] [--repeats 1] [--raw docs/benchmarks/scaling.json] [--docs docs/benchmarks.md]

For every count of data servers S a cluster of its own (S static workers, one data server on each, the
coordinator beside data server 0, and as many elastic workers as the largest count of compute workers,
one thread each), warmed by a short job of every worker that is not counted; then for every count of
compute workers N, from the largest down (the workers left are the warm ones): the plain loop on the same
model and data in a process of its own (`plain.plain_process`: one micro-batch of the workload's batch a
step, the per-worker batch), then a sync job of N micro-batches a step, one per worker, with every data
server holding parameters (`min_shard_bytes=0`, tensors split where larger than a share). Each job's
data is sized for `--steps` steps; throughput and step time leave out the first 5 commits
(`elastic.steady_throughput`, `elastic.fixed_cost`), as the other benchmarks do.

Per configuration: samples/s, the step, the loops' compute phase, the fixed cost of a step (over the plain
loop's step, and over the loops' own compute), the scaling efficiency (N workers' throughput over N times
one worker's with as many data servers) and the throughput over N plain loops. From the fixed costs and
one worker's compute, the model of `scaling_model.py` predicts `--predict` workers (64). The raw figures go
to `--raw`, the table and the plot between the scaling marks of `--docs` (docs/img/bench-scaling.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect_elastic import ElasticJob
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training import train

from . import elastic, scaling_model
from .plain import plain_process
from .report import replace_between
from .run import machine
from .workloads import LR, MOMENTUM, THREADS, WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- scaling:start (written by python -m benchmarks.scaling; edit outside these marks) -->"
END = "<!-- scaling:end -->"
PLOT = "bench-scaling.png"
SKIP = 5  # commits left out of every steady figure (as `elastic.steady_throughput` leaves out)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def make_job(workload: str, data: str, workers: int, servers: int, liveness_interval: float) -> ElasticJob:
    return ElasticJob(
        job_id=f"scale-{servers}-{workers}",
        model=WORKLOADS[workload].model,
        dataset=f"file://{data}",
        optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        batch_size=WORKLOADS[workload].batch,
        micro_batches=workers,  # one micro-batch of the workload's batch per worker and step
        epochs=1,
        data_servers=servers,
        min_shard_bytes=0,  # every data server holds its share of the parameters: S is what varies
        liveness_interval=liveness_interval,
        threads_per_worker=THREADS,
        min_workers=1,
    )


def resize(cluster: LocalElasticCluster, workers: int) -> None:
    """Exactly `workers` elastic workers: the last ones retired (the first ones stay, warm), or added."""
    cluster.wait_for_pending()
    names = cluster.worker_names(static=False)
    for name in names[workers:]:
        cluster.retire_worker(name)
    for _ in range(workers - len(names)):
        cluster.add_worker()


def dataset(workload: str, folder: Path, steps: int, workers: int, servers: int) -> str:
    spec = WORKLOADS[workload]
    return spec.dataset(folder, scaling_model.samples_for(steps, workers, servers, spec.batch))


def elastic_run(
    cluster: LocalElasticCluster, workload: str, data: str, workers: int, servers: int, liveness: float
) -> dict[str, Any]:
    resize(cluster, workers)
    job = make_job(workload, data, workers, servers, liveness)
    started = time.time()
    result = train(job, cluster=cluster)
    wall = time.time() - started
    cost = elastic.fixed_cost(result, skip=SKIP)
    return {
        "workers": workers,
        "servers": servers,
        "steps": result.steps,
        "samples_per_s": elastic.steady_throughput(result, skip=SKIP),
        "devices": sorted({loop.device for loop in result.loops}),
        "loops": len(result.loops),
        "backups": sum(loop.backups for loop in result.loops),
        "snapshots": result.counters.get("snapshots", 0),
        "wall_s": wall,
        **cost,
    }


def attempt(errors: dict[str, str], name: str, fn: Any, *args: Any) -> Any:
    """One run; a failure is recorded (and shown) instead of ending the benchmark."""
    say(f"{name} ...")
    try:
        value = fn(*args)
    except Exception as exc:
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"
        say(f"{name} FAILED: {exc}")
        return None
    say(f"{name} done")
    return value


def measure(args: argparse.Namespace) -> dict[str, Any]:
    workload, steps = args.workload, args.steps
    folder = Path(args.data_dir)
    errors: dict[str, str] = {}
    configs: list[dict[str, Any]] = []
    top = max(args.workers)
    for servers in args.data_servers:
        with LocalElasticCluster(static_workers=servers, elastic_workers=top) as cluster:
            # A fresh cluster's first job is slower in every phase (benchmarks/scenarios.py): every worker
            # trains a few steps first, not counted.
            warm = dataset(workload, folder, 3, top, servers)
            attempt(errors, f"warm-up S={servers}", elastic_run, cluster, workload, warm, top, servers, 1.0)
            for workers in sorted(args.workers, reverse=True):
                data = dataset(workload, folder, steps, workers, servers)
                runs: list[dict[str, Any]] = []
                plains: list[dict[str, Any]] = []
                for i in range(args.repeats):
                    name = f"S={servers} N={workers} #{i}"
                    # The plain loop next to each run, so the machine's drift weighs on both alike.
                    plain = attempt(errors, f"plain {name}", plain_process, workload, data, steps)
                    run = attempt(
                        errors, f"elastic {name}", elastic_run, cluster, workload, data, workers, servers,
                        args.liveness_interval,
                    )  # fmt: skip
                    if plain and run:
                        plains.append(plain)
                        runs.append(run)
                if runs:
                    configs.append(
                        {"servers": servers, "workers": workers, "runs": runs, "plain_runs": plains}
                    )
    configs.sort(key=lambda c: (c["servers"], c["workers"]))
    return {"configs": configs, "errors": errors, "param_bytes": WORKLOADS[workload].param_bytes()}


def derive(r: dict[str, Any]) -> None:
    """Each configuration's row from its runs, then the model and its predictions (again from the raw runs
    where `--report-only` asks)."""
    for c in r["configs"]:
        # The repeat of the median step, whole, with the plain loop measured next to it: a row's figures
        # come from one moment of the machine (a mean of two repeats' rates is no rate of their steps).
        pick = scaling_model.median_repeat([run["step_ms"] for run in c["runs"]])
        run, plain = c["runs"][pick], c["plain_runs"][pick]
        c.update({k: run[k] for k in ("samples_per_s", "step_ms", "compute_ms")})
        c["plain"] = {k: plain[k] for k in ("samples_per_s", "step_ms")}
        c["devices"] = sorted({d for x in c["runs"] for d in x["devices"]})
        c["load_mb"] = scaling_model.shard_load_mb(c["workers"], c["servers"], r["param_bytes"])
    for c in r["configs"]:
        one = next((o for o in r["configs"] if o["servers"] == c["servers"] and o["workers"] == 1), None)
        c["figures"] = scaling_model.config_figures(c, one, c["plain"])
    r["devices"] = sorted({d for c in r["configs"] for d in c["devices"]})
    model_and_predictions(r, r["predict"])


def model_and_predictions(r: dict[str, Any], predict: int) -> None:
    """Fit the fixed cost's model to the configurations and predict `predict` workers with each count of
    data servers measured, and with as many as keep the largest measured N / S."""
    points = [
        (c["load_mb"], c["figures"]["fixed_ms"]) for c in r["configs"] if c["figures"]["fixed_ms"] is not None
    ]
    try:
        fit = scaling_model.fit_fixed_cost(points)
    except ValueError as exc:
        r["model"], r["model_error"] = None, str(exc)
        return
    ones = [c["compute_ms"] for c in r["configs"] if c["workers"] == 1 and c["compute_ms"] is not None]
    if not ones:
        r["model"], r["model_error"] = None, "no run of one worker measured the compute phase"
        return
    r["model"] = asdict(fit)
    r["compute_ms"] = statistics.median(ones)
    servers = sorted({c["servers"] for c in r["configs"]})
    ratio = max(c["workers"] / c["servers"] for c in r["configs"])
    servers.append(max(1, round(predict / ratio)))
    batch = WORKLOADS[r["workload"]].batch
    r["predictions"] = [
        {
            **asdict(scaling_model.predict(fit, r["compute_ms"], predict, s, r["param_bytes"], batch)),
            "load_mb": scaling_model.shard_load_mb(predict, s, r["param_bytes"]),
        }
        for s in dict.fromkeys(servers)
    ]


def write(r: dict[str, Any], raw: Path, docs: Path) -> str:
    """The plot into docs/img and the table between the scaling marks of `docs`; returns the block."""
    img = docs.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    plot = None
    if r["configs"]:
        scaling_model.plot(r, img / PLOT)
        plot = f"{img.name}/{PLOT}"
    block = scaling_model.markdown({**r, "raw_rel": os.path.relpath(raw, docs.parent)}, plot)
    replace_between(docs, START, END, block)
    say(f"wrote {docs} and {img / PLOT}")
    return block


def command(args: argparse.Namespace) -> str:
    """The command that measures what `args` measured (where it wrote its files left out)."""
    join = ",".join
    return (
        f"python -m benchmarks.scaling --workload {args.workload} --workers {join(map(str, args.workers))} "
        f"--data-servers {join(map(str, args.data_servers))} --steps {args.steps} --repeats {args.repeats}"
        + ("" if args.liveness_interval == 1.0 else f" --liveness-interval {args.liveness_interval}")
    )


def counts(text: str) -> list[int]:
    values = sorted({int(x) for x in text.split(",") if x.strip()})
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"counts of 1 or more, comma-separated: {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workload", default="resnet18", choices=sorted(WORKLOADS))
    many = (os.cpu_count() or 1) >= 16  # (a machine with cores for 8 workers besides the data servers)
    parser.add_argument("--workers", type=counts, default=counts("1,2,4,8" if many else "1,2,4"))
    parser.add_argument("--data-servers", type=counts, default=counts("1,2,4"))
    parser.add_argument("--steps", type=int, default=30, help="steps of each run (the first 5 not counted)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (medians)")
    parser.add_argument("--liveness-interval", type=float, default=1.0, help="snapshots this often (s)")
    parser.add_argument("--predict", type=int, default=64, help="the count of workers the model predicts")
    parser.add_argument("--data-dir", default="/tmp/prefect-elastic-bench", help="datasets")
    parser.add_argument("--raw", default=str(ROOT / "docs" / "benchmarks" / "scaling.json"))
    parser.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--report-only", action="store_true", help="rewrite --docs from --raw; run nothing")
    args = parser.parse_args(argv)
    if args.steps < 2 * SKIP + 2:
        parser.error(f"--steps must be at least {2 * SKIP + 2}: the first {SKIP} are not counted")
    raw, docs = Path(args.raw), Path(args.docs)
    if args.report_only:
        stored = json.loads(raw.read_text())
        stored.setdefault("predict", args.predict)
        derive(stored)
        raw.write_text(json.dumps(stored, indent=1, default=str))
        write(stored, raw, docs)
        return 0
    load_before = os.getloadavg()
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    say(f"scaling of {args.workload}: workers {args.workers}, data servers {args.data_servers}")
    measured = measure(args)
    r: dict[str, Any] = {
        "command": command(args),
        "started": started,
        "machine": machine(),
        "load": {"before": load_before, "after": os.getloadavg()},
        "workload": args.workload,
        "batch": WORKLOADS[args.workload].batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "liveness_interval": args.liveness_interval,
        "predict": args.predict,
        **measured,
    }
    derive(r)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(r, indent=1, default=str))
    print(write(r, raw, docs))
    if r["errors"]:
        say(f"{len(r['errors'])} run(s) failed: {', '.join(r['errors'])}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
