"""Peer replicas on data servers in this process, without a cluster: a snapshot counts only once
its copy is whole on the peer, the peer keeps the one a promotion goes back to, and a data server started
empty takes its shard from the peer's copy, bit for bit."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
import torch

from prefect_elastic.data_server import DataServer, join_tensors, split_tensors
from prefect_elastic.errors import FatalError
from prefect_elastic.training import prepare
from prefect_elastic.training.workers import standbys
from prefect_elastic.wire.signals import StaleGenerationError

from ..conftest import in_process_servers, make_job


def servers(digits_url: str, **overrides: Any) -> tuple[DataServer, DataServer, list[list[str]]]:
    (first, second), plan = in_process_servers(digits_url, **overrides)
    return first, second, plan


async def settled() -> None:
    """Let the copies sent in the background arrive (they are tasks on this event loop)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_snapshot_is_reported_only_once_its_copy_is_whole_on_the_peer(digits_url: str) -> None:
    first, second, _ = servers(digits_url)

    async def run() -> None:
        assert [s.version for s in (await first.status(0)).snapshots] == [], "no peer named yet"
        await first.set_peer(0, second)
        await settled()
        assert [s.version for s in (await first.status(0)).snapshots] == [0]
        copy = await second.replica(0, 0)
        assert all(torch.equal(copy["params"][n], t) for n, t in first._params.items())

    asyncio.run(run())


def test_a_data_server_started_empty_takes_its_shard_from_the_peer_bit_for_bit(digits_url: str) -> None:
    first, second, plan = servers(digits_url)
    schedule = first._schedule

    async def run() -> None:
        # A snapshot with the optimizer's state in it (Adam's moments exist from the first step on).
        assert first.shard.optimizer is not None
        first.shard.optimizer.step([{n: torch.full_like(p, 0.5) for n, p in first._params.items()}])
        first.shard.snapshots[0] = first.shard.copy_state()
        await first.set_peer(0, second)
        await settled()
        with torch.no_grad():  # the shard moved on after its snapshot: the replica is of the snapshot
            for p in first._params.values():
                p.add_(1.0)
        # (The job `servers` made them for.)
        prepared = prepare(make_job(digits_url, "reassign", model="tests.models:mlp"))
        spec = prepared.specs.shard
        empty = DataServer(0, spec, prepared.batches, schedule, {}, {}, None, 0, mode=prepared.mode.applies)
        assert not empty._params
        assert await empty.adopt(second, 0) == 0
        snapshot = first.shard.snapshots[0]
        assert set(empty._params) == set(snapshot.params) == set(plan[0]) & set(first._params)
        assert all(torch.equal(empty._params[n], t) for n, t in snapshot.params.items())
        assert not any(torch.equal(empty._params[n], t) for n, t in first._params.items())
        assert empty.shard.optimizer is not None, "the optimizer is built for the adopted parameters"
        # The tensors came over the peer's channel as one frame: the flat parameters and each of Adam's
        # moments, flat too, are views of that frame's one buffer, not copies of it.
        flat = empty.shard.optimizer._flat
        assert flat is not None
        (moments,) = empty.shard.optimizer._optimizer.state.values()
        for key in ("exp_avg", "exp_avg_sq"):
            assert moments[key].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), key
        taken, held = empty.shard.optimizer.state_dict()["state"], snapshot.optimizer["state"]
        assert taken.keys() == held.keys() and taken
        for i in held:
            assert held[i].keys() == taken[i].keys()
            assert all(torch.equal(taken[i][key], value) for key, value in held[i].items())

    asyncio.run(run())


def test_the_peer_keeps_the_snapshot_every_shard_holds_and_the_two_newest(digits_url: str) -> None:
    _, second, _ = servers(digits_url)

    async def run() -> None:
        for version in range(6):
            await second.hold_replica(
                0, 0, {"version": version, "params": {}, "buffers": {}, "optimizer": {}}
            )
        assert second.replicas.keep == 0
        assert sorted(second.replicas.held) == [0, 4, 5]
        second.replicas.keep = 4  # as a snapshot_at(..., keep=4) sets it
        second.replicas.prune()
        assert sorted(second.replicas.held) == [4, 5]
        with pytest.raises(FatalError, match="holds no replica of shard 0 at version 2"):
            await second.replica(0, 2)

    asyncio.run(run())


