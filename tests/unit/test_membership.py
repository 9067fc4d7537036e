"""The controller's membership decision (`training.membership`) and the promotion's plan
(`training.recovery`), for each case of docs/faults.md that goes through them: pure, no cluster."""

from __future__ import annotations

from dataclasses import replace

from prefect_elastic.training.membership import (
    AskMembers,
    Check,
    HandOver,
    Hold,
    HoldRetire,
    MembershipState,
    Promote,
    RebuildCoordinator,
    Seen,
    check_due,
    checked,
    decide,
    look_due,
    looked,
    retire,
    role_changes,
    wait_for_group,
    wait_for_losses,
    wait_for_start,
)
from prefect_elastic.training.pacing import LOSS_GROUP_SECONDS
from prefect_elastic.training.recovery import (
    Again,
    kept_answered,
    peer_gone_during_start,
    peer_gone_while_asked,
    plan_recovery,
    replica_peer,
)

LIVENESS = 1.0


def members(*live: str) -> MembershipState:
    return MembershipState(known=tuple(live), next_check=100.0 + LIVENESS, next_look=100.25)


def seen(*live: str, **kw: object) -> Seen:
    fields: dict = {"starting": False, "pending": 0, "restarts": False, "triggered": True, "must_check": True}
    fields.update(kw)
    return Seen(live=tuple(live), **fields)


def test_a_compute_worker_lost_is_a_check_once_the_members_left_answered() -> None:
    decision = decide(members("a", "b", "c"), seen("a", "b"), 100.0, LIVENESS)
    assert isinstance(decision, AskMembers) and decision.workers == {"a", "b"}
    assert decision.seconds == LOSS_GROUP_SECONDS
    answered = decide(decision.state, seen("a", "b", answering=frozenset({"a", "b"})), 100.0, LIVENESS)
    assert isinstance(answered, Check) and answered.live == ("a", "b") and answered.reason == "worker event"
    assert answered.state.known == ("a", "b") and answered.state.loss_since is None


def test_two_kills_within_the_loss_window_are_one_change() -> None:
    # c is gone; b does not answer (it is dying too): the check waits for it.
    first = decide(members("a", "b", "c"), seen("a", "b", answering=frozenset({"a"})), 100.0, LIVENESS)
    assert isinstance(first, Hold) and first.check_soon
    # b is gone a few milliseconds later: one check, both lost.
    then = decide(first.state, seen("a", answering=frozenset({"a"})), 100.01, LIVENESS)
    assert isinstance(then, Check) and then.live == ("a",)
    # The window is bounded: past it, the check goes on whoever answers.
    late = decide(first.state, seen("a", "b"), 100.0 + 2 * LOSS_GROUP_SECONDS, LIVENESS)
    assert isinstance(late, Check) and late.live == ("a", "b")


def test_a_graceful_leave_is_checked_like_any_change() -> None:
    # (The coordinator's survival_check spares it the rollback: survival.spare_what_lost_nothing.)
    decision = decide(members("a", "b"), seen("a", answering=frozenset({"a"})), 100.0, LIVENESS)
    assert isinstance(decision, Check) and decision.live == ("a",)


def test_a_nanny_restart_is_a_leave_then_a_join() -> None:
    left = decide(members("a", "b"), seen("a", answering=frozenset({"a"})), 100.0, LIVENESS)
    assert isinstance(left, Check) and left.live == ("a",)
    state = checked(left.state, 100.1, starting=False, liveness_interval=LIVENESS)
    back = decide(state, seen("a", "b2"), 100.5, LIVENESS)
    assert isinstance(back, Check) and back.live == ("a", "b2")


def test_a_join_is_admitted_once_it_runs_not_while_it_starts() -> None:
    # Only an add-worker event: the worker is not running yet, so the check waits for its turn.
    held = decide(members("a"), seen("a", starting=True, must_check=False), 100.0, LIVENESS)
    assert isinstance(held, Hold) and not held.check_soon
    running = decide(held.state, seen("a", "b", must_check=False), 100.05, LIVENESS)
    assert isinstance(running, Check) and running.live == ("a", "b")


def test_a_group_of_joins_is_held_while_more_are_on_their_way_for_at_most_a_liveness_interval() -> None:
    held = decide(members("a"), seen("a", "b", pending=3), 100.0, LIVENESS)
    assert isinstance(held, Hold) and held.state.group_since == 100.0
    still = decide(held.state, seen("a", "b", "c", pending=2), 100.5, LIVENESS)
    assert isinstance(still, Hold) and still.state.group_since == 100.0, "the first join's wait counts"
    bounded = decide(still.state, seen("a", "b", "c", pending=2), 100.0 + LIVENESS, LIVENESS)
    assert isinstance(bounded, Check) and bounded.live == ("a", "b", "c")
    whole = decide(held.state, seen("a", "b", "c", "d", "e"), 100.3, LIVENESS)
    assert isinstance(whole, Check), "the group is whole"


