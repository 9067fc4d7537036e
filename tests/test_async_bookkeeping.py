"""Async mode's bookkeeping without a cluster: leases, commits once every shard applied a batch id, a
membership change or a promotion that retracts only what a shard lost, and a coordinator rebuilt from the
controller's copy of its record and the shards' fences."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefect_elastic.coordinator import AsyncLeases, CoordinatorSpec, CoordinatorState, rebuild_applied_from
from prefect_elastic.coordinator.survival import Policy, survival_check
from prefect_elastic.errors import FatalError
from prefect_elastic.messages import EventKind, Journal, ShardStatus, SnapshotInfo, StepRecord
from prefect_elastic.schedule import Schedule

# 2 data servers of 64 samples, batches of 8: 16 batch ids, each a step of its own in async mode.
SCHEDULE = Schedule((64, 64), batch_size=8, micro_batches=1, epochs=1, seed=0)


# -- the bookkeeping, without a cluster -------------------------------------------------------------------


def new_state(policy: str = "rollback") -> CoordinatorState:
    return CoordinatorState(CoordinatorSpec("job", SCHEDULE, 2, Policy(policy), 1, 10.0, commits=AsyncLeases))


def applied(index: int, generation: int, *applies: tuple[int, str, int]) -> ShardStatus:
    """Shard `index` having applied (batch id, worker, staleness) in this order, from version 0."""
    records = tuple(
        StepRecord(v, generation, (b,), {b: w}, {b: float(b)}, 100.0 + v, max(0, v - s), s)
        for v, (b, w, s) in enumerate(applies)
    )
    return ShardStatus(index, generation, len(applies), records, (), 0, 0)


def admit(state: CoordinatorState, workers: set[str]) -> None:
    decision = survival_check(state.survival_state(), workers, now=1.0)
    fenced = [ShardStatus(i, decision.generation, state.versions.get(i, 0), (), (), 0, 0) for i in range(2)]
    plan = state.reconcile(decision, fenced)
    state.change_membership(decision, plan, fenced, "test", now=2.0, began=1.5)
    state.after_decision(decision, now=2.0, began=1.5)


def test_leases_hand_out_the_lowest_free_batch_ids_to_members_of_the_generation_only() -> None:
    state = new_state()
    assert state.lease("a", 0, 2) is None, "nothing is handed out before the first survival check"
    admit(state, {"a", "b"})
    gen = state.generation
    assert state.lease("a", gen, 3) == [0, 1, 2]
    assert state.lease("b", gen, 3) == [3, 4, 5]
    assert state.lease("c", gen, 3) is None, "not a member"
    assert state.lease("a", gen - 1, 3) is None, "an old generation"
    assert dict(state.holding()) == {"a": 3, "b": 3}


def test_a_batch_id_commits_once_every_shard_applied_it_in_whatever_order() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    gen = state.generation
    state.lease("a", gen, 2)
    state.lease("b", gen, 2)
    state.absorb(applied(0, gen, (2, "b", 0), (0, "a", 1)))
    assert state.committed_steps == 0, "shard 1 has applied nothing yet"
    state.absorb(applied(1, gen, (0, "a", 0)))
    assert [(e.batch_id, e.step, e.worker) for e in state.ledger.entries()] == [(0, 0, "a")]
    state.absorb(applied(1, gen, (0, "a", 0), (2, "b", 3)))
    entries = {e.batch_id: e for e in state.ledger.entries()}
    assert sorted(entries) == [0, 2]
    assert entries[2].step == 1, "steps are numbered in the order the ledger committed them"
    assert entries[2].staleness == 3, "the most any shard had moved on"
    assert entries[0].staleness == 1
    assert state.history == [0.0, 2.0]
    assert dict(state.holding()) == {"a": 1, "b": 1}, "committed batch ids leave their lease"


def test_a_membership_change_returns_the_leases_and_undoes_nothing_even_under_rollback() -> None:
    state = new_state("rollback")
    admit(state, {"a", "b"})
    gen = state.generation
    assert state.lease("a", gen, 2) == [0, 1]
    assert state.lease("b", gen, 2) == [2, 3]
    # b died after its push of batch 2 reached shard 0 only; batch 0 reached both.
    state.absorb(applied(0, gen, (0, "a", 0), (2, "b", 0)))
    state.absorb(applied(1, gen, (0, "a", 0)))
    assert state.committed_steps == 1
    admit(state, {"a"})
    change = state.events[-1]
    assert change.kind is EventKind.REASSIGN and change.steps_lost == 0, "async mode never rolls back"
    assert change.batches_dropped == 3, "batch ids 1, 2 and 3 went back to the queue"
    assert state.counters["rollbacks"] == 0
    assert state.committed_steps == 1
    gen = state.generation
    assert state.lease("a", gen, 3) == [1, 2, 3], "returned batch ids come first, lowest first"
    # Shard 0 applied batch 2 already (it will answer "duplicate"); shard 1 applies it now: committed once.
    state.absorb(applied(1, gen, (0, "a", 0), (2, "a", 0)))
    assert [e.batch_id for e in state.ledger.entries()] == [0, 2]


def test_a_shard_promoted_from_its_snapshot_retracts_only_what_it_lost() -> None:
    """Shard 1 dies after applying batch ids its snapshot does not hold; its standby takes the snapshot.
    Committed ids it lacks leave the ledger and go back to the queue (shard 0 keeps its applies and will
    answer "duplicate"); ids the snapshot holds commit again at once; nothing is committed twice."""
    state = new_state("rollback")
    state.channels = (("127.0.0.1", 1), ("127.0.0.1", 2))
    admit(state, {"a"})
    gen = state.generation
    assert state.lease("a", gen, 4) == [0, 1, 2, 3]
    state.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0)))
    state.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0)))
    state.pause(gen + 1)  # every shard fenced: the snapshot holds batch ids 0 and 1 everywhere
    state.snapshot_async((2, 2), now=3.0, seconds=0.1)
    gen = state.generation
    assert state.snapshot_version_of(1) == 2 and state.ledger.snapshot_step == 2
    # After the snapshot: both shards apply 2 and 3 (committed); shard 1 also applies 4, shard 0 not yet.
    state.lease("a", gen, 3)
    state.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0)))
    state.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0), (4, "a", 0)))
    assert state.committed_steps == 4
    [lost] = state.lose_shard(1, gen + 1, "its worker died", now=4.0)
    assert lost.kind is EventKind.SHARD_LOST
    assert state.lease("a", state.generation, 4) is None, "nothing is leased while a shard is lost"
    event = state.promote_shard(
        1, "standby", gen + 2, ("127.0.0.1", 1), now=5.0, began=4.5, applied=frozenset({0, 1}), version=2
    )
    assert event.kind is EventKind.PROMOTED and event.steps_lost == 2 and "version 2" in event.reason
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1], "2 and 3 are not on shard 1 any more"
    assert state.counters["rollbacks"] == 0
    leased = state.lease("a", state.generation, 8)
    assert leased is not None and leased[:3] == [2, 3, 4], "the lost applies are trained again first"
    # Shard 0 answers "duplicate" for 2 and 3 (no new record); shard 1 applies them from version 2 on.
    state.absorb(ShardStatus(1, state.generation, 4, (
        StepRecord(2, state.generation, (2,), {2: "a"}, {2: 2.5}, 110.0, 2, 0),
        StepRecord(3, state.generation, (3,), {3: "a"}, {3: 3.5}, 111.0, 3, 0),
    ), (), 0, 0))  # fmt: skip
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1, 2, 3]
    assert sorted(e.step for e in state.ledger.entries()) == [0, 1, 2, 3], "each committed once"
    # Batch 4: shard 1's apply was lost, shard 0 never made one: it commits once both apply it.
    state.absorb(
        applied(0, state.generation, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0), (4, "a", 0))
    )
    assert 4 not in state.ledger
    state.absorb(ShardStatus(1, state.generation, 5, (
        StepRecord(4, state.generation, (4,), {4: "a"}, {4: 4.5}, 112.0, 4, 0),
    ), (), 0, 0))  # fmt: skip
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1, 2, 3, 4]


def test_a_coordinator_rebuilt_in_async_mode_keeps_every_apply_and_commits_each_id_once() -> None:
    """The coordinator dies with data server 0 after the controller's last copy of its record: the ledger
    comes back from the copy, what the live shard applied since waits for the promoted one, and each batch
    id is committed once, with nothing rolled back on the live shard."""
    old = new_state("rollback")
    old.channels = (("127.0.0.1", 1), ("127.0.0.1", 2))
    admit(old, {"a"})
    gen = old.generation
    old.lease("a", gen, 4)
    old.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0)))
    old.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0)))
    old.pause(gen + 1)
    old.snapshot_async((2, 2), now=3.0, seconds=0.1)  # shard 1 holds shard 0's replica of version 2
    journal = Journal()
    journal.extend(old.journal(0, 0))
    assert journal.committed_steps == 2 and journal.snapshot_step == 2
    # After the copy: both shards apply 2 and 3 (the old coordinator commits them); then it dies with
    # shard 0, whose apply of 4 is lost too.
    gen = old.generation
    old.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0), (4, "a", 0)))
    shard_1 = applied(1, gen, (0, "a", 0), (1, "a", 0), (2, "a", 1), (3, "a", 0))
    old.absorb(shard_1)
    assert old.committed_steps == 4

    state = new_state("rollback")
    state.channels = old.channels
    fenced = replace(shard_1, generation=9, snapshots=(SnapshotInfo(2, 3.0, 0.1),), replicas=(2,))
    event = state.rebuild(journal, [fenced], [0], 9, "static-1", "its worker died", now=5.0, began=4.5)
    assert event.kind is EventKind.COORDINATOR_REBUILT and "data servers [0] lost" in event.reason
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1], "shard 0's applies of 2, 3 are unknown"
    assert state.lost == {0} and state.snapshot_version_of(0) == 2, "its standby takes the replica of 2"
    assert state.lease("a", state.generation, 4) is None, "nothing is leased while a shard is lost"
    state.promote_shard(
        0, "standby", 10, ("127.0.0.1", 3), now=6.0, began=5.5, applied=frozenset({0, 1}), version=2
    )
    admit(state, {"a"})
    leased = state.lease("a", state.generation, 3)
    assert leased == [2, 3, 4], "what the promoted shard lacks is trained again"
    # Shard 1 answers "duplicate" for 2 and 3 (no new record); the promoted shard 0 applies 2, 3, 4.
    state.absorb(ShardStatus(0, state.generation, 5, tuple(
        StepRecord(v, state.generation, (v,), {v: "a"}, {v: v + 0.5}, 120.0 + v, v, 0) for v in (2, 3, 4)
    ), (), 0, 0))  # fmt: skip
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1, 2, 3], "4 waits for shard 1"
    assert {e.batch_id: e.staleness for e in state.ledger.entries()}[2] == 1, "shard 1's staleness kept"
    assert state.counters["coordinator_rebuilds"] == 1 and state.counters["rollbacks"] == 0


def test_a_rebuilt_coordinator_counts_the_applies_a_promoted_shard_holds_unrecorded() -> None:
    """The coordinator's static worker retires (CI, 2026-11-28: the job hung at 223 of 224 batch ids).
    The hand-over snapshots each shard where it stands: shard 0 had applied batch 2, shard 1 not yet. Shard
    0's standby takes that snapshot from its peer: it holds the apply of 2 and no record of it. Batch 2 is
    trained again; shard 1 applies it, shard 0 answers "duplicate". The controller's copy is taken before
    2 commits, and the coordinator is rebuilt from it: shard 0's fence names what it applied, recorded or
    not, so 2 commits once, from shard 1's record, and is not leased again."""
    old = new_state("rollback")
    old.channels = (("127.0.0.1", 1), ("127.0.0.1", 2))
    admit(old, {"a"})
    gen = old.generation
    assert old.lease("a", gen, 4) == [0, 1, 2, 3]
    old.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0)))
    old.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0)))
    old.pause(gen + 1)  # the hand-over: every shard fenced and snapshotted at its own version
    old.snapshot_async((3, 2), now=3.0, seconds=0.1)
    old.lose_shard(0, old.generation, "static worker static-0 is retiring", now=3.5)
    old.promote_shard(
        0, "standby", old.generation + 1, ("127.0.0.1", 3), now=4.0, began=3.5,
        applied=frozenset({0, 1, 2}), version=3,
    )  # fmt: skip
    journal = Journal()
    journal.extend(old.journal(0, 0))
    assert [e.batch_id for e in journal.entries] == [0, 1] and journal.first_open_batch() == 2
    # The promoted shard 0's records start at its version 3: it applies batch 3 (step 3); shard 1 applies
    # 2 and 3. Then the coordinator goes, before the controller copies these commits.
    gen = old.generation
    shard_0 = ShardStatus(0, gen, 4, (StepRecord(3, gen, (3,), {3: "a"}, {3: 3.0}, 103.0, 3, 0),), (), 0, 0)
    shard_1 = applied(1, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0))

    state = new_state("rollback")
    state.channels = old.channels
    fenced = [
        replace(shard_0, generation=9, snapshots=(SnapshotInfo(3, 3.0, 0.1),), applied=(2, 3)),
        replace(shard_1, generation=9, snapshots=(SnapshotInfo(2, 3.0, 0.1),), applied=(2, 3)),
    ]
    state.rebuild(journal, fenced, [], 9, "static-1", "static-0 is retiring", now=5.0, began=4.5)
    assert sorted(e.batch_id for e in state.ledger.entries()) == [0, 1, 2, 3], "2 is not left waiting"
    assert sorted(e.step for e in state.ledger.entries()) == [0, 1, 2, 3], "each committed once"
    admit(state, {"a"})
    assert state.lease("a", state.generation, 4) == [4, 5, 6, 7], "nothing applied everywhere is leased"


