"""The survival-detection decision, unit-tested on event sequences without any cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefect_elastic.coordinator.survival import (
    Action,
    Decision,
    SurvivalState,
    spare_what_lost_nothing,
    survival_check,
)


def state(**overrides: object) -> SurvivalState:
    base = SurvivalState(
        generation=3,
        workers=frozenset({"a", "b"}),
        policy="rollback",
        min_workers=1,
        min_workers_timeout=10.0,
        committed_steps=7,
        snapshot_step=5,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def after(s: SurvivalState, d: Decision, committed: int | None = None) -> SurvivalState:
    """What the coordinator's state is once it carried `d` out."""
    nxt = replace(s, generation=d.generation, workers=d.workers, below_min_since=d.below_min_since)
    if d.action is Action.SNAPSHOT:
        nxt = replace(nxt, snapshot_step=nxt.committed_steps)
    if d.action is Action.ROLLBACK:
        nxt = replace(nxt, committed_steps=nxt.snapshot_step)
    if committed is not None:
        nxt = replace(nxt, committed_steps=committed)
    return nxt


def test_unchanged_membership_snapshots() -> None:
    d = survival_check(state(), {"a", "b"}, now=100.0)
    assert d.action is Action.SNAPSHOT
    assert d.generation == 3 and d.resume and not d.membership_changed


def test_unchanged_membership_without_progress_does_nothing() -> None:
    d = survival_check(state(committed_steps=5), {"a", "b"}, now=100.0)
    assert d.action is Action.NOTHING
    assert d.resume


@pytest.mark.parametrize(("policy", "action"), [("rollback", Action.ROLLBACK), ("reassign", Action.REASSIGN)])
def test_lost_worker_bumps_generation_and_applies_policy(policy: str, action: Action) -> None:
    d = survival_check(state(policy=policy), {"a"}, now=100.0)
    assert d.action is action
    assert d.generation == 4
    assert d.left == {"b"} and d.joined == frozenset()
    assert d.workers == {"a"}
    assert "lost b" in d.reason


def test_joined_worker_is_a_membership_change_too() -> None:
    d = survival_check(state(), {"a", "b", "c"}, now=100.0)
    assert d.action is Action.ROLLBACK
    assert d.joined == {"c"} and d.generation == 4


def test_replaced_worker_same_count_is_a_change() -> None:
    # The patent counts servers; a worker replaced by another in one interval still changes who holds work.
    d = survival_check(state(), {"a", "c"}, now=100.0)
    assert d.membership_changed
    assert d.left == {"b"} and d.joined == {"c"}


def test_first_check_starts_generation_one() -> None:
    s = state(generation=0, workers=frozenset(), committed_steps=0, snapshot_step=0)
    d = survival_check(s, {"a"}, now=0.0)
    assert d.generation == 1 and d.resume and d.joined == {"a"}


def test_too_few_workers_waits_then_fails() -> None:
    s = state(min_workers=2, min_workers_timeout=5.0)
    d1 = survival_check(s, {"a"}, now=100.0)
    assert d1.action is Action.ROLLBACK and not d1.resume and d1.failure is None
    assert d1.below_min_since == 100.0
    s = after(s, d1)
    d2 = survival_check(s, {"a"}, now=103.0)
    assert d2.action is Action.NOTHING and not d2.resume and d2.failure is None
    assert d2.below_min_since == 100.0, "the wait is counted from when it started"
    d3 = survival_check(after(s, d2), {"a"}, now=105.5)
    assert d3.failure is not None
    assert "min_workers=2" in d3.failure and "add elastic workers" in d3.failure


def test_wait_ends_when_workers_come_back() -> None:
    s = state(min_workers=2)
    s = after(s, survival_check(s, {"a"}, now=100.0))
    d = survival_check(s, {"a", "c"}, now=101.0)
    assert d.resume and d.below_min_since is None and d.failure is None
    assert d.joined == {"c"} and d.generation == s.generation + 1


def test_no_workers_at_all_waits() -> None:
    d = survival_check(state(), set(), now=100.0)
    assert not d.resume and d.left == {"a", "b"}


def test_sequence_kill_join_snapshot() -> None:
    """A whole run: snapshot, a kill, steps, a join, steps; generations count the changes."""
    s = state(generation=1, committed_steps=4, snapshot_step=0)
    events = [({"a", "b"}, 4), ({"a"}, 6), ({"a"}, 9), ({"a", "c"}, 9), ({"a", "c"}, 12)]
    actions = []
    for live, committed in events:
        s = replace(s, committed_steps=committed)
        d = survival_check(s, live, now=0.0)
        actions.append(d.action)
        s = after(s, d)
    assert actions == [Action.SNAPSHOT, Action.ROLLBACK, Action.SNAPSHOT, Action.ROLLBACK, Action.SNAPSHOT]
    assert s.generation == 3
    assert s.snapshot_step == 12


def test_first_members_are_admitted_not_rolled_back() -> None:
    """The job's start (or a join after a wait with no members) undoes nothing: it is a start."""
    d = survival_check(state(workers=frozenset(), committed_steps=0, snapshot_step=0), {"a"}, now=1.0)
    assert d.action is Action.START
    assert d.generation == 4 and d.joined == {"a"} and d.resume
    again = survival_check(state(workers=frozenset(), policy="reassign"), {"a", "b"}, now=1.0)
    assert again.action is Action.START


def test_a_change_that_lost_nothing_is_not_rolled_back() -> None:
    rollback = survival_check(state(), {"a"}, now=100.0)
    assert rollback.action is Action.ROLLBACK and rollback.left == frozenset({"b"})
    spared = spare_what_lost_nothing(rollback, frozenset({"b"}))
    assert spared.action is Action.REASSIGN and "gracefully" in spared.reason
    assert (spared.generation, spared.workers) == (rollback.generation, rollback.workers)
    # Joins alone, and joins beside graceful leaves, lost nothing either.
    joins = survival_check(state(), {"a", "b", "c"}, now=100.0)
    assert joins.action is Action.ROLLBACK and joins.joined == frozenset({"c"})
    spared_joins = spare_what_lost_nothing(joins, frozenset())
    assert spared_joins.action is Action.REASSIGN and "only joins" in spared_joins.reason
    assert (spared_joins.generation, spared_joins.workers) == (joins.generation, joins.workers)
    swap = survival_check(state(), {"a", "c"}, now=100.0)
    assert spare_what_lost_nothing(swap, frozenset({"b"})).action is Action.REASSIGN
    # A loss among the leaves keeps the policy's rollback, with or without a join beside it.
    both = survival_check(state(workers=frozenset({"a", "b", "c"})), {"a"}, now=100.0)
    assert spare_what_lost_nothing(both, frozenset({"b"})).action is Action.ROLLBACK
    assert spare_what_lost_nothing(swap, frozenset()).action is Action.ROLLBACK
    # Under reassign there is nothing to spare; nor in a start, or with no change at all.
    reassign = survival_check(state(policy="reassign"), {"a"}, now=100.0)
    assert spare_what_lost_nothing(reassign, frozenset({"b"})) == reassign
    start = survival_check(state(workers=frozenset()), {"a"}, now=100.0)
    assert spare_what_lost_nothing(start, frozenset()) == start
    unchanged = survival_check(state(), {"a", "b"}, now=100.0)
    assert spare_what_lost_nothing(unchanged, frozenset()) == unchanged