def test_a_frozen_member_is_out_once_the_view_drops_it_after_its_silence() -> None:
    # The view leaves out a member silent past the limit that did not answer the handshake
    # (workers.classify); a look between checks sees the change and triggers the check.
    state, changed = looked(members("a", "b"), 100.3, ["a"], starting=False, loops_ended=False)
    assert changed and state.next_look > 100.3
    decision = decide(state, seen("a", triggered=changed, answering=frozenset({"a"})), 100.3, LIVENESS)
    assert isinstance(decision, Check) and decision.live == ("a",)


def test_a_starving_member_that_answers_the_handshake_is_kept() -> None:
    # Silent to the scheduler, it answered Dask's handshake: the view keeps it live, so nothing changed.
    state, changed = looked(members("a", "b"), 100.3, ["a", "b"], starting=False, loops_ended=False)
    assert not changed and not check_due(state, 100.3, triggered=False)
    # At the interval the check runs, on the same members.
    decision = decide(state, seen("a", "b", triggered=False, must_check=False), 101.0, LIVENESS)
    assert isinstance(decision, Check) and decision.reason == "interval" and decision.live == ("a", "b")


def test_the_timers_say_when_to_look_and_when_to_check() -> None:
    state = checked(MembershipState(), 100.0, starting=True, liveness_interval=LIVENESS)
    assert state.next_check == 101.0 and state.next_look < 100.1, "a starting worker is looked at soon"
    assert not look_due(state, 100.0, triggered=False) and look_due(state, 100.1, triggered=False)
    assert not look_due(state, 100.1, triggered=True), "an event checks at once instead"
    assert check_due(state, 100.0, triggered=True) and check_due(state, 101.0, triggered=False)


def test_a_data_servers_static_worker_lost_promotes_a_standby() -> None:
    assert role_changes("s1", ["s1", "s2", "s3"], ("s1", "s3", "s4")) == (Promote((1,)),)
    assert role_changes("s1", ["s1", "s2"], ("s1", "s2")) == (), "nothing lost"


def test_the_coordinators_worker_lost_rebuilds_it_first() -> None:
    changes = role_changes("s1", ["s1", "s2"], ("s2", "s3"))
    assert len(changes) == 1 and isinstance(changes[0], RebuildCoordinator), "its data servers come after"


def test_a_loss_the_coordinator_reported_promotes_once_whatever_else_is_lost() -> None:
    assert role_changes("s1", ["s1", "s2", "s3"], ("s1", "s3"), reported=(1, 2)) == (Promote((1, 2)),)
    # (Reported after its promotion, the index's key no longer matches and the coordinator drops it:
    # `shards_lost` is keyed; nothing out of range is promoted here.)
    assert role_changes("s1", ["s1", "s2"], ("s1", "s2"), reported=(5,)) == ()


def test_retire_hands_over_or_waits_when_no_standby_can_take_its_data_servers() -> None:
    assert retire("s2", ["s1", "s2"], "s1", free=("s3",)) == HandOver("s2", (1,), False)
    assert retire("s2", ["s1", "s2"], "s1", free=()) == HoldRetire("s2", (1,))
    assert retire("s1", ["s2", "s2"], "s1", free=()) == HandOver("s1", (), True), "a coordinator needs none"
    assert retire("s9", ["s1"], "s1", free=()) == HandOver("s9", (), False), "holds nothing: retired"


def test_a_lost_data_server_with_its_replica_on_a_live_peer_comes_back_from_it() -> None:
    assert replica_peer(1, lost=[1], shards=3, peer_replicas=True) == 2
    plan = plan_recovery([1], 3, {1: 8}, {1: 0}, {1: True}, peer_replicas=True, ask=True)
    assert plan.from_replica == (1,) and not plan.back_to_checkpoint and plan.ask_first == ()


def test_a_data_server_still_at_the_start_comes_back_from_the_start() -> None:
    plan = plan_recovery([0], 2, {0: 0}, {0: 0}, {}, peer_replicas=True, ask=True)
    assert plan.from_start == (0,) and not plan.back_to_checkpoint


def test_a_shard_lost_with_its_replica_goes_back_to_the_checkpoint_after_asking() -> None:
    assert replica_peer(0, lost=[0, 1], shards=2, peer_replicas=True) is None, "its peer is lost too"
    plan = plan_recovery([1, 0], 2, {0: 8, 1: 8}, {0: 0, 1: 0}, {}, peer_replicas=True, ask=True)
    assert plan.lost == (0, 1) and plan.unrestorable == (0, 1) and plan.back_to_checkpoint
    assert plan.ask_first == (0, 1), "only silent, they would keep their roles"
    assert "lost with it" in plan.why
    again = plan_recovery([1, 0], 2, {0: 8, 1: 8}, {0: 0, 1: 0}, {}, peer_replicas=True, ask=False)
    assert again.ask_first == () and again.back_to_checkpoint, "asked once, not again"


def test_without_peer_replicas_a_lost_shard_past_the_start_goes_back_to_the_checkpoint() -> None:
    assert replica_peer(0, lost=[0], shards=2, peer_replicas=False) is None
    plan = plan_recovery([0], 2, {0: 4}, {0: 0}, {}, peer_replicas=False, ask=False)
    assert plan.back_to_checkpoint and "peer_replicas=False" in plan.why


