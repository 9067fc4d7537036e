"""The coordinator's bookkeeping (`CoordinatorState`) on event sequences, without any cluster: roles by
rank, steps committed when every shard applied them, snapshots confirmed when every shard holds them, and
shards brought back to one version when a worker died between its pushes. (When something fails, a
worker's model or a data server: test_coordinator_failures.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefect_elastic.coordinator import (
    AsyncLeases,
    Coordinator,
    CoordinatorSpec,
    CoordinatorState,
    PromotionPlan,
    SnapshotAt,
    SnapshotCommitted,
    SnapshotWhereFenced,
    SyncCommits,
    read_interval,
)
from prefect_elastic.coordinator.survival import Action, Policy, survival_check
from prefect_elastic.errors import FatalError
from prefect_elastic.messages import EventKind, ShardStatus, SnapshotInfo, StepRecord
from prefect_elastic.schedule import Schedule

# 2 data servers of 64 samples, batches of 8, 4 micro-batches a step: 16 batches, 4 steps an epoch.
SCHEDULE = Schedule((64, 64), batch_size=8, micro_batches=4, epochs=1, seed=0)


def new_state(policy: str = "reassign", shards: int = 2) -> CoordinatorState:
    return CoordinatorState(CoordinatorSpec("job", SCHEDULE, shards, Policy(policy), 1, 10.0))


def record(step: int, generation: int = 1, worker: str = "a") -> StepRecord:
    ids = tuple(SCHEDULE.step_batches(step))
    return StepRecord(
        step, generation, ids, dict.fromkeys(ids, worker), {b: float(b) for b in ids}, 100.0 + step
    )


def status(
    index: int,
    version: int,
    generation: int = 1,
    snapshots: tuple[int, ...] = (0,),
    since: int = 0,
    pending: int = 0,
) -> ShardStatus:
    return ShardStatus(
        index=index,
        generation=generation,
        version=version,
        records=tuple(record(s, generation) for s in range(since, version)),
        snapshots=tuple(SnapshotInfo(v, 50.0 + v, 0.01) for v in snapshots),
        pending=pending,
        refused=0,
    )


def admit(state: CoordinatorState, workers: set[str], versions: tuple[int, ...] = (0, 0)) -> None:
    """A survival check that changes the membership, carried out as the coordinator actor does."""
    decision = survival_check(state.survival_state(), workers, now=1.0)
    fenced = [status(i, v, decision.generation, since=state.committed_steps) for i, v in enumerate(versions)]
    plan = state.reconcile(decision, fenced)
    state.change_membership(decision, plan, fenced, "test", now=2.0, began=1.5)
    state.after_decision(decision, now=2.0, began=1.5)


def test_the_first_members_get_roles_by_rank_and_a_start_event() -> None:
    state = new_state()
    assert state.role("a", -1) is None, "nothing is handed out before the first survival check"
    admit(state, {"b", "a"})
    assert [e.kind for e in state.events] == [EventKind.START]
    assert state.events[0].steps_lost == 0 and state.events[0].batches_dropped == 0
    a, b = state.role("a", -1), state.role("b", -1)
    assert a is not None and b is not None
    assert (a.rank, b.rank, a.members, a.start_step, a.generation) == (0, 1, ("a", "b"), 0, 1)
    assert state.role("a", a.generation) is None, "a worker that has its role waits for the next one"
    assert state.role("c", -1) is None, "not a member"
    # Each member's share of the open step: micro-batches dealt by rank.
    assert state.holding() == (("a", 2), ("b", 2))
    assert SCHEDULE.share(0, 0, 2) + SCHEDULE.share(0, 1, 2) == (0, 2, 1, 3)


def test_a_step_commits_when_every_shard_applied_it() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    state.absorb(status(0, 2))
    assert state.committed_steps == 0, "shard 1 has not applied step 0 yet"
    state.absorb(status(1, 1))
    assert state.committed_steps == 1
    assert state.history == [sum(range(4)) / 4]
    state.absorb(status(1, 2, since=1))
    assert state.committed_steps == 2
    assert [e.batch_id for e in state.ledger.entries()] == list(range(8))
    assert state.commit_times == [100.0, 101.0]


def test_an_answer_from_before_a_fence_is_ignored() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    admit(state, {"a"})  # generation 2
    assert state.absorb(status(0, 1, generation=1)) == []
    assert state.versions[0] == 0 and state.committed_steps == 0


def test_a_snapshot_is_confirmed_when_every_shard_holds_it() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    state.absorb(status(0, 1))
    state.absorb(status(1, 1))
    version = state.want_snapshot(progressed=True)
    assert version == 2, "a running job is asked one version ahead of the newest shard"
    state.absorb(status(0, 2, snapshots=(0, 2), since=1))
    assert state.ledger.snapshot_step == 0, "shard 1 has not taken it yet"
    events = state.absorb(status(1, 2, snapshots=(0, 2), since=1))
    assert [e.kind for e in events] == [EventKind.SNAPSHOT]
    assert state.ledger.snapshot_step == 2 and state.snapshot_wanted is None
    assert events[0].seconds > 0
    assert state.want_snapshot(progressed=False) is None, "nothing new since"


def test_a_snapshots_window_runs_to_the_end_of_its_copy_to_the_peer() -> None:
    """The window a snapshot could slow steps in (the event's time and seconds: the benchmark's in-run
    measure of what snapshots cost) spans the shards' own copies and their copies to the peers, which go on
    in the background while steps commit."""
    state = new_state()
    admit(state, {"a", "b"})
    state.absorb(status(0, 1))
    state.absorb(status(1, 1))
    assert state.want_snapshot(progressed=True) == 2
    for index, replicated in ((0, 52.3), (1, 52.1)):
        shard = status(index, 2, snapshots=(0,), since=1)
        taken = SnapshotInfo(2, 52.0 + index / 100, 0.01, replicated=replicated)
        events = state.absorb(replace(shard, snapshots=(*shard.snapshots, taken)))
    (snapshot,) = events
    assert snapshot.kind is EventKind.SNAPSHOT
    assert snapshot.time == 52.3, "the last copy to a peer ends the window"
    assert abs(snapshot.time - snapshot.seconds - 51.99) < 1e-9, "the first shard's own copy starts it"


def test_a_snapshot_confirmed_late_records_its_own_step_which_a_rollback_goes_back_to() -> None:
    # The last shard reports its copy of version 2 only after step 2 committed too (the case CI once hit:
    # the event said step 3, the rollback went back to 2).
    state = new_state("rollback")
    admit(state, {"a", "b"})
    state.absorb(status(0, 1))
    state.absorb(status(1, 1))
    assert state.want_snapshot(progressed=True) == 2
    state.absorb(status(0, 3, snapshots=(0, 2), since=1))
    events = state.absorb(status(1, 3, snapshots=(0, 2), since=1))
    assert state.committed_steps == 3
    assert [(e.kind, e.step) for e in events] == [(EventKind.SNAPSHOT, 2)]
    admit(state, {"a"}, versions=(3, 3))
    rollback = state.events[-1]
    assert (rollback.kind, rollback.step, rollback.steps_lost) == (EventKind.ROLLBACK, 2, 1)


def test_a_job_that_stands_still_is_snapshotted_where_it_stands() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    state.absorb(status(0, 3))
    state.absorb(status(1, 3))
    assert state.want_snapshot(progressed=False) == 3


def test_shards_a_version_apart_go_back_to_the_snapshot_even_with_reassign() -> None:
    """A worker died after its push to shard 0 and before its push to shard 1: shard 0 applied step 2,
    shard 1 never will. Both go back to the last snapshot (step 1); step 2 was never committed."""
    state = new_state("reassign")
    admit(state, {"a", "b"})
    state.absorb(status(0, 1))
    state.absorb(status(1, 1))
    state.want_snapshot(progressed=True)
    state.snapshot_wanted = 1
    state.absorb(status(0, 1, snapshots=(0, 1), since=1))
    state.absorb(status(1, 1, snapshots=(0, 1), since=1))
    assert state.ledger.snapshot_step == 1
    state.absorb(status(0, 2, since=1))
    state.absorb(status(1, 2, since=1))
    assert state.committed_steps == 2
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    assert decision.action is Action.REASSIGN
    fenced = [status(0, 3, 2, since=2), status(1, 2, 2, since=2)]
    plan = state.reconcile(decision, fenced)
    assert plan.restore_to == 1 and not plan.consistent and plan.versions == (3, 2)
    assert state.committed_steps == 2, "step 2, applied by one shard only, was never committed"
    event = state.change_membership(decision, plan, fenced, "worker event", now=6.0, began=5.0)
    assert event.kind is EventKind.REASSIGN and event.steps_lost == 1 and event.left == ("b",)
    assert "shards were at versions [3, 2]" in event.reason
    assert state.committed_steps == 1 and len(state.history) == 1
    assert state.counters["inconsistent_fences"] == 1
    state.after_decision(decision, now=6.0, began=5.0)
    role = state.role("a", 1)
    assert role is not None and (role.rank, role.size, role.start_step) == (0, 1, 1)


def test_a_shard_a_step_ahead_that_keeps_the_step_before_steps_back_instead_of_a_restore() -> None:
    """Gradients in parts: a member died between its seals to two shards, shard 0 committed step 2 and
    still holds step 2's parameters whole in its other copy (`kept`). Under `reassign` it steps back:
    nothing committed is lost, no shard restores the snapshot. Under `rollback`, or where the shard ahead
    cannot (it applied a bucket since, or holds one copy), every shard goes back to the snapshot."""
    state = new_state("reassign")
    admit(state, {"a", "b"})
    state.absorb(status(0, 2))
    state.absorb(status(1, 2))
    assert state.committed_steps == 2
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    fenced = [replace(status(0, 3, 2, since=2), kept=2), status(1, 2, 2, since=2)]
    plan = state.reconcile(decision, fenced)
    assert (plan.step_back_to, plan.restore_to, plan.consistent) == (2, None, False)
    event = state.change_membership(decision, plan, fenced, "worker event", now=6.0, began=5.0)
    assert event.kind is EventKind.REASSIGN and event.steps_lost == 0 and event.step == 2
    assert "stepped back to step 2" in event.reason
    assert state.committed_steps == 2 and state.counters["steps_back"] == 1
    assert state.counters["inconsistent_fences"] == 1
    # Not where the shard ahead cannot, nor under `rollback`.
    for kept, policy in ((None, "reassign"), (1, "reassign"), (2, "rollback")):
        other = new_state(policy)
        admit(other, {"a", "b"})
        other.absorb(status(0, 2))
        other.absorb(status(1, 2))
        check = survival_check(other.survival_state(), {"a"}, now=5.0)
        ahead = replace(status(0, 3, 2, since=2), kept=kept)
        plan = other.reconcile(check, [ahead, status(1, 2, 2, since=2)])
        assert plan.step_back_to is None and plan.restore_to == 0, (kept, policy)


def test_a_shard_without_state_a_step_ahead_steps_back_with_the_others_but_not_alone() -> None:
    """A data server that holds no state has nothing to keep: beside a shard ahead that keeps the version
    before, it steps back by counting; ahead alone (gradients pushed whole), the shards restore as before."""
    for stateful_ahead, expected in ((True, (2, None)), (False, (None, 0))):
        state = new_state("reassign", shards=3)
        admit(state, {"a", "b"}, versions=(0, 0, 0))
        for i in range(3):
            state.absorb(status(i, 2))
        decision = survival_check(state.survival_state(), {"a"}, now=5.0)
        stateless = replace(status(0, 3, 2, since=2), stateless=True)
        first = replace(status(1, 3, 2, since=2), kept=2) if stateful_ahead else status(1, 2, 2, since=2)
        plan = state.reconcile(decision, [stateless, first, status(2, 2, 2, since=2)])
        assert (plan.step_back_to, plan.restore_to) == expected, stateful_ahead


def test_reassign_with_shards_that_agree_loses_no_committed_step() -> None:
    state = new_state("reassign")
    admit(state, {"a", "b"})
    decision = survival_check(state.survival_state(), {"a", "c"}, now=5.0)
    fenced = [status(0, 2, 2, pending=3), status(1, 2, 2, pending=1)]
    plan = state.reconcile(decision, fenced)
    assert plan.restore_to is None
    event = state.change_membership(decision, plan, fenced, "worker event", now=6.0, began=5.0)
    assert (event.steps_lost, event.batches_dropped, event.step) == (0, 4, 2)
    assert event.joined == ("c",) and event.left == ("b",)


def test_rollback_goes_back_to_the_snapshot() -> None:
    state = new_state("rollback")
    admit(state, {"a", "b"})
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    fenced = [status(0, 3, 2), status(1, 3, 2)]
    plan = state.reconcile(decision, fenced)
    assert plan.restore_to == 0 and plan.consistent
    event = state.change_membership(decision, plan, fenced, "worker event", now=6.0, began=5.0)
    assert event.kind is EventKind.ROLLBACK and event.steps_lost == 3 and state.committed_steps == 0
    assert state.ledger.dropped_batches == 12


def test_shards_more_than_a_version_apart_is_a_bug_never_papered_over() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    with pytest.raises(FatalError, match="more than one step apart"):
        state.reconcile(decision, [status(0, 3, 2), status(1, 1, 2)])


def test_a_stateless_data_server_two_versions_behind_goes_back_to_the_snapshot_with_the_others() -> None:
    """A data server that holds no state may lag more than a version (no loop waits for it); the fence
    finds the versions apart, and every shard goes back to the snapshot, which it holds too."""
    state = new_state("reassign")
    admit(state, {"a", "b"})
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    fenced = [replace(status(0, 1, 2), stateless=True), status(1, 3, 2)]
    plan = state.reconcile(decision, fenced)
    assert plan.restore_to == 0 and not plan.consistent
    event = state.change_membership(decision, plan, fenced, "worker event", now=6.0, began=5.0)
    assert event.steps_lost == 1 and state.committed_steps == 0 and "[1, 3]" in event.reason


def test_shards_that_applied_different_batch_ids_is_a_bug() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    odd = StepRecord(0, 1, (0, 1, 2, 5), {}, dict.fromkeys((0, 1, 2, 5), 0.0), 1.0)
    state.absorb(ShardStatus(0, 1, 1, (odd,), (), 0, 0))
    with pytest.raises(FatalError, match="different batch ids"):
        state.absorb(status(1, 1))


def test_the_shards_are_read_less_often_in_a_sync_jobs_steady_state_and_often_near_its_end() -> None:
    """Each read of the shards' status is a Dask call to every shard, on processes that share the
    machine with the compute workers: a sync job far from its end is read every `steady` seconds, and
    often (`quick`) where something waits on the read: before the pace of steps is known, near the end
    (so that the end is seen at once), and in async mode."""
    schedule = Schedule((64, 64), batch_size=8, micro_batches=4, epochs=25, seed=0)  # 100 steps

    def applied(state: CoordinatorState, version: int) -> None:
        """Both shards at `version`, steps 10 ms apart."""
        for index in range(2):
            records = tuple(
                StepRecord(
                    s, state.generation, ids, dict.fromkeys(ids, "a"), dict.fromkeys(ids, 1.0), 0.01 * s
                )
                for s in range(state.committed_steps, version)
                for ids in [tuple(schedule.step_batches(s))]
            )
            state.absorb(ShardStatus(index, state.generation, version, records, (), 0, 0))

    state = CoordinatorState(CoordinatorSpec("job", schedule, 2, Policy.REASSIGN, 1, 10.0))
    admit(state, {"a"})
    assert state.sync_interval(0.05, 0.25) == 0.05, "the pace is not known yet"
    applied(state, 40)
    assert state.sync_interval(0.05, 0.25) == 0.25, "60 steps of 10 ms left: far from the end"
    applied(state, 60)
    assert state.sync_interval(0.05, 0.25) == 0.05, "40 steps left: the end may come within two waits"
    applied(state, 100)
    assert state.finished and state.sync_interval(0.05, 0.25) == 0.05
    asynchronous = CoordinatorState(
        CoordinatorSpec("job", schedule, 2, Policy.REASSIGN, 1, 10.0, commits=AsyncLeases)
    )
    assert asynchronous.sync_interval(0.05, 0.25) == 0.05


def test_the_end_stops_every_loop() -> None:
    state = new_state()
    admit(state, {"a"})
    state.absorb(status(0, 4))
    events = state.absorb(status(1, 4))
    assert [e.kind for e in events] == [EventKind.DONE]
    assert state.finished and state.progress().state == "done"
    role = state.role("a", 1)
    assert role is not None and role.stop
    assert state.holding() == ()


def test_below_min_workers_nothing_is_handed_out() -> None:
    state = CoordinatorState(CoordinatorSpec("job", SCHEDULE, 2, Policy.REASSIGN, 2, 10.0))
    decision = survival_check(state.survival_state(), {"a"}, now=1.0)
    fenced = [status(0, 0, 1), status(1, 0, 1)]
    state.change_membership(decision, state.reconcile(decision, fenced), fenced, "t", now=1.0, began=1.0)
    events = state.after_decision(decision, now=1.0, began=1.0)
    assert [e.kind for e in events] == [EventKind.WAITING]
    assert state.role("a", -1) is None and state.progress().state == "waiting"


def snapshot_at_two(state: CoordinatorState) -> None:
    """Step 0 committed, a snapshot of version 2 confirmed, steps 1 and 2 committed (3 of 4)."""
    state.absorb(status(0, 1))
    state.absorb(status(1, 1))
    assert state.want_snapshot(progressed=True) == 2
    state.absorb(status(0, 3, snapshots=(0, 2), since=1))
    state.absorb(status(1, 3, snapshots=(0, 2), since=1))
    assert (state.committed_steps, state.ledger.snapshot_step) == (3, 2)


def test_a_shard_keeps_only_the_records_of_steps_the_controllers_copy_may_lack() -> None:
    """A shard holds a record per step it applied; a rebuilt coordinator takes the steps the controller's
    copy of the record holds from the copy, so the shards drop the records of those steps and no more:
    of what the copy held when the controller last asked, the part that still stands after a rollback."""
    state = new_state("rollback")
    admit(state, {"a", "b"})
    snapshot_at_two(state)
    assert state.records_kept_from() == 0, "the controller has not said what its copy holds"
    state.journal(0, 0)
    assert state.records_kept_from() == 0, "its copy held nothing when it asked (what it took is not known)"
    state.journal(3, len(state.events))
    assert state.records_kept_from() == 3
    # A rollback to the snapshot of step 2: step 2 is trained again, its record in the copy replaced.
    decision = survival_check(state.survival_state(), {"a"}, now=5.0)
    fenced = [status(i, 3, decision.generation, snapshots=(0, 2), since=3) for i in range(2)]
    state.change_membership(decision, state.reconcile(decision, fenced), fenced, "test", now=6.0, began=5.0)
    assert state.committed_steps == 2 and state.records_kept_from() == 2
    state.journal(3, 0)
    assert state.records_kept_from() == 2, "the copy says 3 steps, of which 2 still stand"
    assert (
        CoordinatorState(
            CoordinatorSpec("job", SCHEDULE, 2, Policy.REASSIGN, 1, 10.0, commits=AsyncLeases)
        ).records_kept_from()
        == 0
    )


# -- the two commit bookkeepings, chosen once ------------------------------------------------------------


def test_the_actor_keeps_the_commit_book_it_is_given() -> None:
    for given, book in ((AsyncLeases, AsyncLeases), (SyncCommits, SyncCommits)):
        actor = Coordinator(CoordinatorSpec("job", SCHEDULE, 2, Policy.REASSIGN, 1, 10.0, given), None, 5.0)
        assert type(actor._state.commits) is book
        assert actor._state.progress().mode == book.mode


def test_sync_commits_snapshot_one_version_at_a_check_and_the_committed_step_when_stopped() -> None:
    state = new_state()
    admit(state, {"a"})
    state.absorb(status(0, 2))
    state.absorb(status(1, 2))
    assert state.snapshot_plan(progressed=True) == SnapshotAt(version=3, keep=0), "one ahead of the shards"
    assert state.snapshot_wanted == 3
    assert isinstance(state.snapshot_when_stopped(), SnapshotCommitted)
    assert state.promotion() == PromotionPlan(restore_to=0, asks_applied=False), "back to the snapshot"
    assert state.rebuild_applied_from(state.journal(0, 0)) is None


def test_async_leases_snapshot_where_each_shard_stands_every_few_checks_that_saw_progress() -> None:
    state = CoordinatorState(
        CoordinatorSpec("job", SCHEDULE, 2, Policy.REASSIGN, 1, 10.0, commits=AsyncLeases, snapshot_every=2)
    )
    admit(state, {"a"})
    assert state.want_snapshot(progressed=True) is None, "no one version to snapshot mid-run"
    assert state.snapshot_plan(progressed=False) is None, "a check without progress does not count"
    assert state.snapshot_plan(progressed=True) is None
    assert state.snapshot_plan(progressed=True) == SnapshotWhereFenced(), "the second check with progress"
    assert state.snapshot_plan(progressed=True) is None, "and the count starts again"
    assert isinstance(state.snapshot_when_stopped(), SnapshotWhereFenced)
    assert state.promotion() == PromotionPlan(restore_to=None, asks_applied=True), "nothing goes back"
    assert state.rebuild_applied_from(state.journal(0, 0)) == 0
    assert (
        CoordinatorState(
            CoordinatorSpec("job", SCHEDULE, 2, Policy.REASSIGN, 1, 10.0, commits=AsyncLeases)
        ).snapshot_plan(progressed=True)
        is None
    ), "without checkpoints: only when the run stops or ends"


def test_a_sync_job_is_never_handed_a_lease_nor_a_snapshot_of_one_version_per_shard() -> None:
    state = new_state()
    admit(state, {"a"})
    with pytest.raises(FatalError, match="async mode only"):
        state.lease("a", state.generation, 2)
    with pytest.raises(FatalError, match="one version for every shard"):
        state.snapshot_async((1, 2), now=3.0, seconds=0.1)


def test_the_read_interval_follows_the_pace_of_the_last_steps() -> None:
    assert read_interval([], 100, 0.05, 0.25) == 0.05, "no pace yet"
    assert read_interval([float("nan")] * 30, 100, 0.05, 0.25) == 0.05, "steps resumed from a checkpoint"
    assert read_interval([1.0, 1.0], 100, 0.05, 0.25) == 0.05, "no time between them"
    paced = [0.1 * s for s in range(40)]  # 100 ms a step; only the last 20 count
    assert read_interval(paced, 6, 0.05, 0.25) == 0.25, "0.6 s left: more than two steady waits"
    assert read_interval(paced, 4, 0.05, 0.25) == 0.05, "0.4 s left: the end may come within two waits"
