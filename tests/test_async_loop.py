"""Async mode in this process: a shard's apply (each batch id once, stale gradients refused), and the compute
loop's session against fake shards (the versions each gradient is tagged with, candidate steps, a refused
batch id trained again)."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any

import pytest
import torch

from prefect_elastic.data_server import DataServer, plan_shards
from prefect_elastic.errors import FatalError
from prefect_elastic.messages import Role
from prefect_elastic.training import prepare
from prefect_elastic.wire import Entry, Frame
from prefect_elastic.wire.signals import StaleGenerationError
from prefect_elastic.wire.step_messages import Applied, CurrentState

from .conftest import in_process_servers, make_job
from .test_async_bookkeeping import SCHEDULE

# -- the shard's apply, in this process -------------------------------------------------------------------


def gradient_of(server: DataServer, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, value) for n, p in server._params.items()}


def test_a_shard_applies_each_batch_id_once_and_refuses_stale_gradients(digits_url: str) -> None:
    servers, _ = in_process_servers(digits_url, mode="async", max_staleness=1)
    shard = servers[0]

    async def run() -> None:
        version, before = await shard.current(0)
        kept = {n: t.clone() for n, t in before.items()}
        assert version == 0
        grads = gradient_of(shard, 1.0)
        assert await shard.apply_one(0, "a", 5, 0, grads, {}, 1.0) == ("applied", 0)
        after = await shard.current(0)
        assert after[0] == 1
        assert any(not torch.equal(kept[n], after[1][n]) for n in kept), "the parameters moved"
        assert all(torch.equal(kept[n], before[n]) for n in kept), "what `current` gave out is a copy"
        assert await shard.apply_one(0, "b", 5, 1, grads, {}, 1.0) == ("duplicate", 0)
        assert (await shard.current(0))[0] == 1, "a duplicate is not applied"
        assert await shard.apply_one(0, "a", 6, 0, grads, {}, 1.0) == ("applied", 1)
        # Two versions on since version 0: above max_staleness=1, refused and not applied.
        assert await shard.apply_one(0, "a", 7, 0, grads, {}, 1.0) == ("stale", 2)
        assert (await shard.current(0))[0] == 2
        status = await shard.status(0)
        assert [(r.step, r.batch_ids, r.computed_on, r.staleness) for r in status.records] == [
            (0, (5,), 0, 0),
            (1, (6,), 0, 1),
        ]
        assert status.refused == 0, "a stale gradient is not a message of an old generation"
        assert (await shard.fence(1)).applied == (), "the applied ids only when asked for"
        with pytest.raises(StaleGenerationError):
            await shard.apply_one(0, "a", 8, 2, grads, {}, 1.0)
        # A rebuilt coordinator asks for the ids applied from its copy's first open one on, recorded or not.
        assert (await shard.fence(2, applied_from=6)).applied == (6,)
        assert (await shard.fence(3, since=1, applied_from=0)).applied == (5, 6)

    asyncio.run(run())


def test_a_sync_shard_refuses_an_async_gradient(digits_url: str) -> None:
    shard = in_process_servers(digits_url)[0][0]

    async def run() -> None:
        with pytest.raises(FatalError, match="async gradient in a sync job"):
            await shard.apply_one(0, "a", 0, 0, gradient_of(shard, 1.0), {}, 1.0)

    asyncio.run(run())


class FakeShard:
    """A shard for an `AsyncSession` in this process: applies what it gets at once (version + 1), records
    the version each gradient says it was computed on, and refuses the batch ids in `refuse` once."""

    def __init__(
        self, index: int, names: list[str], state: dict[str, torch.Tensor], refuse: set[int]
    ) -> None:
        self.index, self.names, self.state, self.refuse = index, names, state, refuse
        self.version = 0
        self.tags: list[tuple[int, int]] = []  # (batch id, computed_on) of every gradient applied

    def answer(self, frame: Frame) -> Frame:
        header = frame.header
        state = [(Entry("state", -1, n), self.state[n].clone()) for n in self.names]
        if header["op"] == "current":
            return CurrentState(self.version, self.index).frame(state)
        if header["op"] == "pull":
            b = header["then"]["batches"][0]
            return Frame(
                {"ok": True},
                [
                    (Entry("field", b, "x"), torch.randn(16, 64)),
                    (Entry("field", b, "y"), torch.tensor([b % 10] * 16)),
                ],
            )
        b = int(header["batch_id"])
        if b in self.refuse:
            self.refuse.discard(b)
            return Applied("stale", 99, self.index, self.version).frame(state)
        self.tags.append((b, int(header["computed_on"])))
        self.version += 1
        return Applied("applied", 0, self.index, self.version).frame(state)


class FakeLink:
    """A `ShardLink` to a `FakeShard`, which answers at once. Unless `in_time`, the answer to a gradient
    arrives only once the loop waits for it (`release`, which `run_session` sets when the loop blocks on
    its exchange with the shards): never while the loop computes the next gradient."""

    def __init__(self, shard: FakeShard, in_time: bool) -> None:
        self.shard, self.in_time = shard, in_time
        self.answers: list[tuple[Frame, bool]] = []  # (answer, whether it answers a gradient)
        self.address = ("fake", 0)
        self.release = threading.Event()

    @property
    def pending(self) -> int:
        return len(self.answers)

    def send(self, frame: Frame) -> None:
        self.answers.append((self.shard.answer(frame), frame.header["op"] == "apply"))

    def receive(self, timeout: float | None = None) -> Frame:
        answer, to_a_gradient = self.answers.pop(0)
        if to_a_gradient and not self.in_time:
            assert self.release.wait(timeout), "the loop never waited for the answer"
            self.release.clear()
        return answer

    def request(self, frame: Frame, timeout: float | None = None) -> Frame:
        self.send(frame)
        return self.receive(timeout)

    def close(self) -> None:
        self.answers.clear()

    def interrupt(self) -> None:
        self.release.set()


class Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class FakeCoordinator:
    def __init__(self, total: int) -> None:
        self.queue = list(range(total))
        self.renews: list[bool] = []

    def lease(self, worker: str, generation: int, count: int, renew: bool = False) -> Done:
        self.renews.append(renew)
        given, self.queue = self.queue[:count], self.queue[count:]
        return Done(given)

    def role(self, worker: str, generation: int) -> Done:
        return Done(Role(generation, -1, (), 0, stop=True))


def run_session(
    digits_url: str, in_time: bool, refuse: set[int] = frozenset(), min_shard_bytes: int = 0
) -> tuple[Any, ...]:
    from prefect_elastic.compute import AsyncSession, LoopStats, MicroBatchTrainer

    prepared = prepare(make_job(digits_url, "reassign", model="tests.models:mlp", mode="async"))
    plan = plan_shards(prepared.persistence.initial, 2, min_shard_bytes)
    trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, torch.device("cpu"))
    shards = [FakeShard(i, names, prepared.persistence.initial, set(refuse)) for i, names in enumerate(plan)]
    links = [FakeLink(shard, in_time) for shard in shards]
    data = [FakeLink(shard, True) for shard in shards]
    coordinator = FakeCoordinator(12)
    stats = LoopStats("w")
    role = Role(1, 0, ("w",), 0, channels=(("fake", 0), ("fake", 1)))
    session = AsyncSession(role, "w", coordinator, trainer, SCHEDULE, links, data, stats, 5.0)  # type: ignore[arg-type]
    compute, collect = trainer.gradient, session._collect

    def answered_while_computing(*args: Any) -> Any:
        out = compute(*args)
        if in_time and session.exchange is not None:
            futures.wait([session.exchange])  # the last gradient's answers came during this computation
        return out

    def answered_once_waited_for() -> None:
        for link in links:
            link.release.set()
        collect()

    trainer.gradient = answered_while_computing  # type: ignore[method-assign,assignment]
    session._collect = answered_once_waited_for  # type: ignore[method-assign]
    try:
        assert session.run(lambda: True) is True, "the session ends when the job is over"
    finally:
        session.close()
    return shards, stats, coordinator


def test_an_async_loop_tags_each_gradient_with_the_versions_its_model_came_from(digits_url: str) -> None:
    # Answers in time: the parameters of the previous gradient arrived while this one computed, so each
    # gradient is computed on the version before the last (one step behind), and no candidate step is
    # taken but the first (nothing can have arrived while the first gradient computed).
    shards, stats, coordinator = run_session(digits_url, in_time=True)
    for shard in shards:
        assert [b for b, _ in shard.tags] == list(range(12))
        assert [v for _, v in shard.tags] == [0, *range(11)]
    assert stats.candidate_steps == 1
    assert coordinator.renews[0] is True and not any(coordinator.renews[1:]), "the first lease renews"
    # Answers late: every step is a candidate step, and a gradient computed on a candidate is tagged
    # with the version its parameters came from (not the one read just before sending it).
    shards, stats, _ = run_session(digits_url, in_time=False)
    for shard in shards:
        assert [v for _, v in shard.tags] == [0, *range(11)]
    assert stats.candidate_steps == 12


def test_an_async_loop_tags_its_gradients_with_the_version_of_a_shard_that_holds_no_parameters(
    digits_url: str,
) -> None:
    # A small model's parameters live on the last shard alone (`plan_shards`): the first one's answers
    # carry a version and no tensors, and gradients are tagged with that version all the same (tagged
    # with 0 for ever, they were refused as stale once the shard had applied `max_staleness` of them).
    shards, stats, _ = run_session(digits_url, in_time=True, min_shard_bytes=1 << 40)
    assert [bool(shard.names) for shard in shards] == [False, True]
    for shard in shards:
        assert [b for b, _ in shard.tags] == list(range(12))
        assert [v for _, v in shard.tags] == [0, *range(11)]
    assert stats.steps == 12 and stats.refused == 0


def test_an_async_loop_trains_a_refused_batch_id_again(digits_url: str) -> None:
    shards, stats, _ = run_session(digits_url, in_time=True, refuse={3})
    for shard in shards:
        ids = [b for b, _ in shard.tags]
        assert sorted(ids) == list(range(12)) and ids.count(3) == 1, "applied once, after the refusal"
    assert stats.refused == 2, "refused by both shards"
    assert stats.steps == 12
