"""Network partitions (issue 13): a worker alive but unreachable, on real processes in real network
namespaces (`prefect_elastic.local.netns`), its link cut by iptables DROP and healed later.

A cut compute worker is out of the membership within 2 liveness intervals (its heartbeats stop reaching
the scheduler, as a frozen worker's do), and training goes on without it. Dask's own TCP timeouts drop it
from the scheduler later, and the cut-off worker process exits; its supervisor (as systemd or SLURM would)
starts it again, and once the link heals it joins again. A cut static worker holding a data server is seen
lost the same way, and a standby takes the data server's role from the peer's in-memory replica. In sync
mode the result is bitwise equal to the one-worker, no-fault run's, and every batch id is committed once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from prefect_elastic import ElasticJob, TrainResult, train
from prefect_elastic.local import netns
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.local.netns import (
    CutMode,
    HostNetwork,
    NetworkNamespace,
    NetworkSetupError,
    remove_stale,
)
from prefect_elastic.messages import EventKind, Progress

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job
from .models import GATE

pytestmark = [pytest.mark.timeout(300)]

LIVENESS_S = 1.0
# Dask's TCP timeout, as short as it goes here (it cannot go much below 11 s): the scheduler drops a
# cut-off worker about 12.5 s after the cut, and the worker process exits 15 to 20 s after it. (No short
# worker-ttl: on a loaded machine a 5 s one dropped a worker that had just started.)
DASK_ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s"}
# The tests heal a link once the cut-off worker exited and its supervisor started it again (which then
# waits, unable to reach the scheduler, until the link heals); the fault schedule's own heal is a bound.
MAX_CUT_S = 120.0
# A cut healed well before Dask's TCP timeout: the worker's connections survive it.
SHORT_CUT_S = 4.0


def _reaches(ns: NetworkNamespace, host: str, port: int) -> bool:
    """Whether a TCP connection from inside `ns` to host:port is accepted within a second."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=1.0).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    done = subprocess.run([*ns.exec_prefix(), sys.executable, "-c", probe], timeout=30, check=False)
    return done.returncode == 0


def test_a_namespace_is_reachable_until_cut_and_again_once_healed() -> None:
    with HostNetwork() as net, socket.create_server((net.address, 0)) as server:
        port = server.getsockname()[1]
        ns = net.namespace()
        assert ns.address != net.address and ns.address.rsplit(".", 1)[0] == net.address.rsplit(".", 1)[0]
        assert _reaches(ns, net.address, port)
        hows: tuple[CutMode, ...] = ("drop", "link")
        for how in hows:
            ns.cut(how)
            assert ns.is_cut and not _reaches(ns, net.address, port), f"cut ({how})"
            ns.heal()
            assert not ns.is_cut and _reaches(ns, net.address, port), f"healed ({how})"
        names = (ns.name, ns.host_link, net.bridge)
    assert ns.name not in netns._run("ip", "netns", "list").split(), "the namespace is deleted"
    links = netns._run("ip", "-o", "link", "show")
    assert not [n for n in names[1:] if f" {n}:" in links or f" {n}@" in links], "its links are deleted"


def test_what_a_killed_run_left_behind_is_removed_and_a_live_run_s_is_not() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = f"prefect-elastic-{dead.pid}-0"
    netns._run("ip", "netns", "add", leftover)
    try:
        with HostNetwork() as net:  # removes what dead processes left, when it starts
            live = net.namespace()
            assert leftover not in netns._run("ip", "netns", "list").split()
            assert live.name in netns._run("ip", "netns", "list").split()
            assert live.name not in remove_stale(), "this process is alive: its namespace stays"
    finally:
        netns._run("ip", "netns", "del", leftover, check=False)


def test_without_the_tools_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "iptables" else "/usr/sbin/ip")
    with pytest.raises(NetworkSetupError, match=r"apt-get install iproute2 iptables") as missing:
        HostNetwork()
    assert "['iptables']" in str(missing.value)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetworkSetupError, match="need root"):
        HostNetwork()


def test_a_namespace_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with HostNetwork() as net:
        real = netns._run

        def fail_on_address(*args: str, check: bool = True) -> str:
            if "addr" in args and "add" in args:
                raise NetworkSetupError("address refused (on purpose)")
            return real(*args, check=check)

        before = netns._run("ip", "netns", "list")
        monkeypatch.setattr(netns, "_run", fail_on_address)
        with pytest.raises(NetworkSetupError, match="on purpose"):
            net.namespace()
        monkeypatch.setattr(netns, "_run", real)
        assert netns._run("ip", "netns", "list") == before, "the half-made namespace is deleted"
        assert f"{net.bridge}:" in netns._run("ip", "-o", "link", "show"), "the network's bridge stays"
        assert len(net.namespaces) == 0


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    with HostNetwork() as net:
        yield net