def promoted_after_the_copy() -> tuple[CoordinatorState, Journal]:
    """Both shards applied 0 and 1 before a snapshot, then 2 and 3 (committed), and the controller copied
    the record (0 to 3). Then shard 1's worker died: its standby took the snapshot (0 and 1), and the
    promotion retracted 2 and 3 from the ledger, a change the copy never saw."""
    old = new_state("rollback")
    old.channels = (("127.0.0.1", 1), ("127.0.0.1", 2))
    admit(old, {"a"})
    gen = old.generation
    old.lease("a", gen, 4)
    old.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0)))
    old.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0)))
    old.pause(gen + 1)
    old.snapshot_async((2, 2), now=3.0, seconds=0.1)
    gen = old.generation
    old.absorb(applied(0, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0)))
    old.absorb(applied(1, gen, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0)))
    journal = Journal()
    journal.extend(old.journal(0, 0))
    assert [e.batch_id for e in journal.entries] == [0, 1, 2, 3] and journal.snapshot_step == 2
    old.lose_shard(1, gen + 1, "its worker died", now=4.0)
    old.promote_shard(
        1, "standby", gen + 2, ("127.0.0.1", 3), now=5.0, began=4.5, applied=frozenset({0, 1}), version=2
    )
    assert [e.batch_id for e in old.ledger.entries()] == [0, 1], "2 and 3 are not on shard 1 any more"
    return old, journal


