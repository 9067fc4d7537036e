"""What a round trip costs a compute worker: the floor under the framework's fixed cost per step.

A step of one compute worker sends every shard one frame on the step path's connection (wire/channel.py: its
share of the gradients) and reads one back (the next step's parameters). This measures that exchange
alone (`channel`: a frame of one shard's share to both static workers at once, and one of that size back
from each, on the Unix sockets a loop on the shards' machine uses; `channel_tcp`: the same over TCP, as
from another machine), beside what the same payloads cost as Dask actor calls (the step path's transport
before channel.py: `send_one`, `send_all`, `receive_all`), between the same processes the benchmark's training
uses (a task on the elastic worker, actors and listeners on the two static workers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from prefect_elastic.allocator import tune_allocator
from prefect_elastic.wire import ChannelAddress, Entry, Frame, ShardLink, ShardServer

from .elastic import ClusterPool
from .workloads import WORKLOADS


class Sink:
    """An actor that takes and gives tensors and does nothing else, as actor calls and on a channel."""

    def __init__(self) -> None:
        tune_allocator()  # as a data server does: the receive buffers are megabytes
        self.server: ShardServer | None = None

    async def take(self, tensors: dict[str, torch.Tensor]) -> int:
        return len(tensors)

    async def give(self, numel: int) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(numel)} if numel else {}

    async def open_channel(self, host: str) -> ChannelAddress:
        held: dict[int, torch.Tensor] = {}

        async def answer(frame: Frame) -> Frame:
            # Tensors the sink holds, as a shard sends its parameters: made once, not per answer.
            numel = int(frame.header["numel"])
            if not numel:
                return Frame({"ok": True})
            tensor = held.setdefault(numel, torch.zeros(numel))
            return Frame({"ok": True}, [(Entry("state", -1, "w"), tensor)])

        self.server = ShardServer(answer)
        return await self.server.start(host)

    async def close_channel(self) -> None:
        if self.server is not None:
            await self.server.aclose()


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


def _exchange(links: list[ShardLink], frame: Frame) -> None:
    for link in links:
        link.send(frame)
    for link in links:
        link.receive()


def _measure(
    sinks: list[Any], hosts: list[str], shares: dict[str, int], repeats: int
) -> dict[str, dict[str, float]]:
    from distributed import secede

    secede()  # like the compute loop: a long task that leaves its thread slot free
    tune_allocator()
    # Opened from here: an actor handle works from a task, not from a client that is not the default.
    channels = [s.open_channel(host).result() for s, host in zip(sinks, hosts, strict=True)]
    links = [ShardLink(address, timeout=30.0) for address in channels]
    tcp_links = [ShardLink(address._replace(local=""), timeout=30.0) for address in channels]
    out: dict[str, dict[str, float]] = {}
    try:
        for label, numel in shares.items():
            payload = {"w": torch.randn(numel)} if numel else {}
            # Made before the clock starts, as a loop's gradients exist before it sends them.
            frame = Frame({"numel": numel}, [(Entry("grad", 0, "w"), payload["w"])] if numel else [])
            out[label] = {
                "channel": _median_ms(_exchange, links, frame, repeats),
                "channel_tcp": _median_ms(_exchange, tcp_links, frame, repeats),
                "send_one": _median_ms(_send_one, sinks, payload, repeats),
                "send_all": _median_ms(_send_all, sinks, payload, repeats),
                "receive_all": _median_ms(_receive_all, sinks, numel, repeats),
            }
        if not all(link.local for link in links):
            raise RuntimeError("a link to a shard on this machine did not use its Unix socket")
    finally:
        for link in links + tcp_links:
            link.close()
        for sink in sinks:
            sink.close_channel().result()
    return out


def shard_numel(workload: str, shards: int = 2) -> int:
    """Float32 values of one shard's share of `workload` (the benchmark's jobs use two data servers)."""
    return WORKLOADS[workload].param_bytes() // 4 // shards


def calls(pool: ClusterPool, repeats: int) -> dict[str, Any]:
    """Median milliseconds, by payload, from the elastic worker: a channel exchange with both static
    workers (a frame out and one back, as a step does), and actor calls to one static worker, to both at
    once, and a reply of that size from both at once."""
    from distributed.comm import get_address_host

    shares = {"empty": 0, **{f"{w} share": shard_numel(w) for w in ("cnn", "mlp")}}
    with pool.elastic(1) as cluster:
        client = cluster.client(set_as_default=False)
        try:
            static = [cluster.address_of(n) for n in cluster.worker_names(static=True)]
            elastic = [cluster.address_of(n) for n in cluster.worker_names(static=False)]
            futures = [client.submit(Sink, actor=True, workers=[a], pure=False) for a in static]
            sinks = [f.result() for f in futures]
            hosts = [get_address_host(str(a)) for a in static]
            measured = client.submit(
                _measure, sinks, hosts, shares, repeats, workers=elastic[:1], pure=False
            ).result()
        finally:
            client.close()
    return {
        "repeats": repeats,
        "bytes": {label: 4 * n for label, n in shares.items()},
        "ms": measured,
    }