def partition_cluster(net: HostNetwork, static_workers: int, elastic_workers: int) -> LocalElasticCluster:
    return LocalElasticCluster(
        static_workers=static_workers,
        elastic_workers=elastic_workers,
        host=net.address,
        env=DASK_ENV,
    )


class CutRun(NamedTuple):
    """A training run in which the compute worker `name`, in the namespace `ns`, was cut off."""

    result: TrainResult
    faults: FaultSchedule
    hold: HoldUntilBack
    ns: NetworkNamespace
    name: str
    restarts: list[float]  # when its supervisor started it again
    listed: list[str]  # the workers the scheduler listed at the end


def run_cut(network: HostNetwork, job: ElasticJob, heal_after: float, by_schedule: bool) -> CutRun:
    """Train `job` on a cluster of 2 static workers, one compute worker outside a namespace and one (under
    a supervisor) inside one, whose link the fault schedule cuts at step 6 and heals `heal_after` seconds
    later (`by_schedule`: waited for), or `HoldUntilBack` once the supervisor started it again."""
    with partition_cluster(network, static_workers=2, elastic_workers=1) as cluster:
        ns = network.namespace()
        name = cluster.add_worker(netns=ns, supervise=True)
        faults = FaultSchedule().partition_worker(at_step=6, heal_after=heal_after)
        hold = HoldUntilBack(cluster, faults, name, go_on=5)
        try:
            result = train(job, cluster=cluster, faults=faults, on_progress=hold)
        finally:
            GATE.unlink(missing_ok=True)
            if not by_schedule:
                ns.heal()
        if by_schedule:
            faults.wait(timeout=heal_after + 5)
        return CutRun(result, faults, hold, ns, name, cluster.restarts(name), cluster.worker_names())


class HoldUntilBack:
    """An `on_progress` callback for a job of `tests.models:gated_slow_mlp`. Once the fault schedule cut the
    network of the worker named `name`, holds training until the worker left the membership (a job that
    goes on meanwhile, its steps backed up by the other worker, can end within the time the cut takes to
    be detected), lets training go on without it for `go_on` steps, then holds it (at the gate, in the
    model's forward pass) until a process of that worker is a member again, so that the job cannot end
    before it joins again, however long that takes. Heals the link once the cut-off worker exited and its
    supervisor started it again (a cut shorter than Dask's timeouts is healed by the fault schedule before
    that). Records the progress."""

    def __init__(self, cluster: LocalElasticCluster, faults: FaultSchedule, name: str, go_on: int) -> None:
        self.cluster, self.faults, self.name, self.go_on = cluster, faults, name, go_on
        self.seen: list[Progress] = []
        self.left_at: int | None = None  # the committed steps once the cut worker was no member
        self.healed: float | None = None
        self.back: str | None = None  # the address it joined again under

    def __call__(self, progress: Progress) -> None:
        self.seen.append(progress)
        if not self.faults.log:
            return
        ns = self.cluster.netns_of(self.name)
        assert ns is not None
        cut = self.faults.log[0].target
        if self.left_at is None and cut not in progress.workers:
            self.left_at = progress.committed_steps
        if ns.is_cut and self.cluster.restarts(self.name):
            ns.heal()
            self.healed = time.time()
        if self.left_at is not None and self.back is None:
            back = [w for w in progress.workers if w.startswith(f"tcp://{ns.address}:")]
            self.back = back[0] if back else None
        detecting = self.left_at is None
        away = self.left_at is not None and self.back is None
        if detecting or (away and progress.committed_steps >= (self.left_at or 0) + self.go_on):
            GATE.touch()
        else:
            GATE.unlink(missing_ok=True)