def test_a_replica_from_a_shard_that_is_not_its_peers_or_of_an_old_generation_is_refused(
    digits_url: str,
) -> None:
    first, second, _ = servers(digits_url)

    async def run() -> None:
        with pytest.raises(FatalError, match="not its peer's"):
            await first.hold_replica(0, 0, {"version": 1})
        await second.fence(3)
        with pytest.raises(StaleGenerationError):
            await second.hold_replica(2, 0, {"version": 1})
        with pytest.raises(StaleGenerationError):
            await second.set_peer(2, first)

    asyncio.run(run())


def test_without_peer_replicas_snapshots_count_at_once_and_no_copy_is_sent(digits_url: str) -> None:
    first, second, _ = servers(digits_url, peer_replicas=False)

    async def run() -> None:
        await first.set_peer(0, second)
        await settled()
        assert [s.version for s in (await first.status(0)).snapshots] == [0]
        assert second.replicas.held == {}

    asyncio.run(run())


def test_standbys_are_the_static_workers_that_hold_no_data_server() -> None:
    assert standbys(("a", "b", "c", "d"), ["b", "a"]) == ("c", "d")
    assert standbys(("a", "b"), ["a", "b"]) == ()


def test_a_replica_travels_as_its_tensors_and_an_outline_that_puts_them_back() -> None:
    """What a standby reads of a replica: the tensors in one frame, the rest (int keys, tuples, settings)
    as an outline with their places."""
    replica = {
        "version": 3,
        "params": {"w": torch.arange(6.0).reshape(2, 3)},
        "buffers": {},
        "optimizer": {
            "state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(2, 3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "applied": [1, 2],
    }
    outline, placed = split_tensors(replica)
    assert len(placed) == 3 and not any(isinstance(v, torch.Tensor) for v in _leaves(outline))
    # The optimizer's state goes after the parameters, key by key (each key one run in the frame).
    assert [place for place, _ in placed] == [0, 2, 1]
    back = join_tensors(outline, {place: t.clone() for place, t in placed})
    assert back["optimizer"]["param_groups"] == replica["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert list(back["optimizer"]["state"]) == [0]
    assert torch.equal(back["params"]["w"], replica["params"]["w"])
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.ones(2, 3))
    assert back["applied"] == [1, 2] and back["version"] == 3


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def test_a_released_data_server_is_freed_at_once(digits_url: str) -> None:
    """No reference cycle through a data server's parts: a released actor (its job ended) frees its data
    partition and tensors, and stops listening, without waiting for a full collection, which may never
    come (startup objects are frozen, `freeze_startup_objects`)."""
    first, second, _ = servers(digits_url)

    async def run(shard: DataServer) -> None:
        await shard.set_peer(0, second)
        await settled()
        await shard.snapshot_at(0, 0, 0)

    asyncio.run(run(first))
    gone = [weakref.ref(first), weakref.ref(first.shard), weakref.ref(first.replicas)]
    gc.disable()
    try:
        del first
        assert [ref() for ref in gone] == [None, None, None]
    finally:
        gc.enable()


def test_a_second_ask_for_a_snapshot_being_copied_waits_for_that_copy(digits_url: str) -> None:
    """Two copies of one version at once: the first to end said none ran any more, and a commit could then
    re-point the parameters (`OtherCopy.flip`) under the second (`ShardState.start_snapshot`)."""
    first, _, _ = servers(digits_url)
    shard = first.shard

    async def run() -> None:
        shard.start_snapshot()
        running = shard.snapshotting
        shard.start_snapshot()  # (asked again before the first ended)
        assert shard.snapshotting is running
        await shard.snapshot_taken()
        assert shard.snapshotting is None and shard.version in shard.snapshots

    asyncio.run(run())


def test_a_step_back_forgets_the_marks_of_the_snapshots_it_dropped(digits_url: str) -> None:
    """A shard that steps back drops its snapshots after the version, and their copies' marks: a snapshot
    of that version taken again counts only once its own copy is on the peer."""
    first, second, _ = servers(digits_url)

    async def run() -> None:
        await first.set_peer(0, second)
        await settled()
        first.shard.copies.restored(1)  # (as if its snapshot of 1 were restored)
        first.shard.snapshots[1] = first.shard.copy_state()
        first.replicas.replicate(first.shard.snapshots[1])
        await settled()
        assert 1 in first.replicas.replicated
        del first.shard.snapshots[1]  # (as `ShardState.step_back` drops it)
        first.replicas.stepped_back(0)
        assert 1 not in first.replicas.replicated
        first.shard.snapshots[1] = first.shard.copy_state()  # taken again, not copied yet
        assert not first.replicas.counts(1)

    asyncio.run(run())
