"""A shard's parameters read in place by a loop on its machine (`wire/published.py`), on real sockets and real
memfds: after one answer that teaches the loop the region, the parameters come as views of the shard's own
memory, bitwise what it holds, with no bytes on the wire; only entries of kind `params` go so (async mode's
`state` is a copy); a loop that cannot map the region keeps getting the bytes; and only the peer's own
sealed region is ever mapped."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from prefect_elastic import ElasticJob
from prefect_elastic.compute import MicroBatchTrainer
from prefect_elastic.data_server.optimizer import ShardOptimizer
from prefect_elastic.messages import Role
from prefect_elastic.training import prepare
from prefect_elastic.wire import Entry, Frame, ShardLink, decode, encode, memfd, published
from prefect_elastic.wire.inbox import Inbox, SharedBodies
from prefect_elastic.wire.published import Published, flat_tensor, map_peers

from ..conftest import in_process_servers, make_job
from .test_channel import Served
from .test_shard_optimizer import OPTIMIZERS, model_spec


class Shard:
    """A shard's flat parameters (in a published region) served to pulls, as `DataServer.on_frame` does."""

    def __init__(self) -> None:
        parts = [torch.randn(300, 200, generator=torch.Generator().manual_seed(0)), torch.arange(7.0)]
        self.flat, self.region = flat_tensor(parts, torch.float32)
        self.served = Served(self.handler)

    async def handler(self, frame: Frame) -> Frame:
        kind = frame.header["op"]  # "params" as a sync pull answers, "state" as async mode answers
        return Frame({"ok": True}, [(Entry(kind, -1, ""), self.flat), (Entry("x", 1, ""), torch.ones(3))])


@pytest.fixture
def shard() -> Iterator[Shard]:
    served = Shard()
    yield served
    served.served.close()


def pull(link: ShardLink, kind: str = "params") -> torch.Tensor:
    answer = link.request(Frame({"op": kind, "generation": 1}))
    assert torch.equal(answer.tensors[1][1], torch.ones(3))
    return answer.tensors[0][1]


def test_the_parameters_are_read_in_place_once_the_loop_has_mapped_the_region(shard: Shard) -> None:
    link = ShardLink(shard.served.address, timeout=5)
    try:
        first = pull(link)  # bytes, and the region named: the loop maps it and says so in its next frame
        assert link.local and torch.equal(first, shard.flat)
        assert shard.served.server.bodies.get("referenced", 0) == 0
        views = [pull(link) for _ in range(3)]
        assert shard.served.server.bodies["referenced"] == 3
        for view in views:
            assert torch.equal(view, shard.flat)
        # In place: what the shard writes (when it applies the next step) is what the loop reads next.
        shard.flat[5] = 12345.0
        assert views[0][5] == 12345.0
    finally:
        link.close()


def test_async_state_is_never_read_in_place(shard: Shard) -> None:
    """An async shard applies while loops compute: its answers (`state`) are copies, even of memory
    that a sync answer would have sent in place."""
    link = ShardLink(shard.served.address, timeout=5)
    try:
        pull(link)
        state = [pull(link, "state") for _ in range(3)]
        shard.flat[0] = -1.0
        assert all(t[0] != -1.0 for t in state)
        assert shard.served.server.bodies.get("referenced", 0) == 0
    finally:
        link.close()


def test_a_loop_that_cannot_map_the_region_keeps_getting_the_bytes(
    shard: Shard, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = ShardLink(shard.served.address, timeout=5)
    refused: list[object] = []

    def cannot(advert: object, peer: int) -> None:
        refused.append(advert)

    monkeypatch.setattr(published, "map_peers", cannot)
    try:
        got = [pull(link) for _ in range(4)]
        assert all(torch.equal(t, shard.flat) for t in got)
        shard.flat[1] = 99.0
        assert all(t[1] != 99.0 for t in got)
        assert shard.served.server.bodies.get("referenced", 0) == 0
        assert len(refused) == 1  # (tried once per region, not at every answer)
    finally:
        link.close()


def test_with_shared_memory_off_the_parameters_are_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memfd.ENV, "0")
    flat, region = flat_tensor([torch.ones(4, 4)], torch.float32)
    assert region is None and torch.equal(flat, torch.ones(16))
    sender = SharedBodies(os.getpid())
    assert sender.reference(flat) is None


