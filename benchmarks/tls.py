"""What TLS costs: steady throughput of one compute worker on a cluster whose every connection is TLS
(`LocalElasticCluster(security=True)`: Dask's traffic and the step path's own connections), against the
same cluster without it, in alternating pairs, each cluster started once."""

from __future__ import annotations

import statistics
from typing import Any

from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training import train

from .elastic import make_job, steady_throughput


def tls_costs(epochs: dict[str, int], data: str, repeats: int) -> dict[str, dict[str, Any]]:
    """For each workload (-> its epochs): 1 - the median of the pairs' ratios (throughput with TLS /
    without), on one pair of clusters started once for all of them."""
    pairs: dict[str, list[dict[str, float]]] = {w: [] for w in epochs}
    with (
        LocalElasticCluster(static_workers=2, elastic_workers=1) as plain,
        LocalElasticCluster(static_workers=2, elastic_workers=1, security=True) as tls,
    ):
        for workload, n in epochs.items():
            job = make_job(workload, data, epochs=n, job_id="tls")
            for cluster in (plain, tls):  # warm-up, uncounted
                train(job.model_copy(update={"epochs": 1}), cluster=cluster)
            for i in range(repeats):
                pair: dict[str, float] = {}
                for name in ("tls", "plain") if i % 2 == 0 else ("plain", "tls"):
                    result = train(job, cluster=tls if name == "tls" else plain)
                    pair[name] = steady_throughput(result)
                pairs[workload].append(pair)
    out: dict[str, dict[str, Any]] = {}
    for workload, runs in pairs.items():
        ratios = [p["tls"] / p["plain"] for p in runs]
        out[workload] = {
            "workload": workload,
            "pairs": runs,
            "ratios": ratios,
            "cost": 1.0 - statistics.median(ratios),
        }
    return out
