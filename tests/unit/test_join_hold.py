"""Which membership changes let the step in flight end before the fence
(`coordinator.actor.finishes_the_step_in_flight`): a pure choice, tested without a cluster."""

from __future__ import annotations

from prefect_elastic.coordinator.actor import finishes_the_step_in_flight
from prefect_elastic.coordinator.survival import (
    Decision,
    Policy,
    SurvivalState,
    spare_what_lost_nothing,
    survival_check,
)


def decide(before: set[str], live: set[str], policy: Policy = "reassign") -> Decision:
    state = SurvivalState(
        generation=3, workers=frozenset(before), policy=policy,
        min_workers=1, min_workers_timeout=60.0, committed_steps=10, snapshot_step=8,
    )  # fmt: skip
    return survival_check(state, live, now=0.0)


def test_only_joins_under_reassign_let_the_step_in_flight_end() -> None:
    assert finishes_the_step_in_flight(decide({"a", "b"}, {"a", "b", "c"}))


def test_joins_under_rollback_let_it_end_too_once_spared() -> None:
    joins = decide({"a", "b"}, {"a", "b", "c"}, policy="rollback")
    assert finishes_the_step_in_flight(spare_what_lost_nothing(joins, frozenset()))


def test_a_loss_a_rollback_or_a_start_fences_at_once() -> None:
    lost = decide({"a", "b"}, {"a"})
    lost_and_joined = decide({"a", "b"}, {"a", "c"})
    rollback = decide({"a", "b"}, {"a", "b", "c"}, policy="rollback")
    start = decide(set(), {"a"})
    unchanged = decide({"a"}, {"a"})
    for decision in (lost, lost_and_joined, rollback, start, unchanged):
        assert not finishes_the_step_in_flight(decision), decision
