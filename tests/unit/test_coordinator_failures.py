"""The coordinator's bookkeeping (`CoordinatorState`) when something fails, on event sequences, without any
cluster: a failure recorded once; a lost data server suspends training until a standby holds it; a worker
whose model failed is excluded and the others take its share; the same batch failing on two workers, or
every member excluded, fails the job naming them."""

from __future__ import annotations

import pytest

from prefect_elastic.coordinator import Exclusions, Failure
from prefect_elastic.coordinator.survival import Action, survival_check
from prefect_elastic.errors import FatalError
from prefect_elastic.messages import EventKind

from .test_coordinator_state import admit, new_state, snapshot_at_two


def test_a_failure_is_recorded_once() -> None:
    state = new_state()
    admit(state, {"a"})
    assert [e.kind for e in state.fail(Failure("model", "boom", 0, 3), now=1.0)] == [EventKind.FAILED]
    assert state.fail(Failure("internal", "again", None), now=2.0) == []
    progress = state.progress()
    assert (progress.state, progress.failure_kind, progress.failure_batch) == ("failed", "model", 3)


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_a_lost_data_server_suspends_training_until_a_standby_holds_it(policy: str) -> None:
    state = new_state(policy)
    state.channels = (("h", 1), ("h", 2))
    admit(state, {"a", "b"})
    snapshot_at_two(state)
    before = state.generation
    events = state.lose_shard(1, before + 1, "static worker w1 left", now=3.0)
    assert [(e.kind, e.batches_dropped) for e in events] == [(EventKind.SHARD_LOST, 4)]
    assert state.lose_shard(1, before + 1, "again", now=3.1) == [], "a loss is recorded once"
    assert state.progress().lost_shards == (1,)
    assert state.role("a", -1) is None and state.holding() == (), "no role while a shard is lost"
    # Everything after the last snapshot is undone with either policy: the replica is of that snapshot.
    event = state.promote_shard(1, "w3", before + 2, ("h", 9), now=4.0, began=3.5)
    assert (event.kind, event.step, event.steps_lost) == (EventKind.PROMOTED, 2, 1)
    assert event.generation == before + 2
    assert "standby w3" in event.reason
    assert (state.committed_steps, state.history, state.lost) == (2, [1.5, 5.5], set())
    assert state.counters["promotions"] == 1 and state.ledger.dropped_steps == 1
    role = state.role("a", -1)
    assert role is not None and role.generation == before + 2 and role.start_step == 2
    assert role.channels == (("h", 1), ("h", 9)), "the role says where the promoted shard listens"


def test_promoting_a_shard_that_was_not_lost_is_a_bug() -> None:
    state = new_state()
    admit(state, {"a"})
    with pytest.raises(FatalError, match="not lost"):
        state.promote_shard(0, "w", 5, ("h", 1), now=1.0, began=1.0)


def test_a_worker_whose_model_failed_is_excluded_and_the_next_check_takes_its_share() -> None:
    state = new_state("reassign")
    admit(state, {"a", "b"})
    [event] = state.model_failed("b", 0, 1, "CUDA error on b", now=3.0)
    assert event.kind is EventKind.EXCLUDED and event.left == ("b",) and "CUDA error on b" in event.reason
    assert state.failure is None and state.excluded == {"b": "CUDA error on b"}
    # The coordinator's next check leaves the excluded worker out, as if it had left: "a" takes all.
    live = {w for w in {"a", "b"} if w not in state.excluded}
    decision = survival_check(state.survival_state(), live, now=4.0)
    assert decision.action is Action.REASSIGN and decision.workers == frozenset({"a"})


def test_the_same_batch_failing_on_two_workers_fails_the_job_naming_both() -> None:
    state = new_state()
    admit(state, {"a", "b", "c"})
    state.model_failed("a", 0, 2, "boom on a", now=3.0)
    events = state.model_failed("b", 0, 2, "boom on b", now=4.0)
    assert [e.kind for e in events] == [EventKind.FAILED]
    failure = state.failure
    assert failure is not None and failure.kind == "model" and (failure.step, failure.batch_id) == (0, 2)
    assert "batch 2 of step 0" in failure.message and "a, b" in failure.message
    assert "boom on a" in failure.message and "boom on b" in failure.message
    assert "b" not in state.excluded, "the batch, not the second worker, is at fault"


def test_every_member_excluded_fails_the_job() -> None:
    state = new_state()
    admit(state, {"a", "b"})
    state.model_failed("a", 0, 1, "bad driver on a", now=3.0)
    events = state.model_failed("b", 0, 3, "bad driver on b", now=4.0)
    assert [e.kind for e in events] == [EventKind.EXCLUDED, EventKind.FAILED]
    assert state.failure is not None and "every compute worker was excluded" in state.failure.message
    assert "step 0, batch 3" in state.failure.message


def test_a_worker_is_excluded_once_and_the_job_fails_on_a_second_worker_or_none_left() -> None:
    exclusions = Exclusions()
    assert exclusions.model_failed("a", 0, 3, "boom on a") is None
    assert exclusions.excluded == {"a": "boom on a"}
    assert exclusions.none_left(["a", "b"], 0, 3) is None
    left = exclusions.none_left(["a"], 0, 3)
    assert left is not None and "every compute worker was excluded" in left.message
    twice = exclusions.model_failed("b", 0, 3, "boom on b")
    assert twice is not None and (twice.kind, twice.step, twice.batch_id) == ("model", 0, 3)
    assert "failed on 2 workers (a, b)" in twice.message and "b" not in exclusions.excluded
    whole = Exclusions().model_failed("c", 4, None, "no batch")
    assert whole is not None and whole.message.startswith("step 4 failed on 1 workers (c)")
