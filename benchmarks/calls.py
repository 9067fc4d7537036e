"""What a Dask actor call costs a compute worker: the floor under the framework's fixed cost per step.

A step of one compute worker makes, one after the other: the pull of every shard's parameters (calls that
receive, sent together), the gradient, the push to every shard (calls that send, sent together), and the
report, whose answer waits for the coordinator's `apply` call to every shard. This measures those calls
alone, between the same processes the benchmark's training uses (a task on the elastic worker, actors on
the two static workers), with empty payloads and with one shard's share of each workload's parameters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .elastic import ClusterPool
from .workloads import WORKLOADS


class Sink:
    """An actor that takes and gives tensors and does nothing else."""

    async def take(self, tensors: dict[str, torch.Tensor]) -> int:
        return len(tensors)

    async def give(self, numel: int) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(numel)} if numel else {}


def _send_one(sinks: list[Any], payload: Any) -> None:
    sinks[0].take(payload).result()


def _send_all(sinks: list[Any], payload: Any) -> None:
    for f in [s.take(payload) for s in sinks]:
        f.result()


def _receive_all(sinks: list[Any], numel: Any) -> None:
    for f in [s.give(numel) for s in sinks]:
        f.result()


def _median_ms(call: Callable[[list[Any], Any], None], sinks: list[Any], arg: Any, repeats: int) -> float:
    call(sinks, arg)  # the first call opens the connections
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(sinks, arg)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _measure(sinks: list[Any], shares: dict[str, int], repeats: int) -> dict[str, dict[str, float]]:
    from distributed import secede

    secede()  # like the compute loop: a long task that leaves its thread slot free
    out: dict[str, dict[str, float]] = {}
    for label, numel in shares.items():
        payload = {"w": torch.randn(numel)} if numel else {}
        out[label] = {
            "send_one": _median_ms(_send_one, sinks, payload, repeats),
            "send_all": _median_ms(_send_all, sinks, payload, repeats),
            "receive_all": _median_ms(_receive_all, sinks, numel, repeats),
        }
    return out


def shard_numel(workload: str, shards: int = 2) -> int:
    """Float32 values of one shard's share of `workload` (the benchmark's jobs use two data servers)."""
    return WORKLOADS[workload].param_bytes() // 4 // shards


def calls(pool: ClusterPool, repeats: int) -> dict[str, Any]:
    """Median milliseconds of an actor call from the elastic worker, by payload: to one static worker, to
    both at once, and a reply of that size from both at once."""
    shares = {"empty": 0, **{f"{w} share": shard_numel(w) for w in ("cnn", "mlp")}}
    with pool.elastic(1) as cluster:
        client = cluster.client(set_as_default=False)
        try:
            static = [cluster.address_of(n) for n in cluster.worker_names(static=True)]
            elastic = [cluster.address_of(n) for n in cluster.worker_names(static=False)]
            futures = [client.submit(Sink, actor=True, workers=[a], pure=False) for a in static]
            sinks = [f.result() for f in futures]
            measured = client.submit(
                _measure, sinks, shares, repeats, workers=elastic[:1], pure=False
            ).result()
        finally:
            client.close()
    return {
        "repeats": repeats,
        "bytes": {label: 4 * n for label, n in shares.items()},
        "ms": measured,
    }
