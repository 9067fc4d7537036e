"""The step path with and without shared memory (`prefect_elastic/inbox.py`), side by side in one run.

Two local clusters (2 static workers, 1 compute worker each), one started with
`PREFECT_ELASTIC_SHARED_MEMORY=0`; each workload trains one epoch on each in turn, alternating which goes
first, `pairs` times after a warm-up pair. Prints the steady samples/s, the fixed cost of a step (step
time minus compute) and how the shards received their bodies.

    python -m benchmarks.shared_memory --workloads mlp,cnn-20 --pairs 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import elastic
from benchmarks.workloads import WORKLOADS, write_dataset
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.wire.inbox import ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_memory", description=__doc__)
    known = ", ".join(WORKLOADS)
    parser.add_argument("--workloads", default="mlp,cnn-20", help=f"comma-separated, of {known}")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--data-dir", default="/tmp/prefect-elastic-bench")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown} (known: {known})")
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: give 1 or more")
    data = write_dataset(Path(args.data_dir) / "synthetic-16384.npz", 16384)
    clusters = {
        "shared": LocalElasticCluster(static_workers=2, elastic_workers=1).start(),
        "socket": LocalElasticCluster(static_workers=2, elastic_workers=1, env={ENV: "0"}).start(),
    }
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {(w, k): [] for w in workloads for k in clusters}
    try:
        for workload in workloads:
            for i in range(args.pairs + 1):  # (pair 0 warms both clusters up)
                for way in ("shared", "socket") if i % 2 else ("socket", "shared"):
                    job = elastic.make_job(
                        workload, data, epochs=1, liveness_interval=1000.0, job_id=f"shm-{workload}-{i}-{way}"
                    )
                    result, _ = elastic.run(clusters[way], job)
                    cost = elastic.fixed_cost(result)
                    throughput = elastic.steady_throughput(result)
                    if i:
                        rows[(workload, way)].append((throughput, float(cost["fixed_ms"] or 0.0)))
                    print(
                        f"{workload} {way}: {throughput:.0f} samples/s, fixed {cost['fixed_ms']:.2f} ms,"
                        f" bodies received by the shards {cost['shard_bodies']}",
                        flush=True,
                    )
    finally:
        for cluster in clusters.values():
            cluster.close()
    print("\n| workload | bodies | median samples/s | fixed cost per pair, ms |\n|---|---|---|---|")
    for (workload, way), got in rows.items():
        fixed = ", ".join(f"{f:.2f}" for _, f in got)
        print(f"| {workload} | {way} | {statistics.median(t for t, _ in got):.0f} | {fixed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