def test_a_rebuilt_coordinator_retracts_what_a_shard_promoted_after_the_copy_lacks() -> None:
    """The coordinator dies after a promotion and before the controller's next copy of its record: the
    copy still holds 2 and 3, which the promoted shard 1 never applied. Its fence (asked from the lowest
    id committed after the copy's snapshot) names what it holds; 2 and 3 leave the ledger, are trained
    again, and commit once shard 1 applied them: no gradient of them is missing on shard 1."""
    old, journal = promoted_after_the_copy()
    assert rebuild_applied_from(journal) == 2, "from the lowest id committed after the copy's snapshot"
    shard_0 = applied(0, 9, (0, "a", 0), (1, "a", 0), (2, "a", 0), (3, "a", 0))
    fenced = [
        replace(shard_0, snapshots=(SnapshotInfo(2, 3.0, 0.1),), applied=(2, 3)),
        ShardStatus(1, 9, 2, (), (SnapshotInfo(2, 3.0, 0.1),), 0, 0, applied=()),
    ]
    state = new_state("rollback")
    state.channels = old.channels
    event = state.rebuild(journal, fenced, [], 9, "static-1", "its worker died", now=6.0, began=5.5)
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1], "shard 1 never applied 2 and 3"
    assert event.steps_lost == 2 and "2 batch ids a live shard lacks" in event.reason
    admit(state, {"a"})
    assert state.lease("a", state.generation, 3) == [2, 3, 4], "what shard 1 lacks is trained again"
    # Shard 0 answers "duplicate"; shard 1 applies 2 and 3: each commits once, with shard 0's loss.
    state.absorb(ShardStatus(1, state.generation, 4, tuple(
        StepRecord(v, state.generation, (v,), {v: "a"}, {v: v + 0.5}, 120.0 + v, v, 0) for v in (2, 3)
    ), (), 0, 0))  # fmt: skip
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1, 2, 3]
    assert sorted(e.step for e in state.ledger.entries()) == [0, 1, 2, 3], "each committed once"


