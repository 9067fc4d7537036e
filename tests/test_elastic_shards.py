"""A data server's pushes and fences, in this process: a stateless one keeps a push that overtook another
worker's, a fence and a status carry the records from the step asked for, and a fence waits for a step
being applied in a thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from prefect_elastic import ElasticJob
from prefect_elastic.wire.signals import RecoverableError

from .conftest import in_process_servers

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_a_stateless_data_server_keeps_a_push_that_overtook_another_workers(digits_url: str) -> None:
    """A loop does not wait for a stateless data server's answer to its push (`MicroBatchTrainer.step`), so
    its push of the next step can reach that server before another worker's push of this one: the server
    keeps it and applies both steps in order. A fence drops what it kept; a data server that holds state
    refuses a push ahead of its version, which no loop can send."""
    default = ElasticJob.model_fields["min_shard_bytes"].default
    (free, holder), plan = in_process_servers(digits_url, min_shard_bytes=default)
    assert plan[0] == [] and free.stateless and not holder.stateless
    step0, step1 = (free._schedule.step_batches(s) for s in (0, 1))

    def half(ids: Any, lower: bool) -> dict[int, float]:
        return {b: float(b) for b in (ids[:2] if lower else ids[2:])}

    async def overtaken() -> None:
        await free.push(0, 0, "a", {}, {}, half(step0, True))
        await free.push(0, 1, "a", {}, {}, half(step1, True))  # a's next push, before b's of step 0
        assert free.version == 0
        await free.push(0, 0, "b", {}, {}, half(step0, False))
        assert free.version == 1, "step 0 applied, step 1 open with a's half in it"
        await free.push(0, 1, "b", {}, {}, half(step1, False))
        assert free.version == 2
        records = {r.step: r for r in (await free.status(0)).records}
        assert [records[s].batch_ids for s in (0, 1)] == [tuple(sorted(step0)), tuple(sorted(step1))]
        assert records[1].workers == {**dict.fromkeys(step1[:2], "a"), **dict.fromkeys(step1[2:], "b")}
        # Kept pushes of a generation that a fence ended are dropped with it.
        await free.push(0, 3, "a", {}, {}, half(free._schedule.step_batches(3), True))
        await free.fence(1)
        await free.push(1, 2, "a", {}, {}, half(free._schedule.step_batches(2), True))
        await free.push(1, 2, "b", {}, {}, half(free._schedule.step_batches(2), False))
        assert free.version == 3 and not free.applies._later  # type: ignore[attr-defined]
        with pytest.raises(RecoverableError, match="push for step 1, but shard 1 is at step 0"):
            await holder.push(0, 1, "a", {}, {}, half(step1, True))

    asyncio.run(overtaken())


def test_a_fence_and_a_status_carry_the_records_from_the_step_asked_for(digits_url: str) -> None:
    """The coordinator asks for the records of the steps it has not committed (a long run holds one per
    step: all of them on every fence would be megabytes on the path of every recovery), and has the
    shard drop those of the steps the controller's copy of the record holds."""
    (free, _), _ = in_process_servers(
        digits_url, min_shard_bytes=ElasticJob.model_fields["min_shard_bytes"].default
    )

    async def three_steps_then_fences() -> None:
        for step in range(3):
            await free.push(0, step, "a", {}, {}, {b: float(b) for b in free._schedule.step_batches(step)})
        assert [r.step for r in (await free.status(1)).records] == [1, 2]
        assert [r.step for r in (await free.fence(1, 2)).records] == [2]
        assert [r.step for r in (await free.fence(2)).records] == [0, 1, 2]
        assert (await free.fence(3, 3)).records == ()
        # Steps the controller's copy holds: their records go, for good (a long run holds one per step);
        # not at the word of a coordinator of an older generation (its successor may need them).
        assert [r.step for r in (await free.status(0, keep_from=2, generation=2)).records] == [0, 1, 2]
        assert [r.step for r in (await free.status(1, keep_from=2, generation=3)).records] == [2]
        assert [r.step for r in (await free.fence(4)).records] == [2]

    asyncio.run(three_steps_then_fences())


def test_a_fence_waits_for_a_step_being_applied_in_a_thread(digits_url: str) -> None:
    """A shard too big to apply a step on its event loop applies it in a thread; a fence that comes
    meanwhile answers once the step is applied, with the version after it, so that no restore copies a
    snapshot into tensors the thread is still changing and the version does not move after the answer."""
    server = in_process_servers(digits_url)[0][0]
    ids = server._schedule.step_batches(0)
    grads = {b: {n: torch.ones_like(p) for n, p in server._params.items()} for b in ids}
    server.shard.apply_inline = False  # (as for a big shard)
    applying = server.shard.apply

    started, release = threading.Event(), threading.Event()

    def slow(*args: Any) -> None:
        started.set()
        release.wait(10)
        applying(*args)

    server.shard.apply = slow  # type: ignore[method-assign]

    async def fenced_mid_apply() -> None:
        push = asyncio.ensure_future(server.push(0, 0, "a", grads, {}, {b: 1.0 for b in ids}))
        assert await asyncio.to_thread(started.wait, 10), "the step is being applied in its thread"
        fence = asyncio.ensure_future(server.fence(1))
        await asyncio.sleep(0)  # (the fence runs up to its wait)
        assert not fence.done() and server.shard.applying
        release.set()
        status = await fence
        assert (status.version, server.version, server.shard.applying) == (1, 1, False)
        await push

    asyncio.run(fenced_mid_apply())
