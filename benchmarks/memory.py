"""A data server's peak memory over the bytes it must hold, for the benchmark suite (on clusters of its
own, the process's high-water mark read from /proc)."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefect_elastic.data_server import plan_shards
from prefect_elastic.dataset import partition_bounds
from prefect_elastic.local.cluster import LocalElasticCluster

from .elastic import make_job, run


def _rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident bytes of a process, from /proc (Linux)."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def memory(workload: str, data: str, small: str, epochs: int) -> dict[str, Any]:
    """Peak memory of each data server's worker process over the bytes the data server must hold.

    Baseline: the worker's resident memory before the job (Python, torch, Dask). Peak: its high-water
    mark at the end. Must hold: data partition + parameter slice + optimizer state (momentum, one more
    copy) + snapshot (parameters and momentum again) + the replica of its peer's snapshot (the peer's
    parameters and momentum). The same job on the `small` dataset separates what grows with the
    data (`marginal_ratio`: extra peak per extra byte held) from a fixed cost.
    """
    big_run, small_run = _memory_once(workload, data, epochs), _memory_once(workload, small, epochs)
    for server, other in zip(big_run, small_run, strict=True):
        server["growth_small_dataset"] = other["growth"]
        server["must_hold_small_dataset"] = other["must_hold"]
        server["marginal_ratio"] = (server["growth"] - other["growth"]) / (
            server["must_hold"] - other["must_hold"]
        )
    return {"workload": workload, "servers": big_run}


def _memory_once(workload: str, data: str, epochs: int) -> list[dict[str, Any]]:
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        # Data server i (and, with server 0, the coordinator) lives on static-i.
        static = [cluster.address_of(f"static-{i}") for i in range(2)]
        pids = [cluster.worker_pid(str(addr)) for addr in static]
        before = [_rss(pid)[0] for pid in pids]
        job = make_job(workload, data, epochs=epochs, job_id="memory")
        result, _ = run(cluster, job)
        peaks = [_rss(pid)[1] for pid in pids]
    plan = plan_shards(result.state_dict, job.data_servers, job.min_shard_bytes)
    with np.load(data) as arrays:
        per_sample = (arrays["x"].nbytes + arrays["y"].nbytes) // len(arrays["y"])
        total = len(arrays["y"])
    servers = []

    def nbytes(names: list[str]) -> int:
        return sum(result.state_dict[n].numel() * result.state_dict[n].element_size() for n in names)

    for i, names in enumerate(plan):
        start, stop = partition_bounds(total, job.data_servers, i)
        params = nbytes(names)
        replica = 2 * nbytes(plan[(i + 1) % len(plan)]) if job.peer_replicas and len(plan) > 1 else 0
        must_hold = (stop - start) * per_sample + 4 * params + replica
        grown = peaks[i] - before[i]
        servers.append(
            {
                "server": i,
                "holds_coordinator": i == 0,
                "baseline_rss": before[i],
                "peak_rss": peaks[i],
                "growth": grown,
                "data_bytes": (stop - start) * per_sample,
                "param_bytes": params,
                "replica_bytes": replica,
                "must_hold": must_hold,
                "ratio": grown / must_hold,
            }
        )
    return servers