def test_a_rebuilt_coordinator_keeps_the_copys_commits_every_live_shard_holds() -> None:
    """The same record, with the coordinator lost together with shard 0 (a live shard 1 that holds 2 and
    3 keeps them committed until shard 0's own promotion settles what it lacks)."""
    old, journal = promoted_after_the_copy()
    # Shard 1 lacks 2 and 3; shard 0 died with the coordinator: its replica (on shard 1) holds 0 and 1.
    fenced = [ShardStatus(1, 9, 2, (), (SnapshotInfo(2, 3.0, 0.1),), 0, 0, replicas=(2,), applied=())]
    state = new_state("rollback")
    state.channels = old.channels
    state.rebuild(journal, fenced, [0], 9, "static-1", "its worker died", now=6.0, began=5.5)
    assert [e.batch_id for e in state.ledger.entries()] == [0, 1], "the live shard 1 lacks 2 and 3"
    state.promote_shard(
        0, "standby", 10, ("127.0.0.1", 4), now=7.0, began=6.5, applied=frozenset({0, 1}), version=2
    )
    admit(state, {"a"})
    assert state.lease("a", state.generation, 3) == [2, 3, 4]
    for i in (0, 1):
        state.absorb(ShardStatus(i, state.generation, 4, tuple(
            StepRecord(v, state.generation, (v,), {v: "a"}, {v: v + 0.5}, 120.0 + v, v, 0) for v in (2, 3)
        ), (), 0, 0))  # fmt: skip
        assert [e.batch_id for e in state.ledger.entries()] == ([0, 1] if i == 0 else [0, 1, 2, 3])

    # Had shard 1 held 2 and 3 (nothing retracted), the copy's commits stand as they are.
    keeps = new_state("rollback")
    keeps.channels = old.channels
    holding = [replace(fenced[0], version=4, applied=(2, 3))]
    keeps.rebuild(journal, holding, [0], 9, "static-1", "its worker died", now=6.0, began=5.5)
    assert [(e.batch_id, e.step) for e in keeps.ledger.entries()] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_async_mode_asks_for_no_snapshot_mid_run() -> None:
    state = new_state()
    admit(state, {"a"})
    state.absorb(applied(0, state.generation, (0, "a", 0)))
    assert state.want_snapshot(progressed=True) is None