def test_a_shards_optimizer_keeps_its_parameters_in_a_published_region_and_steps_them_there() -> None:
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    optimizer = ShardOptimizer(model_spec(OPTIMIZERS[0]), params)
    assert optimizer.region is not None and optimizer.flat is not None
    found = published.region_of(optimizer.params["b"])
    assert found == (optimizer.region, 15 * 4)
    before = optimizer.flat.clone()
    optimizer.step([torch.ones(18)])
    assert not torch.equal(optimizer.flat, before)
    assert published.region_of(optimizer.flat) == (optimizer.region, 0)  # stepped in place
    assert published.region_of(torch.ones(18)) is None


def test_a_region_is_mapped_only_where_it_is_the_peers_own_sealed_one() -> None:
    region, other = Published(4096), Published(4096)
    box = Inbox(1 << 20)
    try:
        me = os.getpid()
        pid, fd, size, token = region.advert()
        mapped = map_peers([pid, fd, size, token], me)
        assert mapped is not None and mapped[0] == region.key
        region.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert mapped[1][:4].tolist() == [1, 2, 3, 4]
        assert map_peers([pid, fd, size, token], me + 1) is None  # not the peer's pid
        assert map_peers([pid, fd, size, token], 0) is None  # a peer in another pid namespace
        assert map_peers([pid, other.fd, size, token], me) is None  # another region: not its token
        assert map_peers([pid, fd, size + 4096, token], me) is None  # not the size it claims
        assert map_peers([pid, box.fd, size, box.token.hex()], me) is None  # an inbox: not this name
        assert map_peers(["?"], me) is None
    finally:
        box.close()


def test_a_reference_to_memory_the_receiver_has_not_mapped_is_refused() -> None:
    region = Published(64)
    flat = region.data.view(torch.float32)
    sender, receiver = SharedBodies(os.getpid()), SharedBodies(os.getpid())
    try:
        sender._peer_reads.add(region.key)  # (as if the receiver had said it maps it)
        parts = encode(Frame({}, [(Entry("params", -1, ""), flat)]), sender)
        header = bytes(parts[0])[4:]
        with pytest.raises(ValueError, match="has not mapped"):
            decode(header, bytearray(), receiver.region)
    finally:
        sender.close()
        receiver.close()


def test_a_loop_fetching_a_step_again_gets_a_copy_and_its_pipelined_pulls_read_in_place(
    digits_url: str,
) -> None:
    """`fetch` asks for a copy: a loop fetches a step it may have pushed in part (one shard took its frame,
    another's failed), and the shard that holds its batch ids may apply the step while the loop computes
    it again for the other."""
    default = ElasticJob.model_fields["min_shard_bytes"].default
    servers, plan = in_process_servers(digits_url, min_shard_bytes=default)
    prepared = prepare(make_job(digits_url, "reassign", model="tests.models:mlp"))
    trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, torch.device("cpu"))
    served = [Served(server.on_frame) for server in servers]
    links = [ShardLink(s.address, timeout=5) for s in served]
    holder = servers[1]._optimizer
    assert holder is not None and holder.flat is not None and holder.region is not None
    role = Role(0, 0, ("w",), 0, channels=tuple(s.address for s in served))
    name = plan[1][0]
    try:
        for _ in range(3):
            state, _ = trainer.fetch(role, 0, links, prepared.schedule).unpack(trainer.shapes)
            assert torch.equal(state[name], holder.params[name])
            before = state[name].clone()
            holder.flat.add_(1.0)
            assert torch.equal(state[name], before), "a copy: the shard's writes do not reach it"
        pull = {"step": 0, "wait": 0.0, "batches": []}
        links[1].request(Frame({"op": "pull", "generation": 0, "then": pull}))  # (teaches the region)
        answer = links[1].request(Frame({"op": "pull", "generation": 0, "then": pull}))
        flat = answer.tensors[0][1]
        holder.flat.add_(1.0)
        assert torch.equal(flat, holder.flat), "read in place: the shard's writes reach it"
        assert served[1].server.bodies["referenced"] == 1
    finally:
        for link in links:
            link.close()
        for s in served:
            s.close()