@pytest.mark.cluster
@pytest.mark.heavy
@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_a_cut_compute_worker_leaves_within_two_liveness_intervals_and_joins_again_once_healed(
    network: HostNetwork, reference: References, digits_url: str, policy: str
) -> None:
    job = make_job(
        digits_url, policy, job_id=f"partition-{policy}", model="tests.models:gated_slow_mlp",
        liveness_interval=LIVENESS_S,
    )  # fmt: skip
    result, faults, hold, ns, _, restarts, _ = run_cut(network, job, MAX_CUT_S, by_schedule=False)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (record,) = faults.log
    cut = record.target
    assert record.kind == "partition" and cut.startswith(f"tcp://{ns.address}:"), "the one in the namespace"
    assert cut in result.membership_events()[0].workers, "a member when it was cut"

    (left,) = [e for e in result.membership_events() if cut in e.left]
    assert left.kind == (EventKind.ROLLBACK if policy == "rollback" else EventKind.REASSIGN)
    detected = left.time - record.time
    print(f"{policy}: the cut worker was out of the membership {detected:.2f} s after the cut")
    assert 0 < detected <= 2 * job.liveness_interval, "out of the membership within 2 liveness intervals"

    # Training went on without it: the other worker committed steps while it was cut off.
    assert hold.left_at is not None and hold.healed is not None
    steps_while_cut = {e.step for e in result.ledger if e.step >= hold.left_at}
    assert steps_while_cut >= set(range(hold.left_at, hold.left_at + hold.go_on))
    assert all(e.worker != cut for e in result.ledger if e.step >= left.step)

    # Dask's cut-off worker exited; its supervisor started it again, and it joined once the link healed.
    assert len(restarts) >= 1 and restarts[0] < hold.healed, "started again while still cut off"
    assert hold.back is not None and hold.back != cut, "the process started again is a member"
    (joined,) = [e for e in result.membership_events() if hold.back in e.joined]
    assert joined.time > hold.healed > left.time
    assert any(e.worker == hold.back for e in result.ledger), "and it trained again"


@pytest.mark.cluster
@pytest.mark.heavy  # (35 s: in .ci/run's second stage, to keep the main suite under 20 minutes)
def test_a_short_cut_of_a_compute_worker_and_it_is_a_member_again_once_healed(
    network: HostNetwork, reference: References, digits_url: str
) -> None:
    """Healed before Dask's timeouts, the cut-off worker never leaves the scheduler and never exits: its
    heartbeats reach the scheduler again, and the same process joins again. Meanwhile it was out of the
    membership within 2 liveness intervals, and training went on without it."""
    job = make_job(
        digits_url, "reassign", job_id="partition-short", model="tests.models:gated_slow_mlp",
        liveness_interval=LIVENESS_S,
    )  # fmt: skip
    result, faults, hold, ns, name, restarts, listed = run_cut(network, job, SHORT_CUT_S, by_schedule=True)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (record,) = faults.log
    cut = record.target
    assert record.kind == "partition" and cut.startswith(f"tcp://{ns.address}:"), "the one in the namespace"
    assert not ns.is_cut, "the fault schedule healed it"
    (left,) = [e for e in result.membership_events() if cut in e.left]
    detected = left.time - record.time
    print(f"the cut worker was out of the membership {detected:.2f} s after the cut")
    assert 0 < detected <= 2 * job.liveness_interval, "out of the membership within 2 liveness intervals"
    assert hold.left_at is not None
    assert {e.step for e in result.ledger if e.step >= hold.left_at} >= set(
        range(hold.left_at, hold.left_at + hold.go_on)
    ), "steps committed while it was cut off"
    assert hold.back == cut, "the same process is a member again"
    (joined,) = [e for e in result.membership_events() if cut in e.joined and e.time > left.time]
    assert joined.time > record.time + SHORT_CUT_S, "once the link healed"
    assert any(e.worker == cut for e in result.ledger if e.step >= joined.step), "and it trained again"
    assert restarts == [] and name in listed, "it never exited"


class CutWhenSnapshotted:
    """An `on_progress` callback for a job of `tests.models:gated_slow_mlp`: holds training at step `at` or
    later until a snapshot of where it stands is confirmed (so its copy is on the peer), then applies the
    fault schedule (the cut of the static worker of data server `index`) and lets training go on for
    `go_on` steps past the promotion; then holds it until the cut worker, started again by its supervisor
    and its link healed, is a standby of the job again. Records where the roles lived."""

    def __init__(
        self, cluster: LocalElasticCluster, faults: FaultSchedule, name: str, at: int = 12, go_on: int = 5
    ) -> None:
        self.cluster, self.faults, self.name, self.at, self.go_on = cluster, faults, name, at, go_on
        self.seen: list[Progress] = []
        self.moved_at: int | None = None  # the committed steps when the role was on the standby
        self.healed: float | None = None
        self.back: str | None = None  # the cut worker's address as a standby again

    def __call__(self, progress: Progress) -> None:
        self.seen.append(progress)
        ns = self.cluster.netns_of(self.name)
        assert ns is not None
        if not self.faults.log:
            if progress.committed_steps >= self.at:
                GATE.touch()
                if progress.snapshot_step >= self.at:
                    self.faults.apply(progress)
                    GATE.unlink(missing_ok=True)
            return
        cut = self.seen[0].data_servers[1]
        if self.moved_at is None and cut not in progress.data_servers:
            self.moved_at = progress.committed_steps
        if ns.is_cut and self.cluster.restarts(self.name):
            ns.heal()  # the cut-off worker exited and its supervisor started it again: heal the link now
            self.healed = time.time()
        if self.back is None:
            back = [w for w in progress.standbys if w.startswith(f"tcp://{ns.address}:") and w != cut]
            self.back = back[0] if back else None
        away = self.moved_at is not None and self.back is None
        if away and progress.committed_steps >= (self.moved_at or 0) + self.go_on:
            GATE.touch()
        else:
            GATE.unlink(missing_ok=True)