def test_leases_are_for_async_mode_only() -> None:
    state = CoordinatorState(CoordinatorSpec("job", SCHEDULE, 2, Policy.ROLLBACK, 1, 10.0))
    with pytest.raises(FatalError, match="async mode only"):
        state.lease("a", 0, 1)


def test_a_loop_that_started_over_gives_its_lease_back_and_committed_ids_are_not_leased_again() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    gen = state.generation
    assert state.lease("a", gen, 4) == [0, 1, 2, 3]
    state.absorb(applied(0, gen, (1, "a", 0)))
    state.absorb(applied(1, gen, (1, "a", 0)))
    # a's loop failed (a shard timed out) and starts over in the same generation: its first lease renews.
    assert state.lease("a", gen, 2, renew=True) == [0, 2], "its uncommitted ids come back, lowest first"
    assert state.lease("b", gen, 4) == [3, 4, 5, 6]
    assert 1 not in state.commits.queue and dict(state.holding()) == {"a": 2, "b": 4}


def test_no_lease_once_the_job_is_over() -> None:
    state = new_state()
    admit(state, {"a"})
    gen = state.generation
    ids = state.lease("a", gen, SCHEDULE.total_batches)
    assert ids == list(range(SCHEDULE.total_batches))
    records = [(b, "a", 0) for b in ids]
    state.absorb(applied(0, gen, *records))
    state.absorb(applied(1, gen, *records))
    assert state.finished
    assert state.lease("a", gen, 4) is None, "the loop asks for its role, which says stop"
