"""What TLS costs: steady throughput of one compute worker on a cluster whose every connection is TLS
(`LocalElasticCluster(security=True)`: Dask's traffic and the step path's own connections), against the
same cluster without it, in alternating pairs, each cluster started once."""

from __future__ import annotations

import statistics
from typing import Any

from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training import train

from .elastic import make_job, steady_throughput


def tls_cost(workload: str, data: str, epochs: int, repeats: int) -> dict[str, Any]:
    """1 - the median of the pairs' ratios (throughput with TLS / without)."""
    job = make_job(workload, data, epochs=epochs, job_id="tls")
    with (
        LocalElasticCluster(static_workers=2, elastic_workers=1) as plain,
        LocalElasticCluster(static_workers=2, elastic_workers=1, security=True) as tls,
    ):
        for cluster in (plain, tls):  # warm-up, uncounted
            train(job.model_copy(update={"epochs": 1}), cluster=cluster)
        pairs: list[dict[str, float]] = []
        for i in range(repeats):
            pair: dict[str, float] = {}
            for name in ("tls", "plain") if i % 2 == 0 else ("plain", "tls"):
                result = train(job, cluster=tls if name == "tls" else plain)
                pair[name] = steady_throughput(result)
            pairs.append(pair)
    ratios = [p["tls"] / p["plain"] for p in pairs]
    return {"workload": workload, "pairs": pairs, "ratios": ratios, "cost": 1.0 - statistics.median(ratios)}
