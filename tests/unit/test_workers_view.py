"""The controller's view of the workers (`training.workers.classify`): a pure decision from the scheduler's
rows, tested without a cluster; and what the static workers' watch (`Workers`) is told and says back."""

from __future__ import annotations

from typing import Any

from prefect_elastic.training.workers import Roles, WorkersView, classify, standbys


def row(
    address: str, *, static: bool = False, status: str = "running", silent: float = 0.0
) -> dict[str, Any]:
    return {
        "address": address,
        "name": address,
        "status": status,
        "silent": silent,
        "silent_limit": 1.25,
        "resources": {"static": 1} if static else {},
    }


def view(rows: list[dict[str, Any]], roles: Roles, loaded: set[str] | None = None, **kw: Any) -> WorkersView:
    addresses = {r["address"] for r in rows}
    return classify(
        rows, kw.pop("graceful", ()), static_resource="static", silent_after=1.0, now=100.0,
        answered_at=kw.pop("answered_at", {}), loaded=addresses if loaded is None else loaded, roles=roles,
        **kw,
    )  # fmt: skip


def test_live_members_are_running_heard_and_loaded_elastic_workers() -> None:
    rows = [row("e1"), row("e2", silent=5.0), row("e3", status="init"), row("e4"), row("s1", static=True)]
    v = view(rows, Roles(["s1"], "s1"), loaded={"e1", "e2", "e3"})
    assert v.live == ["e1"], "silent, starting and not-yet-loaded workers are not members"
    assert v.starting, "one is still starting (init), and e4 has not loaded the engine"
    assert v.listed == {"e1", "e2", "e3", "e4"}, "a frozen worker stays listed"
    assert v.static == ("s1",)


def test_a_silent_member_that_answered_a_direct_call_lately_is_still_live() -> None:
    rows = [row("e1"), row("e2", silent=5.0), row("s1", static=True)]
    assert view(rows, Roles(["s1"], "s1")).live == ["e1"]
    assert view(rows, Roles(["s1"], "s1"), answered_at={"e2": 99.5}).live == ["e1", "e2"]
    assert view(rows, Roles(["s1"], "s1"), answered_at={"e2": 98.0}).live == ["e1"], "that answer is old"


def test_a_silent_role_holder_is_silent_only_while_a_heard_standby_can_take_its_role() -> None:
    rows = [row("s1", static=True, silent=5.0), row("s2", static=True), row("s3", static=True)]
    v = view(rows, Roles(["s1", "s2"], "s2"))
    assert v.static == ("s2", "s3") and v.silent_static == {"s1"}
    assert standbys(v.static, ["s1", "s2"]) == ("s3",)
    # Without a standby heard from, the silent holder keeps its place: declaring it lost would fail the job.
    v = view(rows[:2], Roles(["s1", "s2"], "s2"))
    assert v.static == ("s1", "s2") and not v.silent_static


def test_an_answer_to_a_direct_call_counts_as_a_heartbeat() -> None:
    rows = [row("s1", static=True, silent=5.0), row("s2", static=True)]
    assert view(rows, Roles(["s1"], "s1")).silent_static == {"s1"}
    assert view(rows, Roles(["s1"], "s1")).silence == {"s1": 5.0}, "how long it has been silent"
    assert view(rows, Roles(["s1"], "s1"), answered_at={"s1": 97.0}).silence == {"s1": 3.0}
    assert view(rows, Roles(["s1"], "s1"), answered_at={"s1": 99.5}).static == ("s1", "s2")


def test_the_coordinators_silent_worker_is_kept_where_its_loss_would_end_the_job() -> None:
    rows = [row("s1", static=True), row("s2", static=True, silent=5.0), row("s3", static=True)]
    assert view(rows, Roles(["s1"], "s2")).silent_static == {"s2"}
    kept = view(rows, Roles(["s1"], "s2", keep_silent_coordinator=True))
    assert kept.static == ("s1", "s2", "s3") and not kept.silent_static


def test_workers_a_cluster_started_but_the_scheduler_does_not_list_yet_are_pending() -> None:
    rows = [row("e1"), row("s1", static=True)]
    assert view(rows, Roles(["s1"], "s1"), requested={"e1", "e2", "e3"}).pending == 2
    assert view(rows, Roles(["s1"], "s1"), graceful=["gone"]).graceful == {"gone"}


def test_the_static_workers_watch_is_told_what_happened_and_says_it_back() -> None:
    """`Workers`' own state (no view read here): who left, and the retire requests with their waits."""
    from prefect_elastic.training.role_table import RoleTable
    from prefect_elastic.training.workers import Workers

    members = ("a", "b")
    watch = Workers(None, None, None, RoleTable(), None, None, lambda: members)  # type: ignore[arg-type]
    assert watch.members == ("a", "b"), "the membership's, not a copy"
    watch.worker_left("s3")
    assert watch.has_left("s3")
    watch.placed_on("s3")
    assert not watch.has_left("s3"), "a role placed there again: its next leave counts"
    watch.retire_asked(["s2", "s1"])
    assert watch.retire_requests() == ["s1", "s2"]
    watch.retire_taken("s1")
    assert watch.retire_requests() == ["s2"], "taken before its hand-over: not tried again if it raises"
    assert watch.retire_waits("s1") and not watch.retire_waits("s1"), "said once while it waits"
    assert watch.retire_requests() == ["s1", "s2"], "asked again at the next check"
    watch.retire_taken("s1")
    watch.handing_over("s1")
    assert watch.retire_waits("s1"), "a new wait after a hand-over began is said again"
