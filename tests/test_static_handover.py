"""A static worker that leaves with roles: retired gracefully or SIGTERMed, it hands its data server and
the coordinator over from where they stand, with no committed step redone, even under `rollback`; a
retire that no standby can take yet waits for one; one killed in the middle of its hand-over is a loss
the job survives. (A data server lost to a standby: test_static_roles.py.)"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import psutil
import pytest
import torch

from prefect_elastic import train
from prefect_elastic.data_server import DataServer
from prefect_elastic.local import slow
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.messages import EventKind, Progress
from prefect_elastic.wire.signals import RecoverableError

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    in_process_servers,
    make_job,
    top_up,
    wait_for,
)
from .models import GATE
from .test_static_roles import Placement, top_up_static

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.mark.parametrize("role", ["data-server", "coordinator"])
def test_a_static_worker_retired_gracefully_hands_its_roles_over_with_no_step_redone(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str, role: str
) -> None:
    """`Client.retire_workers` on a static worker with a role (the scheduler refuses it while the worker
    holds an actor): the controller stops at a step every shard applied, snapshots it, hands the roles to
    a standby and another static worker, then retires the worker. No committed step is redone, even under
    `rollback`. (The coordinator's worker holds data server 0 too: both are handed over.)"""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(digits_url, "rollback", job_id=f"retire-{role}", model="tests.models:gated_slow_mlp")
    placement = Placement()
    asked: list[str] = []
    refused: list[object] = []
    faults = FaultSchedule().retire_coordinator(at_step=12)

    def retire_at_step_12(p: Progress) -> None:
        placement(p)
        if asked or p.committed_steps < 12:
            return
        if role == "coordinator":  # the tool for tests and rehearsals
            faults.apply(p)
            asked.extend(r.target for r in faults.log)
            return
        asked.append(p.data_servers[1])  # as a user (or a cluster scaling down) does it
        with static_cluster.client() as client:
            refused.append(client.retire_workers([asked[0]], close_workers=True))

    faults.bind(static_cluster)
    result = train(job, cluster=static_cluster, on_progress=retire_at_step_12)
    faults.wait(timeout=60)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (worker,) = asked
    assert refused == ([{}] if role == "data-server" else []), "the scheduler alone refuses to retire it"
    static_cluster.wait_until_gone([worker], timeout=30)
    last = placement.seen[-1]
    assert worker not in last.data_servers and last.coordinator_at != worker
    redone = [(e.kind, e.steps_lost, e.reason) for e in result.events if e.steps_lost]
    assert not redone, f"no committed step was redone: {redone}"
    handed = [e for e in result.events if e.kind == EventKind.SHARD_LOST]
    assert handed and all("retiring" in e.reason for e in handed)
    assert result.counters["promotions"] == len(handed) == 1
    assert result.counters["coordinator_rebuilds"] == (1 if role == "coordinator" else 0)


@pytest.mark.heavy  # (a cluster of its own, about a minute: in .ci/run's second stage)
def test_a_retire_that_no_standby_can_take_yet_waits_for_one_and_loses_nothing(
    reference: References, digits_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`Client.retire_workers` on data server 1's static worker while no standby can take its role (none
    is there; in CI, a standby whose heartbeats a loaded machine delayed, which once made a SIGTERMed worker's
    hand-over give up for good): the controller says so once and keeps asking. A static worker that joins
    then takes the role from where it stands, and the worker is retired: no committed step redone."""
    job = make_job(
        digits_url, "rollback", job_id="retire-waits", model="tests.models:gated_slow_mlp", epochs=4
    )
    placement = Placement()
    asked: list[str] = []
    joined: list[str] = []
    waiting = "no standby can take data servers [1] now"  # (the warning, said once)

    with LocalElasticCluster(static_workers=2, elastic_workers=2) as cluster:

        def retire_then_start_a_standby(p: Progress) -> None:
            placement(p)
            if p.committed_steps < 12 or p.state != "running" or joined:
                return
            if not asked:
                asked.append(p.data_servers[1])
                GATE.touch()  # training waits at step 12 or so until a standby is there
                with cluster.client() as client:
                    client.retire_workers([asked[0]], close_workers=True)
            elif any(waiting in r.getMessage() for r in caplog.records):
                joined.append(cluster.add_worker(static=True))
                GATE.unlink(missing_ok=True)

        try:
            result = train(job, cluster=cluster, on_progress=retire_then_start_a_standby)
        finally:
            GATE.unlink(missing_ok=True)
        (worker,), (standby,) = asked, joined
        cluster.wait_until_gone([worker], timeout=30)
        new_home = placement.seen[-1].data_servers[1]
        assert str(cluster.workers_info()[new_home]["name"]) == standby, "data server 1 went to the standby"

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert sum(waiting in r.getMessage() for r in caplog.records) == 1, "said once, not at every check"
    assert worker not in placement.seen[-1].data_servers
    redone = [(e.kind, e.steps_lost, e.reason) for e in result.events if e.steps_lost]
    assert not redone, f"no committed step was redone: {redone}"
    handed = [e for e in result.events if e.kind == EventKind.SHARD_LOST]
    assert len(handed) == 1 and "retiring" in handed[0].reason
    assert result.counters["promotions"] == 1


def test_shards_held_for_a_hand_over_stop_at_one_version_whatever_order_the_holds_reach_them_in(
    digits_url: str,
) -> None:
    """The coordinator read both shards at version 0 and holds them at 1, but meanwhile both applied step 0
    and sent step 1's parameters, and the hold reaches the first shard before step 1's pushes and the
    second after it applied them. The first keeps those pushes unapplied (a held shard applies no step from
    its hold on), the coordinator then holds both at the newer version 2, which the first reaches from
    the pushes it kept, and neither moves until the fence, which finds them equal. (Refusing the pushes
    instead left the first a version behind for good; taking and applying them let a shard step past the
    version the fence then found the other at: either way the hand-over went back to the snapshot.)"""
    (first, second), plan = in_process_servers(digits_url)
    both = (first, second)

    def push(shard: DataServer, names: list[str], step: int) -> Any:
        batches = shard._schedule.step_batches(step)
        grads = {b: {n: torch.zeros_like(t) for n, t in shard._params.items() if n in names} for b in batches}
        return shard.push(0, step, "tcp://worker", grads, {}, {b: 0.5 for b in batches})

    async def run() -> None:
        for step in (0, 1):
            assert all([await s.pull(0, step) for s in both]), "a worker has the parameters of the step"
            if step == 1:
                assert await first.hold_at(0, 1, wait=0) == 1
            await asyncio.gather(*(push(s, names, step) for s, names in zip(both, plan, strict=True)))
        assert (first.version, second.version) == (1, 2), "the first keeps step 1 unapplied"
        assert await second.hold_at(0, 1, wait=0) == 2
        assert [await s.hold_at(0, 2, wait=0) for s in both] == [2, 2], "the coordinator's second try"
        for shard in both:
            with pytest.raises(RecoverableError, match="holds at step 2"):
                await shard.pull(0, 2)
        assert [f.version for f in [await s.fence(1) for s in both]] == [2, 2]
        assert await first.pull(1, 2), "the fence lifts the hold"

    asyncio.run(run())


@pytest.mark.parametrize(
    "role",
    # (The coordinator's case in .ci/run's second stage, to keep the main suite short.)
    ["data-server", pytest.param("coordinator", marks=pytest.mark.heavy)],
)
def test_a_static_worker_killed_in_the_middle_of_its_hand_over_is_a_loss_the_job_survives(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str, role: str
) -> None:
    """A static worker asked to retire is SIGKILLed while it hands its roles over (a SLURM job's grace
    period that ends, a second signal): the hand-over gives up as soon as the worker is gone, its data
    server goes to the standby from its peer's replica of the last snapshot, as for any loss, and the
    coordinator (if it lived there) is rebuilt on another static worker. The result is bitwise the no-fault
    run's. (A hook holds the hand-over for longer than the job's call timeout: a loss found only when the
    call times out says so.)"""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(digits_url, "reassign", job_id=f"retire-killed-{role}", call_timeout=20.0)
    placement = Placement()
    asked: list[str] = []
    killer: list[threading.Timer] = []
    kill_errors: list[BaseException] = []

    def kill(worker: str) -> None:
        try:
            static_cluster.kill_worker(worker)
        except BaseException as exc:  # (a Timer's thread would drop it)
            kill_errors.append(exc)

    def retire_then_kill(p: Progress) -> None:
        placement(p)
        if asked or p.committed_steps < 12:
            return
        asked.append(p.coordinator_at if role == "coordinator" else p.data_servers[1])
        with static_cluster.client() as client:
            slow.register(client, slow.SlowHandOver(asked[0], 3 * job.call_timeout))
            client.retire_workers([asked[0]], close_workers=True)
        # The controller starts the hand-over within a liveness interval, and the hook holds it there.
        killer.append(threading.Timer(5 * job.liveness_interval, kill, (asked[0],)))
        killer[0].start()

    try:
        result = train(job, cluster=static_cluster, on_progress=retire_then_kill)
    finally:
        for timer in killer:
            timer.join()
        with static_cluster.client() as client:
            slow.clear(client)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert not kill_errors
    (worker,) = asked
    first, last = placement.seen[0], placement.seen[-1]
    index = first.data_servers.index(worker)
    assert last.data_servers[index] == first.standbys[0], "its data server now lives on the standby"
    assert worker not in last.data_servers and last.coordinator_at != worker
    kinds = [e.kind for e in result.events]
    assert result.counters["promotions"] == kinds.count(EventKind.PROMOTED) == 1
    assert kinds.count(EventKind.COORDINATOR_REBUILT) == (1 if role == "coordinator" else 0)
    if role == "data-server":  # (the coordinator's own record of the loss went with its worker)
        lost = [e.reason for e in result.events if e.kind == EventKind.SHARD_LOST]
        # Lost when its worker left (or refused the hand-over's call), not handed over (the hook holds
        # that for longer than the test), nor given up at the call timeout.
        assert lost and all(worker in r and ("left" in r or "is gone" in r) for r in lost), lost
        assert not any("no answer within" in r for r in lost), lost


@pytest.mark.heavy  # (about a minute for both: in .ci/run's second stage, to keep the main suite short)
@pytest.mark.parametrize("role", ["data-server", "coordinator"])
def test_a_static_worker_sigtermed_hands_its_roles_over_with_no_step_redone(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str, role: str
) -> None:
    """SIGTERM to a static worker's whole process group (nanny and worker, as SLURM's `scancel`, a
    pre-emption notice or `docker stop` send it): the worker asks to be retired instead of closing, the
    nanny leaves it the time, and the controller hands its roles over from where they stand before it goes:
    no committed step redone, even under `rollback`; then the worker and its nanny exit."""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(digits_url, "rollback", job_id=f"sigterm-{role}", model="tests.models:gated_slow_mlp")
    placement = Placement()
    signalled: list[str] = []
    names: list[str] = []

    def sigterm_at_step_12(p: Progress) -> None:
        placement(p)
        if signalled or p.committed_steps < 12:
            return
        signalled.append(p.coordinator_at if role == "coordinator" else p.data_servers[1])
        names.append(str(static_cluster.workers_info()[signalled[0]]["name"]))
        static_cluster.kill_worker(signalled[0], sig=signal.SIGTERM)

    result = train(job, cluster=static_cluster, on_progress=sigterm_at_step_12)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (worker,) = signalled
    static_cluster.wait_until_gone([worker], timeout=30)
    last = placement.seen[-1]
    assert worker not in last.data_servers and last.coordinator_at != worker
    redone = [(e.kind, e.steps_lost, e.reason) for e in result.events if e.steps_lost]
    assert not redone, f"no committed step was redone: {redone}"
    handed = [e for e in result.events if e.kind == EventKind.SHARD_LOST]
    assert handed and all("retiring" in e.reason for e in handed), [e.reason for e in handed]
    assert result.counters["coordinator_rebuilds"] == (1 if role == "coordinator" else 0)
    nanny = static_cluster.pid_of(names[0])
    assert nanny is not None
    wait_for("its nanny (and so the worker) to exit", lambda: exited(nanny), timeout=30)


def exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
