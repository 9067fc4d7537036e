"""Static workers are machines too: a data server's static worker SIGKILLed mid-run, and a
standby static worker takes its role from the peer's in-memory replica of the last snapshot. The result is
still bitwise equal to the one-worker, no-fault run, and every batch id is committed once. When nothing
can take over, the job fails with a `DataServerLostError` that says what to do. (The coordinator's loss and
shards lost with their replicas: test_static_rebuild.py; a static worker that leaves with its roles:
test_static_handover.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefect_elastic import ElasticJob, train
from prefect_elastic.coordinator import Coordinator, CoordinatorSpec
from prefect_elastic.coordinator.survival import Policy
from prefect_elastic.errors import DataServerLostError
from prefect_elastic.local import slow
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.messages import EventKind, Progress
from prefect_elastic.training import prepare
from prefect_elastic.training.calls import settled_result
from prefect_elastic.training.signals import StartCancelled

from .conftest import (
    HoldUntilJoined,
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    in_process_servers,
    make_job,
    top_up,
)
from .models import GATE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

POLICIES = ["rollback", "reassign"]


def top_up_static(cluster: LocalElasticCluster, static: int) -> None:
    """Start static workers until `static` are alive (tests here kill them)."""
    cluster.wait_for_pending()
    missing = static - len(cluster.static_addresses())
    names = [cluster.add_worker(static=True, wait=False) for _ in range(max(0, missing))]
    cluster.wait_for_workers(names)


class Placement:
    """Where the job's roles lived, from the progress the controller reports."""

    def __init__(self) -> None:
        self.seen: list[Progress] = []

    def __call__(self, progress: Progress) -> None:
        if not self.seen or progress.data_servers != self.seen[-1].data_servers:
            self.seen.append(progress)


class KillWhenSnapshotted:
    """Holds training (`tests.models:gated_slow_mlp`) at each step of `at` or later until a snapshot of
    where it stands is confirmed (so its copy is on the peer), then SIGKILLs the static worker of data server
    `index` and lets training go on: each promotion then restores a snapshot past the start (or past the
    last promotion), whatever the timing."""

    def __init__(self, cluster: LocalElasticCluster, index: int, at: tuple[int, ...] = (12,)) -> None:
        self.cluster = cluster
        self.index = index
        self.at = list(at)
        self.killed: list[str] = []
        self.snapshots: list[int] = []  # the confirmed snapshot each kill came after
        self.placement = Placement()

    def __call__(self, progress: Progress) -> None:
        self.placement(progress)
        if not self.at or progress.committed_steps < self.at[0] or progress.lost_shards:
            return
        holder = progress.data_servers[self.index]
        if holder in self.killed:
            return  # not replaced yet
        GATE.touch()
        if progress.snapshot_step >= self.at[0]:
            self.at.pop(0)
            self.killed.append(holder)
            self.snapshots.append(progress.snapshot_step)
            self.cluster.kill_worker(holder)
            GATE.unlink(missing_ok=True)


