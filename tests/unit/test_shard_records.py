"""The pure parts of a data server's apply (`data_server/records.py`), its hooks' dispatch and the choice
of its mode, without a cluster: what a push or a gradient becomes at a shard's position, the open step in
batch-id order, the records kept for the ledger, and which copies of a peer's snapshots are kept."""

from __future__ import annotations

import asyncio

import torch

from prefect_elastic.data_server import NoHooks, ServerHooks
from prefect_elastic.data_server.hooks import PluginHooks, hooks_of_this_worker
from prefect_elastic.data_server.records import (
    OpenStep,
    StepRecords,
    async_verdict,
    push_refusal,
    replicas_kept_async,
    replicas_kept_sync,
)
from prefect_elastic.local import slow
from prefect_elastic.messages import StepRecord


def record(step: int) -> StepRecord:
    return StepRecord(step, 0, (step,), {step: "w"}, {step: 0.5}, 0.0)


def test_a_push_goes_in_only_for_the_open_step_or_later_ones_at_a_shard_without_state() -> None:
    assert push_refusal(1, step=3, version=3, applying=False, stateless=False) is None
    assert push_refusal(1, 2, 3, False, False) == "push for step 2, but shard 1 is at step 3", "too late"
    assert push_refusal(1, 3, 3, True, False) is not None, "the step is being applied"
    assert push_refusal(1, 4, 3, False, False) is not None, "a shard with state never gets ahead"
    assert push_refusal(1, 4, 3, False, True) is None, "one without state keeps it for later"
    assert push_refusal(1, 2, 3, False, True) is not None


def test_an_async_gradient_is_applied_once_and_never_staler_than_allowed() -> None:
    assert async_verdict(7, computed_on=4, version=5, applied={1}, max_staleness=1) == (None, 1)
    assert async_verdict(1, 4, 5, {1}, 1) == ("duplicate", 1), "a batch id applied already"
    assert async_verdict(7, 3, 5, {1}, 1) == ("stale", 2)
    assert async_verdict(7, 6, 5, set(), 3) == ("stale", -1), "computed on a version the shard never had"
    assert async_verdict(7, 5, 5, frozenset(), 0) == (None, 0)


def test_the_open_step_gives_its_gradients_in_batch_id_order_whatever_order_they_came_in() -> None:
    opened = OpenStep()
    assert not opened.complete(2)
    for batch_id, worker in ((5, "b"), (4, "a")):
        opened.take(batch_id, worker, {"w": torch.full((2,), float(batch_id))}, {}, batch_id / 10)
    assert opened.complete(2) and not opened.complete(3)
    ids, grads, buffers = opened.in_order()
    assert ids == [4, 5] and [g["w"][0].item() for g in grads] == [4.0, 5.0] and buffers == [{}, {}]
    assert opened.record(2, 7, 1.5) == StepRecord(2, 7, (4, 5), {4: "a", 5: "b"}, {4: 0.4, 5: 0.5}, 1.5)


def test_records_are_read_from_a_step_on_and_dropped_before_or_from_one() -> None:
    records = StepRecords()
    for step in range(6):
        records.add(record(step))
    assert [r.step for r in records.since(4)] == [4, 5]
    assert [r.step for r in records.since(9)] == []
    records.drop_before(2)  # the controller's copy holds steps 0 and 1
    assert [r.step for r in records.since(0)] == [2, 3, 4, 5]
    records.drop_from(4)  # a restore to version 4
    assert [r.step for r in records.since(0)] == [2, 3] and len(records) == 2
    records.clear()
    assert len(records) == 0


def test_a_sync_peer_keeps_the_copy_every_shard_goes_back_to_and_the_two_newest_after_it() -> None:
    assert replicas_kept_sync([0, 1, 2, 3, 4, 5], keep=0) == {0, 4, 5}
    assert replicas_kept_sync([0, 4, 5], keep=4) == {4, 5}
    assert replicas_kept_sync([3, 4], keep=0) == {3, 4}, "the one to keep may not have come yet"
    assert replicas_kept_sync([2, 3], keep=6) == set(), "older than the one every shard holds"


def test_an_async_peer_keeps_the_two_newest_copies_whatever_keep_says() -> None:
    # (Every async shard snapshots at its own version: the peer's versions and its `keep` are unrelated.)
    assert replicas_kept_async([7, 1, 9, 3], keep=1) == {7, 9}
    assert replicas_kept_async([2], keep=0) == {2}


class Calls(NoHooks):
    """Hooks that note each call (the four a data server makes), overriding two of `NoHooks`'."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_start(self) -> None:
        self.calls.append("start")

    async def on_hold(self) -> None:
        self.calls.append("hold")


def test_a_data_server_calls_the_hooks_of_every_plugin_of_its_worker_even_one_registered_later() -> None:
    calls: list[str] = []
    plugins: dict[str, object] = {"other": object(), "straggler": slow.Straggler("w", 2.0)}
    hooks = PluginHooks(plugins)
    hooks.on_start()
    assert calls == [], "plugins that are not hooks are passed over"
    plugins["calls"] = Calls(calls)  # (a worker's plugins, registered while its data server runs)
    assert isinstance(plugins["calls"], ServerHooks) and not isinstance(plugins["straggler"], ServerHooks)
    hooks.on_start()
    hooks.on_fence()
    asyncio.run(hooks.on_hold())
    asyncio.run(hooks.before_apply())
    assert calls == ["start", "hold"]


def test_the_rehearsal_plugins_are_hooks_that_act_only_where_armed() -> None:
    for plugin in (slow.SlowShards(0.0), slow.SlowHandOver("w", 1.0), slow.SlowStart("w", 1.0)):
        assert isinstance(plugin, ServerHooks)
    death = slow.DeathAtFence("somewhere-else")
    assert death.seconds == 0.0, "armed only by `setup` on the worker it names"
    death.on_fence()  # (unarmed: this process lives on)
    assert isinstance(hooks_of_this_worker(), NoHooks), "outside a worker: none"
