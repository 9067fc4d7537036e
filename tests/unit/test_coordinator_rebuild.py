"""A coordinator rebuilt on another static worker (`CoordinatorState.rebuild`), without any cluster: the
controller's copy of the record (`Journal`, taken part by part) and what the shards still hold are enough
to go on with the same ledger, whether the shards stand at one version, at two, or one of them died with
the coordinator."""

from __future__ import annotations

import math

import pytest

from prefect_elastic.coordinator import CoordinatorSpec, CoordinatorState
from prefect_elastic.coordinator.survival import Policy, survival_check
from prefect_elastic.errors import DataServerLostError
from prefect_elastic.messages import EventKind, Journal, ShardStatus, SnapshotInfo, StepRecord
from prefect_elastic.schedule import Schedule

# 2 data servers of 64 samples, batches of 8, 4 micro-batches a step: 4 steps an epoch, 12 in all.
SCHEDULE = Schedule((64, 64), batch_size=8, micro_batches=4, epochs=3, seed=0)


def new_state(shards: int = 2) -> CoordinatorState:
    return CoordinatorState(CoordinatorSpec("job", SCHEDULE, shards, Policy.REASSIGN, 1, 10.0))


def record(step: int, generation: int = 1) -> StepRecord:
    ids = tuple(SCHEDULE.step_batches(step))
    return StepRecord(
        step, generation, ids, dict.fromkeys(ids, "a"), {b: float(b) for b in ids}, 100.0 + step
    )


def status(
    index: int,
    version: int,
    generation: int = 1,
    snapshots: tuple[int, ...] = (0,),
    replicas: tuple[int, ...] = (),
    since: int = 0,
    applied_in: int | None = None,
) -> ShardStatus:
    """Shard `index`'s answer in `generation`, with records of the steps it applied (in `applied_in`)."""
    return ShardStatus(
        index=index,
        generation=generation,
        version=version,
        records=tuple(record(s, applied_in or generation) for s in range(since, version)),
        snapshots=tuple(SnapshotInfo(v, 50.0 + v, 0.01) for v in snapshots),
        pending=0,
        refused=0,
        replicas=replicas,
    )


def admit(state: CoordinatorState, workers: set[str], versions: tuple[int, ...]) -> None:
    decision = survival_check(state.survival_state(), workers, now=1.0)
    fenced = [status(i, v, decision.generation, since=state.committed_steps) for i, v in enumerate(versions)]
    plan = state.reconcile(decision, fenced)
    state.change_membership(decision, plan, fenced, "test", now=2.0, began=1.5)
    state.after_decision(decision, now=2.0, began=1.5)


def run_to(state: CoordinatorState, version: int, snapshot: int | None = None) -> None:
    """Both shards apply steps up to `version` (and hold a snapshot of `snapshot`, confirmed)."""
    if snapshot is not None:
        state.snapshot_wanted = snapshot
    held = (0,) if snapshot is None else (0, snapshot)
    for i in range(2):
        state.absorb(status(i, version, state.generation, held, since=state.committed_steps))


def copy_of(state: CoordinatorState, journal: Journal | None = None) -> Journal:
    journal = journal or Journal()
    journal.extend(state.journal(journal.committed_steps, len(journal.events)))
    return journal


def rebuilt(journal: Journal, fenced: list[ShardStatus], lost: tuple[int, ...] = ()) -> CoordinatorState:
    state = new_state()
    state.channels = (("10.0.0.1", 9000), ("10.0.0.2", 9000))
    event = state.rebuild(
        journal, fenced, lost, 9, "static-b", "its static worker left", now=20.0, began=19.5
    )
    assert event.kind is EventKind.COORDINATOR_REBUILT and event.generation == 9
    assert state.events[-1] == event and state.counters["coordinator_rebuilds"] == 1
    return state


def test_the_copy_follows_the_record_part_by_part_and_through_a_rollback() -> None:
    state = new_state()
    admit(state, {"a"}, (0, 0))
    journal = copy_of(state)
    run_to(state, 3, snapshot=2)
    copy_of(state, journal)
    assert journal.committed_steps == 3 and journal.entries == state.ledger.entries_from(0)
    assert journal.history == state.history and len(journal.events) == len(state.events)
    part = state.journal(journal.committed_steps, len(journal.events))
    assert part.entries == [] and part.base_step == 3, "a part holds only what the copy lacks"
    # A rollback to the snapshot of step 2, then steps 2..4 trained again by another worker.
    admit(state, {"a", "b"}, (3, 3))
    state.absorb(status(0, 2, state.generation, (0, 2)))  # the restore
    state.back_to_snapshot()
    for i in range(2):
        state.absorb(
            ShardStatus(
                i, state.generation, 5, tuple(record(s, state.generation) for s in range(2, 5)), (), 0, 0
            )
        )
    assert state.committed_steps == 5
    copy_of(state, journal)
    assert journal.entries == state.ledger.entries_from(0), "the steps after the snapshot were replaced"
    assert {e.generation for e in journal.entries if e.step >= 2} == {state.generation}
    assert journal.history == state.history and journal.events == state.events