def promoted_on_a_standby(cluster: LocalElasticCluster, reference: References, job: ElasticJob) -> None:
    """Trains `job` (`tests.models:gated_slow_mlp`), SIGKILLing data server 1's static worker once a
    snapshot past step 12 is on its peer: bitwise the reference, every batch id once, the role promoted
    once on the standby from that snapshot, nothing before it redone."""
    kill = KillWhenSnapshotted(cluster, index=1)
    try:
        result = train(job, cluster=cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (killed,), placement = kill.killed, kill.placement
    first, last = placement.seen[0], placement.seen[-1]
    assert first.data_servers[1] == killed and len(first.standbys) == 1
    assert last.data_servers[1] == first.standbys[0], "data server 1 now lives on the standby"
    assert last.data_servers[0] == first.data_servers[0] and last.standbys == ()

    kinds = [e.kind for e in result.events]
    lost = kinds.index(EventKind.SHARD_LOST)
    assert kinds[lost + 1] == EventKind.PROMOTED and kinds.count(EventKind.PROMOTED) == 1
    promoted = result.events[lost + 1]
    # The replica is of the last snapshot every shard held when the worker died: training went back there
    # (with either policy), and nothing before it was redone.
    snapshot = max(
        (e.step for e in result.events[:lost] if e.kind == EventKind.SNAPSHOT),
        default=0,
    )
    assert snapshot >= 12, "the replica of a snapshot past the start was used"
    assert promoted.step == snapshot
    assert promoted.steps_lost == result.events[lost].step - snapshot
    assert f"standby {last.data_servers[1]}" in promoted.reason
    assert promoted.generation > result.events[lost].generation
    assert result.counters["promotions"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_data_server_killed_mid_run_is_promoted_on_a_standby(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    # 4 epochs: the progress the gate closes on lags the shards, which commit steps themselves; a job of 2
    # could end on a fast machine before the gate closed at step 12.
    job = make_job(
        digits_url, policy, job_id=f"standby-{policy}", model="tests.models:gated_slow_mlp", epochs=4
    )
    promoted_on_a_standby(static_cluster, reference, job)


def test_two_data_servers_lost_at_different_times_with_two_standbys(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 4)
    # 4 epochs: the second loss comes at step 30 and after a snapshot past it, well before the end however
    # fast the machine runs the steps (with 2, a fast run could end before the second kill).
    job = make_job(digits_url, "rollback", job_id="two-losses", model="tests.models:gated_slow_mlp", epochs=4)
    kill = KillWhenSnapshotted(static_cluster, index=1, at=(12, 30))
    try:
        result = train(job, cluster=static_cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert len(kill.killed) == 2 and result.counters["promotions"] == 2
    holders = [p.data_servers[1] for p in kill.placement.seen]
    assert holders[:2] == kill.killed and len(set(holders)) == 3, "each loss went to a standby of its own"
    promoted = [e for e in result.events if e.kind == EventKind.PROMOTED]
    assert [e.step >= at for e, at in zip(promoted, (12, 30), strict=True)] == [True, True]


@pytest.mark.heavy  # (in .ci/run's second stage: the main suite stays under issue 9's 15 minutes)
def test_a_standby_that_dies_while_its_data_server_starts_is_passed_over_for_the_next(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Data server 1's static worker SIGKILLed, then the standby chosen for its role SIGKILLed while the
    data server starts there (`slow.SlowStart` holds the start): the controller does not wait for the start
    (it would wait for the 600 s startup timeout) but promotes the next standby."""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 4)
    # (6 epochs: the progress the gate is closed on lags the shards, which commit steps themselves; a job
    # of 2 epochs ended on a warm cluster before the gate closed.)
    job = make_job(
        digits_url, "reassign", job_id="standby-dies", model="tests.models:gated_slow_mlp", epochs=6
    )
    kill = KillWhenSnapshotted(static_cluster, index=1)
    doomed: list[str] = []
    starting: list[str] = []
    killers: list[threading.Thread] = []

    def kill_once_starting(worker: str) -> None:
        with static_cluster.client() as client:
            for _ in range(600):  # 60 s at most
                keys = client.processing(workers=[worker]).get(worker, ())
                if any("data-server-1" in str(k) for k in keys):
                    starting.append(worker)
                    static_cluster.kill_worker(worker)
                    return
                time.sleep(0.1)

    def kill_then_its_standby(p: Progress) -> None:
        if not doomed and p.committed_steps >= 12 and len(p.standbys) == 2:
            doomed.append(p.standbys[0])  # the one the controller takes first (they are in name order)
            with static_cluster.client() as client:
                slow.register(client, slow.SlowStart(doomed[0], 3 * job.call_timeout))
        kill(p)
        if kill.killed and not killers:
            killers.append(threading.Thread(target=kill_once_starting, args=(doomed[0],)))
            killers[0].start()

    try:
        result = train(job, cluster=static_cluster, on_progress=kill_then_its_standby)
    finally:
        GATE.unlink(missing_ok=True)
        for thread in killers:
            thread.join()
        with static_cluster.client() as client:
            slow.clear(client)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert starting == doomed, "the first standby was killed while data server 1 started on it"
    first, last = kill.placement.seen[0], kill.placement.seen[-1]
    assert first.standbys[0] == doomed[0]
    assert last.data_servers[1] == first.standbys[1], "the next standby took the role"
    assert result.counters["promotions"] == 1


@pytest.mark.heavy  # (a long fault run: in .ci/run's second stage, to keep the main suite under 20 minutes)
def test_a_standby_that_dies_in_the_middle_of_its_promotion_is_passed_over_for_the_next(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Data server 1's static worker SIGKILLed, then the standby chosen for its role SIGKILLed by the first
    fence of its data server, which is the promotion's (`slow.DeathAtFence`): the coordinator is told at once
    and gives that promotion up (its call to the dead worker would wait for Dask's connect timeout), and the
    next standby takes the role. (Before: the job failed with the coordinator's error.)"""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 4)
    job = make_job(
        digits_url, "reassign", job_id="standby-dies-promoted", model="tests.models:gated_slow_mlp", epochs=6
    )
    kill = KillWhenSnapshotted(static_cluster, index=1)
    doomed: list[str] = []

    def arm_then_kill(p: Progress) -> None:
        if not doomed and p.committed_steps >= 12 and len(p.standbys) == 2:
            doomed.append(p.standbys[0])  # the one the controller takes first (they are in name order)
            with static_cluster.client() as client:
                slow.register(client, slow.DeathAtFence(doomed[0]))
        kill(p)

    try:
        result = train(job, cluster=static_cluster, on_progress=arm_then_kill)
    finally:
        GATE.unlink(missing_ok=True)
        with static_cluster.client() as client:
            slow.clear(client)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    first, last = kill.placement.seen[0], kill.placement.seen[-1]
    assert first.standbys[0] == doomed[0] and doomed[0] not in static_cluster.static_addresses(), "it died"
    assert last.data_servers[1] == first.standbys[1], "the next standby took the role"
    assert result.counters["promotions"] == 1
    kinds = [e.kind for e in result.events]
    lost, promoted = (
        result.events[kinds.index(EventKind.SHARD_LOST)],
        result.events[kinds.index(EventKind.PROMOTED)],
    )
    print(f"data server 1 promoted {promoted.time - lost.time:.2f} s after its loss, past a dead standby")


def test_a_start_that_dask_cancelled_is_told_apart_from_a_broken_one(
    static_cluster: LocalElasticCluster,
) -> None:
    """Dask's `Future.result` of a cancelled future raises `FutureCancelledError`, or an UnboundLocalError of
    its own when the cancellation comes while it waits (seen in the chaos soak, where a data server's start
    was cancelled on a live standby, and the job failed with it): `settled_result` raises `StartCancelled`
    instead, which the controller tries again."""
    with static_cluster.client() as client:
        # Pinned to a worker that does not exist, it never runs: a running task would hold a worker's one
        # thread after its cancel (Dask does not stop it), and the next test's data server placed there
        # could not answer in time.
        future = client.submit(sum, [1], workers=["tcp://127.0.0.1:9"], allow_other_workers=False, pure=False)
        client.cancel([future])
        with pytest.raises(StartCancelled, match="cancelled the start"):
            settled_result(future, 5.0)
        assert settled_result(client.submit(sum, [1, 2], pure=False), 30.0) == 3


def test_waiting_in_short_slices_for_a_result_leaves_the_client_working(
    static_cluster: LocalElasticCluster,
) -> None:
    """The controller waits for a start in 50 ms slices, watching for its worker's loss in between. With
    Dask's own `result(timeout)`, a slice that ends while the client fetches the finished value jams the
    client: that result and every later one fail with an UnboundLocalError (the chaos soak lost its job
    to it). Slices of half a millisecond hit that window within the first few results."""
    with static_cluster.client() as client:
        for i in range(40):
            future = client.submit(time.sleep, 0.01, pure=False, key=f"slices-{i}")
            while True:
                try:
                    settled_result(future, 0.0005)
                    break
                except TimeoutError:
                    continue
        assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3


@pytest.mark.heavy  # (a long fault run: in .ci/run's second stage, to keep the main suite under 20 minutes)
def test_a_standby_that_joins_after_the_loss_takes_the_role(reference: References, digits_url: str) -> None:
    with LocalElasticCluster(static_workers=2, elastic_workers=2) as cluster:
        job = make_job(digits_url, "reassign", job_id="late-standby", min_workers_timeout=120.0)
        faults = FaultSchedule().kill_data_server(at_step=30, index=1).add_static_worker(at_step=30)
        placement = Placement()
        result = train(job, cluster=cluster, faults=faults, on_progress=placement)
        assert placement.seen[0].standbys == ()
        joined = cluster.address_of(faults.log[1].target)
        assert placement.seen[-1].data_servers[1] == joined
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert result.counters["promotions"] == 1


@pytest.mark.heavy  # (it waits out `min_workers_timeout`, 36 s in all: in .ci/run's second stage)
def test_no_standby_fails_naming_the_role_and_what_to_start(digits_url: str) -> None:
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        job = make_job(digits_url, "reassign", job_id="no-standby", min_workers_timeout=2.0)
        faults = FaultSchedule().kill_data_server(at_step=10, index=1)
        with pytest.raises(DataServerLostError) as failed:
            train(job, cluster=cluster, faults=faults)
    message = str(failed.value)
    assert "data server 1" in message and "no standby static worker joined" in message
    assert "--resources static=1" in message


def test_without_peer_replicas_a_lost_data_server_ends_the_job_saying_why(
    static_cluster: LocalElasticCluster, digits_url: str
) -> None:
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(  # (4 epochs: as in the data server's test above)
        digits_url,
        "reassign",
        job_id="no-replicas",
        model="tests.models:gated_slow_mlp",
        peer_replicas=False,
        epochs=4,
    )
    kill = KillWhenSnapshotted(static_cluster, index=1)
    try:
        with pytest.raises(DataServerLostError, match="peer_replicas=False") as failed:
            train(job, cluster=static_cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)
    assert kill.killed and "data servers [1]" in str(failed.value)
    assert "resumes from the last checkpoint" in str(failed.value)


@pytest.mark.heavy  # (a long fault run: in .ci/run's second stage, to keep the main suite under 20 minutes)
def test_random_kills_of_static_and_elastic_workers(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Compute workers killed, restarted and added, and data servers' static workers killed (each followed
    by a new static worker), at random steps: both invariants hold. (One policy: a promotion goes back to
    the snapshot under both, which the tests above show.)"""
    policy = "rollback"
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(digits_url, policy, job_id=f"mix-{policy}", epochs=4, model="tests.models:gated_slow_mlp")
    faults = FaultSchedule.random(seed=3, steps=90, events=4, start_alive=2, data_server_kills=2)
    planned = [(f.kind, f.role) for f in faults.faults]
    try:
        # Each new compute process takes part before the job ends.
        result = train(job, cluster=static_cluster, faults=faults, on_progress=HoldUntilJoined(faults))
    finally:
        GATE.unlink(missing_ok=True)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert len(faults.log) == len(planned), "every planned fault ran"
    assert result.counters["promotions"] == 2
    compute = {w for e in result.membership_events() for w in e.workers + e.left + e.joined}
    static = {r.target for r in faults.log if r.kind in ("kill", "add-static")} - compute
    assert len(compute | static) >= 6, "at least six processes took part"


def test_a_loss_reported_after_the_standby_took_the_role_is_ignored(digits_url: str) -> None:
    """The controller tells the coordinator of a lost data server without waiting for the answer, so the
    report can arrive after the promotion it led to: keyed by the lost data server's actor, it no longer
    matches the one in place and changes nothing. (Seen in the chaos soak: the late report made the
    coordinator think the standby's worker lost too, and the job failed for want of another standby.)"""
    servers, _ = in_process_servers(digits_url)
    job = make_job(digits_url, "rollback")
    prepared = prepare(job)
    coordinator = Coordinator(
        CoordinatorSpec(job.job_id, prepared.schedule, 2, Policy.ROLLBACK, 1, 60.0, prepared.mode.commits),
        None,
        5.0,
    )
    for server, key in zip(servers, ("data-server-0-a", "data-server-1-b"), strict=True):
        server.key = key  # type: ignore[attr-defined]  (what a Dask actor handle carries)
    coordinator._shards = list(servers)

    async def report(key: str) -> None:
        await coordinator.shards_lost([1], "static worker tcp://old:1 left", [key])

    generation = coordinator._state.generation
    asyncio.run(report("data-server-1-a"))  # the one replaced
    assert coordinator._state.generation == generation and not coordinator._state.lost
    assert not coordinator._gone.get(1, asyncio.Event()).is_set(), "calls to the new one go on"
    asyncio.run(report("data-server-1-b"))  # the one in place
    assert coordinator._state.generation == generation + 1 and coordinator._state.lost == {1}
    assert [e.kind for e in coordinator._unreported] == [EventKind.SHARD_LOST]
