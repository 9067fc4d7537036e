"""Parameters that arrive bucket by bucket during forward (`overlap_pull`) against the whole pull, with the
compute worker across a network link from the data servers, side by side in one run.

`python -m benchmarks.overlap_pull [--workloads resnet18] [--repeats 3] [--rate 5gbit]` (as root, with `ip`
and `tc`): the scheduler and the two static workers listen on a bridge of this machine's root network
namespace; the one compute worker lives in a network namespace of its own, joined to the bridge by a veth
pair (`prefect_elastic.local.netns`), so its frames cross TCP as between two machines (no shared memory,
nothing read in place). Each direction of that link is shaped to `--rate` by tc's token bucket ("none":
the veth's own speed, a memory copy in the kernel). For each workload: the whole pull and the pull in
buckets, both with the gradients leaving during backward, in alternating order within each repeat; the
ratio is the median of the repeats' ratios. The table goes into docs/benchmarks.md between its marks.

Where the gate waits counts in the loop's compute phase (it runs inside forward), so the fixed cost a step
is no measure here: the samples per second and the step time are.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect_elastic import train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.netns import HostNetwork, NetworkNamespace

from . import elastic
from .report import replace_between
from .workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
NO_SNAPSHOTS = 1e6  # a liveness interval longer than any run: no periodic snapshot
START = "<!-- overlap-pull:start (written by python -m benchmarks.overlap_pull; edit outside these marks) -->"
END = "<!-- overlap-pull:end -->"
EPOCHS = {"resnet18": 1, "mlp-50": 1, "mlp": 2}
SAMPLES = {"resnet18": 2048, "mlp-50": 8192, "mlp": 8192}
KINDS = ("whole", "buckets")


def shape(ns: NetworkNamespace, rate: str) -> None:
    """Each direction of `ns`'s link to the bridge at `rate` (tc's token bucket filter)."""
    if rate == "none":
        return
    qdisc = ["qdisc", "replace", "dev"]
    limits = ["root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"]
    subprocess.run(["tc", *qdisc, ns.host_link, *limits], check=True, timeout=15)
    subprocess.run([*ns.exec_prefix(), "tc", *qdisc, ns.link, *limits], check=True, timeout=15)


def one_run(cluster: LocalElasticCluster, workload: str, data: str, kind: str) -> dict[str, Any]:
    job = elastic.make_job(
        workload, data, epochs=EPOCHS[workload], liveness_interval=NO_SNAPSHOTS, job_id=f"pull-{kind}",
        overlap_push=True,
    ).model_copy(update={"overlap_pull": kind == "buckets"})  # fmt: skip
    result = train(job, cluster=cluster)
    pulled = sum(loop.pulled for loop in result.loops)
    if (kind == "buckets") != (pulled > 0):
        raise RuntimeError(f"the {kind} run read {pulled} buckets during forward")
    cost = elastic.fixed_cost(result)
    return {
        "samples_per_s": elastic.steady_throughput(result),
        "step_ms": cost.get("step_ms", 0.0),
        "phase_ms": cost.get("phase_ms", {}),
    }


def measure(
    cluster: LocalElasticCluster, workload: str, workdir: Path, repeats: int, smoke: bool = False
) -> dict[str, Any]:
    data = WORKLOADS[workload].dataset(workdir, SAMPLES[workload] // (8 if smoke else 1))
    got: dict[str, list[float]] = {k: [] for k in KINDS}
    steps: dict[str, list[float]] = {k: [] for k in KINDS}
    for i in range(repeats):
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
            run = one_run(cluster, workload, data, kind)
            got[kind].append(run["samples_per_s"])
            steps[kind].append(run["step_ms"])
            phases = {k: round(v, 1) for k, v in run["phase_ms"].items()}
            print(f"{workload} #{i} {kind}: {run['samples_per_s']:.1f} samples/s, loop {phases}", flush=True)
    return {
        "workload": workload,
        "samples_per_s": {k: statistics.median(v) for k, v in got.items()},
        "step_ms": {k: statistics.median(v) for k, v in steps.items()},
        "ratio": statistics.median(b / w for b, w in zip(got["buckets"], got["whole"], strict=True)),
        "ratios": [b / w for b, w in zip(got["buckets"], got["whole"], strict=True)],
    }


def table(rows: list[dict[str, Any]], repeats: int, rate: str, load: float) -> str:
    lines = [
        f"Made by `python -m benchmarks.overlap_pull --rate {rate} --repeats {repeats}` (2 cores, no GPU, a "
        f"1-minute load average of {load:.1f} before it began): one compute worker in a network namespace of "
        f"its own, its link to the data servers shaped to {rate} each way; gradients leaving during backward "
        "in both runs; one micro-batch a step, no periodic snapshot.",
        "",
        "| workload | whole pull (samples/s) | in buckets (samples/s) | step, whole / in buckets (ms) "
        "| in buckets over whole (median; each repeat) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        sps, step = r["samples_per_s"], r["step_ms"]
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {r['workload']} | {sps['whole']:.1f} | {sps['buckets']:.1f} | {step['whole']:.1f} / "
            f"{step['buckets']:.1f} | **{r['ratio']:.2f}** ({each}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="resnet18")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="5gbit", help="each direction's rate (tc), or 'none'")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/prefect-elastic-bench"))
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--no-docs", action="store_true", help="print the table, leave docs alone")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code, not the speed")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    rows = []
    with HostNetwork() as net, LocalElasticCluster(2, 0, host=net.address).start() as cluster:
        ns = net.namespace()
        shape(ns, args.rate)
        cluster.add_worker(netns=ns)
        for workload in args.workloads.split(","):
            rows.append(measure(cluster, workload, args.workdir, args.repeats, args.smoke))
    text = table(rows, args.repeats, args.rate, load)
    if args.smoke:
        text = "(smoke sizes: the numbers mean nothing)\n\n" + text
    print(text)
    if not args.no_docs:
        replace_between(args.docs, START, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