def test_shards_at_one_version_go_on_from_there_with_the_steps_the_copy_lacked() -> None:
    old = new_state()
    admit(old, {"a"}, (0, 0))
    run_to(old, 2)
    journal = copy_of(old)  # the controller's copy stops at step 2
    run_to(old, 6, snapshot=4)
    fenced = [status(i, 6, 9, (0, 4), applied_in=1) for i in range(2)]
    state = rebuilt(journal, fenced)
    assert state.committed_steps == 6 and state.ledger.snapshot_step == 4
    assert state.ledger.entries() == old.ledger.entries(), "steps 2..5 come from the shards' records"
    assert state.history == old.history and state.commit_times == old.commit_times
    assert state.events[-1].steps_lost == 0 and not state.lost
    assert state.role("a", -1) is None, "nothing is handed out before the next survival check admits workers"
    admit(state, {"a"}, (6, 6))
    role = state.role("a", -1)
    assert role is not None and role.start_step == 6 and role.generation == 10


def test_shards_at_two_versions_go_back_to_the_snapshot_every_one_holds() -> None:
    old = new_state()
    admit(old, {"a"}, (0, 0))
    run_to(old, 5, snapshot=4)
    journal = copy_of(old)
    # Shard 0 applied step 5 before the coordinator died, shard 1 had not yet.
    fenced = [status(0, 6, 9, (0, 4), applied_in=1), status(1, 5, 9, (0, 4), applied_in=1)]
    state = rebuilt(journal, fenced)
    assert state.committed_steps == 5 and state.ledger.snapshot_step == 4
    decision = survival_check(state.survival_state(), {"a"}, now=21.0)
    plan = state.reconcile(decision, [status(0, 6, 10, (0, 4)), status(1, 5, 10, (0, 4))])
    assert plan.restore_to == 4 and not plan.consistent


def test_a_shard_lost_with_the_coordinator_waits_at_the_snapshot_its_peer_holds() -> None:
    old = new_state()
    admit(old, {"a"}, (0, 0))
    run_to(old, 7, snapshot=4)
    journal = copy_of(old)
    # Shard 0 died with the coordinator; shard 1 holds snapshots 4 and 6, and replicas of shard 0's 4 and 6.
    state = rebuilt(journal, [status(1, 7, 9, (0, 4, 6), (4, 6), applied_in=1)], lost=(0,))
    assert state.lost == {0} and state.committed_steps == 6 and state.ledger.snapshot_step == 6
    assert state.events[-1].steps_lost == 1, "step 6 is trained again"
    assert state.ledger.entries() == [e for e in old.ledger.entries() if e.step < 6]
    assert state.role("a", -1) is None and state.progress().lost_shards == (0,)
    state.promote_shard(0, "static-c", 10, ("10.0.0.3", 9000), now=22.0, began=21.0)
    assert not state.lost and state.committed_steps == 6


def test_a_step_no_live_shard_has_a_record_of_follows_from_the_schedule() -> None:
    old = new_state()
    admit(old, {"a"}, (0, 0))
    run_to(old, 2)
    journal = copy_of(old)
    run_to(old, 4, snapshot=4)
    # Both shards took their state at step 3 (a promotion, then a restore): no record of step 2 is left.
    fenced = [status(i, 4, 9, (0, 4), since=3, applied_in=1) for i in range(2)]
    state = rebuilt(journal, fenced)
    assert state.committed_steps == 4
    assert sorted(e.batch_id for e in state.ledger.entries() if e.step == 2) == sorted(
        SCHEDULE.step_batches(2)
    )
    assert math.isnan(state.history[2]) and state.history[3] == old.history[3]


def test_a_shard_lost_without_its_replica_cannot_be_rebuilt() -> None:
    old = new_state()
    admit(old, {"a"}, (0, 0))
    run_to(old, 5, snapshot=4)
    journal = copy_of(old)
    with pytest.raises(DataServerLostError, match=r"data servers \[0\]"):
        rebuilt(journal, [status(1, 5, 9, (0, 4), replicas=())], lost=(0,))
