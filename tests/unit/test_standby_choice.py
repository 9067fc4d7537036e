"""Which standby takes a lost data server's role (`training.workers.readiest_first`): a pure choice, tested
without a cluster."""

from __future__ import annotations

from prefect_elastic.training.workers import readiest_first


def test_a_warmed_standby_is_chosen_before_one_still_warming_and_one_never_warmed() -> None:
    free = ("s2", "s3", "s4")
    assert readiest_first(free, warm={"s4"}, warming={"s3"}) == ["s4", "s3", "s2"]
    assert readiest_first(free, warm=set(), warming={"s3"})[0] == "s3"


def test_standbys_alike_keep_the_order_given() -> None:
    free = ("s3", "s2", "s4")
    assert readiest_first(free, warm={"s2", "s3"}, warming=set()) == ["s3", "s2", "s4"]
    assert readiest_first(free, warm=set(), warming=set()) == list(free)


def test_a_lone_standby_silent_for_a_moment_is_waited_for() -> None:
    from prefect_elastic.training.workers import pass_over_standby

    # Heard from: kept, whatever else is free.
    assert not pass_over_standby(listed=True, silent_for=None, another_free=True, patience=10.0)
    # Silent for a moment (busy with its start) and no other standby: its start goes on.
    assert not pass_over_standby(listed=True, silent_for=3.0, another_free=False, patience=10.0)
    # Silent with another standby heard from: that one takes the role.
    assert pass_over_standby(listed=True, silent_for=3.0, another_free=True, patience=10.0)
    # Silent past the patience (frozen, cut off): given up, for the next to join.
    assert pass_over_standby(listed=True, silent_for=10.5, another_free=False, patience=10.0)
    # Gone from the scheduler's list.
    assert pass_over_standby(listed=False, silent_for=None, another_free=False, patience=10.0)
