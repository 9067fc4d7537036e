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