def test_a_plan_made_again_when_the_peer_dies_counts_the_peer_lost() -> None:
    first = plan_recovery([1], 3, {1: 8}, {1: 0}, {1: True}, peer_replicas=True, ask=True)
    assert first.from_replica == (1,)
    # The peer (2) died while 1 started: the plan is made again with both lost, 2's replica on 0.
    again = plan_recovery([1, 2], 3, {1: 8, 2: 8}, {1: 0, 2: 0}, {2: True}, peer_replicas=True, ask=True)
    assert again.from_replica == (2,) and again.unrestorable == (1,)
    assert "held by data server 2, lost with it" in again.why


def test_the_next_round_of_a_promotion_has_the_arguments_of_the_old_recursion() -> None:
    """What `Promotions.promote` makes its plan again with (before 4de0128 `promote_standbys` called itself
    with these arguments)."""
    # The peer's worker (holding 2 and 4) died while asked for its replica: its data servers are lost too,
    # and asking stays as it was.
    assert peer_gone_while_asked([3, 1], on_peer=[2, 4], ask=True) == Again((1, 2, 3, 4), True)
    assert peer_gone_while_asked([1], on_peer=[2], ask=False) == Again((1, 2), False)
    # 1 was promoted; 3's peer (4) died while 3 started from its replica: 3, those after it and the peer.
    assert peer_gone_during_start([1, 3, 5], 3, shards=6, asked=False) == Again((3, 4, 5), True)
    assert peer_gone_during_start([4, 5], 5, shards=6, asked=False) == Again((0, 5), True), "(the ring)"
    assert peer_gone_during_start([1], 1, shards=3, asked=True).ask is False, "asked this round: not again"
    # Some answered: they keep their roles, the rest are promoted without asking again.
    assert kept_answered([0, 1, 2], kept=[1]) == Again((0, 2), False)
    assert kept_answered([1], kept=[1]) == Again((), False), "nothing left: the round ends"


def test_no_standby_waits_then_fails() -> None:
    # (The wait itself, up to min_workers_timeout, is `StandbyChoice.wait_for_standby`'s; the decision
    # of a retire with no standby is to hold it.)
    assert isinstance(retire("s1", ["s1"], "s1", free=()), HoldRetire)
    state = replace(members("a"), next_check=0.0)
    assert check_due(state, 1.0, triggered=False)


def test_joins_wait_for_the_rest_of_their_group_but_a_loss_never_waits() -> None:
    assert wait_for_group({"a"}, {"a", "b"}, pending=3, waited=0.2, limit=1.0), "3 more on their way"
    assert not wait_for_group({"a"}, {"a", "b"}, pending=0, waited=0.0, limit=1.0), "the group is complete"
    assert not wait_for_group({"a"}, {"a", "b"}, pending=3, waited=1.0, limit=1.0), "waited a whole interval"
    assert not wait_for_group({"a", "b"}, {"a", "c"}, pending=3, waited=0.0, limit=1.0), "b was lost"
    assert not wait_for_group({"a", "b"}, {"a"}, pending=3, waited=0.0, limit=1.0)
    assert not wait_for_group({"a"}, {"a"}, pending=3, waited=0.0, limit=1.0), "no change"


def test_losses_wait_a_moment_for_the_rest_of_their_group() -> None:
    assert wait_for_losses({"a", "b", "c"}, {"a"}, waited=0.01, window=0.05), "more may be on their way out"
    assert not wait_for_losses({"a", "b", "c"}, {"a"}, waited=0.05, window=0.05), "the window is over"
    assert not wait_for_losses({"a"}, {"a", "b"}, waited=0.0, window=0.05), "joins are not losses"
    assert wait_for_losses({"a", "b"}, {"a", "c"}, waited=0.0, window=0.05), "a loss beside a join"
    assert not wait_for_losses({"a"}, {"a"}, waited=0.0, window=0.05), "no change"
    # Members still listed that accept connections are alive: none of them is on its way out.
    assert not wait_for_losses({"a", "b", "c"}, {"a", "c"}, 0.0, 0.05, answering={"a", "c"}), "only b left"
    assert wait_for_losses({"a", "b", "c"}, {"a", "c"}, 0.0, 0.05, answering={"a"}), "c may be dying too"
    assert not wait_for_losses({"a", "b"}, {"a", "c"}, 0.0, 0.05, answering={"a"}), "a join need not answer"
    assert not wait_for_losses({"a", "b"}, set(), 0.0, 0.05), "every member is gone: no one to wait for"


def test_a_check_waits_for_a_worker_that_is_still_starting_only_when_nothing_else_changed() -> None:
    assert wait_for_start(["a"], ["a"], starting=True, restarts=False), "the joiner is not running yet"
    assert not wait_for_start(["a"], ["a"], starting=False, restarts=False), "nobody is starting"
    assert not wait_for_start(["a", "b"], ["a"], starting=True, restarts=False), "b was lost meanwhile"
    assert not wait_for_start(["a"], ["a", "c"], starting=True, restarts=False), "c is running: admit it"
    assert not wait_for_start(["a"], ["a"], starting=True, restarts=True), "a's loop starts over"