@pytest.mark.cluster
@pytest.mark.heavy
def test_a_cut_static_worker_s_data_server_moves_to_a_standby_and_it_comes_back_as_a_standby(
    network: HostNetwork, reference: References, digits_url: str
) -> None:
    job = make_job(
        digits_url, "reassign", job_id="partition-static", model="tests.models:gated_slow_mlp",
        liveness_interval=LIVENESS_S,
    )  # fmt: skip
    with partition_cluster(network, static_workers=1, elastic_workers=2) as cluster:
        # Roles go to static workers by name: static-0 (here) holds the coordinator and data server 0,
        # static-1 (in the namespace) data server 1, and static-2 (here) is the standby.
        ns = network.namespace()
        name = cluster.add_worker(static=True, netns=ns, supervise=True)
        standby = cluster.add_worker(static=True)
        assert (name, standby) == ("static-1", "static-2")
        cut_address, standby_address = cluster.address_of(name), cluster.address_of(standby)
        faults = FaultSchedule().partition_worker(at_step=0, worker=name, heal_after=MAX_CUT_S)
        faults.bind(cluster)
        watch = CutWhenSnapshotted(cluster, faults, name)
        try:
            result = train(job, cluster=cluster, on_progress=watch)
        finally:
            GATE.unlink(missing_ok=True)
            ns.heal()
        restarts = cluster.restarts(name)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (record,) = faults.log
    first, last = watch.seen[0], watch.seen[-1]
    assert record.target == name and first.data_servers[1] == cut_address
    assert first.standbys == (standby_address,)
    assert last.data_servers[1] == standby_address, "data server 1 now lives on the standby"
    assert last.data_servers[0] == first.data_servers[0] and last.coordinator_at == first.coordinator_at

    kinds = [e.kind for e in result.events]
    lost = kinds.index(EventKind.SHARD_LOST)
    assert kinds[lost + 1] == EventKind.PROMOTED and result.counters["promotions"] == 1
    detected = result.events[lost].time - record.time
    print(f"the cut static worker's data server was seen lost {detected:.2f} s after the cut")
    assert 0 < detected <= 2 * job.liveness_interval, "seen lost within 2 liveness intervals"
    promoted = result.events[lost + 1]
    assert promoted.step >= watch.at, "from the replica of a snapshot past the start"

    # Training went on without it, and the worker, started again and healed, is a standby again.
    assert watch.moved_at is not None
    assert {e.step for e in result.ledger if e.step >= watch.moved_at} >= set(
        range(watch.moved_at, watch.moved_at + 5)
    )
    assert len(restarts) >= 1 and watch.healed is not None and restarts[0] < watch.healed
    assert watch.back is not None and watch.back != cut_address, "the process started again is a standby"
    assert all(cut_address not in p.standbys for p in watch.seen), "a cut-off worker is never a standby"


@pytest.mark.cluster
def test_parameters_cross_the_network_in_buckets_by_default_and_are_read_in_place_beside_the_shards(
    network: HostNetwork, reference: References, digits_url: str
) -> None:
    """`overlap_pull` left to the engine: a compute worker in a network namespace of its own (its frames
    cross TCP, as from another machine) reads each step's parameters bucket by bucket during forward; one
    beside the data servers reads them in place, whole. Both in one job, to the one-worker run's bits."""
    with partition_cluster(network, static_workers=2, elastic_workers=1) as cluster:
        cluster.add_worker(netns=network.namespace())
        job = make_job(
            digits_url, "reassign", model="tests.models:wide_mlp", overlap_push=True, overlap_pull=None,
            job_id="pull-across",
        )  # fmt: skip
        result = train(job, cluster=cluster)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    # (By the worker's host: a worker may have run more than one loop of the job, one per role asked.)
    beside = [loop for loop in result.loops if loop.worker.startswith(f"tcp://{network.address}:")]
    away = [loop for loop in result.loops if loop not in beside]
    assert sum(loop.steps for loop in away) > 1 and sum(loop.pulled for loop in away) > 0, away
    assert sum(loop.steps for loop in beside) > 1 and all(loop.pulled == 0 for loop in beside), beside
