"""Sync and async mode, chosen once (`prefect_elastic.modes`): each role is handed its mode's part, and an
unknown mode is refused naming it."""

from __future__ import annotations

import pytest

from prefect_elastic.checkpoint.cadence import AsyncCheckpoints, SyncCheckpoints
from prefect_elastic.compute import AsyncLoop, SyncLoop
from prefect_elastic.coordinator import AsyncLeases
from prefect_elastic.coordinator import SyncCommits as SyncBook
from prefect_elastic.data_server import AsyncApplies, SyncApplies
from prefect_elastic.errors import JobConfigError
from prefect_elastic.job import ElasticJob
from prefect_elastic.modes import ASYNC, SYNC, mode_of, mode_of_job


def test_each_mode_hands_every_role_its_part() -> None:
    assert mode_of("sync") is SYNC and mode_of("async") is ASYNC
    assert (SYNC.commits, SYNC.applies, SYNC.loop, type(SYNC.checkpoints)) == (
        SyncBook,
        SyncApplies,
        SyncLoop(),
        SyncCheckpoints,
    )
    assert (ASYNC.commits, ASYNC.applies, ASYNC.loop, type(ASYNC.checkpoints)) == (
        AsyncLeases,
        AsyncApplies,
        AsyncLoop(),
        AsyncCheckpoints,
    )
    with pytest.raises(JobConfigError, match=r"mode='lockstep': give one of \['async', 'sync'\]"):
        mode_of("lockstep")


def test_the_controllers_own_decisions_differ_as_the_modes_do() -> None:
    assert SYNC.batch_ids_per_step(4) == 4 and ASYNC.batch_ids_per_step(4) == 1
    # Async mode snapshots every `checkpoint_every` checks where a checkpoint or a replica needs one.
    assert ASYNC.snapshot_every_checks(5, checkpointed=True, replicas=False) == 5
    assert ASYNC.snapshot_every_checks(5, checkpointed=False, replicas=True) == 5
    assert ASYNC.snapshot_every_checks(5, checkpointed=False, replicas=False) == 0
    assert SYNC.snapshot_every_checks(5, checkpointed=True, replicas=True) == 0
    assert ASYNC.shards_apart and not SYNC.shards_apart
    assert ASYNC.coordinator_kept_while_silent and not SYNC.coordinator_kept_while_silent


def test_gradients_in_parts_are_refused_in_async_mode_naming_the_setting() -> None:
    sync = ElasticJob(model="tests.models:mlp", dataset="file:///x.npz", overlap_push=True)
    assert mode_of_job(sync) is SYNC
    assert mode_of_job(sync.model_copy(update={"overlap_push": False, "mode": "async"})) is ASYNC
    with pytest.raises(JobConfigError, match=r"overlap_push=True: .*sync mode only.*set mode='sync'"):
        mode_of_job(sync.model_copy(update={"mode": "async"}))


def test_parameters_in_buckets_are_refused_in_async_mode_and_without_the_buckets_of_the_push() -> None:
    sync = ElasticJob(model="tests.models:mlp", dataset="file:///x.npz", overlap_pull=True)
    assert mode_of_job(sync) is SYNC  # (overlap_push None: the engine plans the buckets)
    with pytest.raises(JobConfigError, match=r"overlap_pull=True: .*sync mode only.*set mode='sync'"):
        mode_of_job(sync.model_copy(update={"mode": "async"}))
    with pytest.raises(JobConfigError, match=r"overlap_pull=True: .*leave overlap_push on"):
        mode_of_job(sync.model_copy(update={"overlap_push": False}))
