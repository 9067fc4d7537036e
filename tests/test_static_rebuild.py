"""Static workers lost beyond what a standby's promotion mends: the coordinator's worker SIGKILLed (with data
server 0 beside it) and the coordinator rebuilt on another static worker, bitwise equal; shards lost with
their replicas, back to the checkpoint in the same run or, without one, an error naming them; no static
worker left for the coordinator. (A data server lost to a standby: test_static_roles.py; hand-overs:
test_static_handover.py.)"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest
from distributed.actor import Actor

from prefect_elastic import train
from prefect_elastic.errors import DataServerLostError
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.messages import EventKind, Progress
from prefect_elastic.training.calls import controller_handle
from prefect_elastic.training.signals import CoordinatorLost

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    make_job,
    top_up,
    wait_for,
)
from .models import GATE
from .test_static_roles import POLICIES, KillWhenSnapshotted, Placement, top_up_static

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_the_controllers_handle_on_a_coordinator_whose_worker_died_raises_coordinator_lost(
    static_cluster: LocalElasticCluster,
) -> None:
    """Once an actor's worker is lost, Dask raises "Worker holding Actor was lost" (a `RuntimeError`) at the
    lookup of any of its methods, before a call is made. The async chaos soak in CI lost its job so: its
    coordinator's worker was killed between two calls of the controller, and the error came from outside
    the code that turns it into `CoordinatorLost`. The controller's handle raises `CoordinatorLost`, which
    `supervise` answers by rebuilding the coordinator."""
    name = static_cluster.add_worker()
    address = static_cluster.address_of(name)
    assert address is not None
    with static_cluster.client() as client:
        future = client.submit(collections.Counter, actor=True, workers=[address], pure=False)
        dasks = future.result(timeout=30)
        handle = controller_handle(dasks)
        assert handle.total().result(timeout=30) == 0
        static_cluster.kill_worker(name)
        static_cluster.wait_until_gone([name])
        wait_for("the actor's future to turn to error", lambda: future.status == "error", timeout=30)
        with pytest.raises(RuntimeError, match="Actor was lost"):
            dasks.total  # noqa: B018 (the lookup itself raises)
        with pytest.raises(CoordinatorLost, match=f"its static worker {address} was lost"):
            handle.total  # noqa: B018
        # It still pickles as Dask's own handle, as the compute loops are given it.
        assert type(pickle.loads(pickle.dumps(handle))) is Actor


class KillWhenCheckpointed:
    """Holds training at step `at` or later until a persistent checkpoint of step `at` or later is written
    in `folder` (with no folder: until a snapshot of step `at` or later is confirmed), then SIGKILLs the
    static workers of the data servers `indices` at once (each shard's replica lives on the next one, so
    neighbours die with their replicas) and lets training go on."""

    def __init__(
        self, cluster: LocalElasticCluster, indices: tuple[int, ...], folder: Path, at: int = 12
    ) -> None:
        self.cluster = cluster
        self.indices = indices
        self.folder = folder
        self.at = at
        self.killed: list[str] = []
        self.placement = Placement()

    def __call__(self, progress: Progress) -> None:
        self.placement(progress)
        if self.killed or progress.committed_steps < self.at:
            return
        GATE.touch()
        if self.folder is None:
            reached = progress.snapshot_step
        else:
            reached = max(
                (int(p.stem.removeprefix("ckpt-")) for p in self.folder.glob("ckpt-*.pt")), default=-1
            )
        if reached >= self.at:
            self.killed = sorted({progress.data_servers[i] for i in self.indices})
            for worker in self.killed:
                self.cluster.kill_worker(worker)
            GATE.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("shards", "indices"),
    # (two data servers in .ci/run's heavy stage, about 20 s: the main suite stays under issue 9's 15
    # minutes, and the other case takes the same way back to the checkpoint, the coordinator's loss too)
    [pytest.param(3, (1, 2), marks=pytest.mark.heavy), (2, (0, 1))],
    ids=["two-data-servers", "every-data-server-and-the-coordinator"],
)
def test_a_shard_lost_with_its_replica_goes_back_to_the_checkpoint_in_the_same_run(
    static_cluster: LocalElasticCluster,
    reference: References,
    digits_url: str,
    tmp_path: Path,
    shards: int,
    indices: tuple[int, ...],
) -> None:
    top_up(static_cluster, 2)
    top_up_static(static_cluster, shards + 2)
    job = make_job(
        digits_url, "reassign", job_id=f"replica-lost-{shards}", model="tests.models:gated_slow_mlp",
        data_servers=shards, checkpoint=str(tmp_path), checkpoint_every=1,
    )  # fmt: skip
    kill = KillWhenCheckpointed(static_cluster, indices, tmp_path)
    try:
        result = train(job, cluster=static_cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert len(kill.killed) == len(indices)
    (restored,) = [e for e in result.events if e.kind == EventKind.RESTORED]
    assert f"{tmp_path}" in restored.reason and restored.step >= 12, "back to a checkpoint past the start"
    # (One of the two may be promoted first, if it is seen lost alone: its peer still held its replica.)
    assert result.counters["checkpoint_restores"] == 1 and result.counters["promotions"] <= 1
    last = kill.placement.seen[-1]
    assert not set(last.data_servers) & set(kill.killed), "every lost data server lives elsewhere now"
    assert last.coordinator_at not in kill.killed
    assert result.counters["loop_failures"] == 0, "no compute loop gave up on an unreachable shard"


def test_a_shard_lost_with_its_replica_and_no_checkpoint_fails_naming_them(
    static_cluster: LocalElasticCluster, digits_url: str
) -> None:
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 5)
    job = make_job(
        digits_url, "reassign", job_id="replica-lost-no-checkpoint", model="tests.models:gated_slow_mlp",
        data_servers=3,
    )  # fmt: skip
    kill = KillWhenCheckpointed(static_cluster, (1, 2), folder=None)
    try:
        with pytest.raises(DataServerLostError) as failed:
            train(job, cluster=static_cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)
    message = str(failed.value)
    assert len(kill.killed) == 2
    assert "data servers [1] cannot be restored" in message, "it names them"
    assert "replica was held by data server 2" in message, "and says why"
    assert "no `checkpoint`" in message and "set one" in message, "it says what to do"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_coordinators_worker_killed_mid_run_is_rebuilt_on_another(
    static_cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    """The coordinator lives beside data server 0, so its worker's SIGKILL takes both: the coordinator is
    rebuilt beside data server 1 from the controller's copy of its record and the shards, and a standby
    takes data server 0 from its peer's replica."""
    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = make_job(  # (4 epochs: as in the data server's test above)
        digits_url, policy, job_id=f"coordinator-{policy}", model="tests.models:gated_slow_mlp", epochs=4
    )
    kill = KillWhenSnapshotted(static_cluster, index=0)
    try:
        result = train(job, cluster=static_cluster, on_progress=kill)
    finally:
        GATE.unlink(missing_ok=True)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    (killed,), placement = kill.killed, kill.placement
    first, last = placement.seen[0], placement.seen[-1]
    assert first.coordinator_at == killed == first.data_servers[0]
    assert last.coordinator_at == first.data_servers[1], "the coordinator now lives beside data server 1"
    assert last.data_servers[0] == first.standbys[0], "data server 0 now lives on the standby"

    kinds = [e.kind for e in result.events]
    assert kinds.count(EventKind.COORDINATOR_REBUILT) == 1 and kinds.count(EventKind.PROMOTED) == 1
    rebuilt = result.events[kinds.index(EventKind.COORDINATOR_REBUILT)]
    assert killed in rebuilt.reason and "data servers [0] lost with it" in rebuilt.reason
    assert kinds.index(EventKind.COORDINATOR_REBUILT) < kinds.index(EventKind.PROMOTED)
    before = result.events[: kinds.index(EventKind.COORDINATOR_REBUILT)]
    assert EventKind.SNAPSHOT in [e.kind for e in before], "events before it kept"
    # The snapshot confirmed just before the kill is in the record, whether it was confirmed within the
    # survival check that asked for it (whose copy of the record follows) or after it: the controller
    # copies the record whenever the coordinator's progress shows an event its copy lacks, before it
    # reports that progress (whose snapshot step set the kill off).
    assert any(e.kind is EventKind.SNAPSHOT and e.step == kill.snapshots[0] for e in before), (
        kill.snapshots,
        [(e.kind, e.step) for e in before],
    )
    assert result.counters["coordinator_rebuilds"] == 1 and result.counters["promotions"] == 1
    assert len(result.history) == result.total_steps and all(h == h for h in result.history[:12])


def test_the_coordinator_lost_with_no_static_worker_left_fails_naming_it(digits_url: str) -> None:
    with LocalElasticCluster(static_workers=1, elastic_workers=1) as cluster:
        job = make_job(digits_url, "reassign", job_id="no-coordinator", min_workers_timeout=1.0)
        faults = FaultSchedule().kill_coordinator(at_step=10)
        with pytest.raises(DataServerLostError, match="coordinator") as failed:
            train(job, cluster=cluster, faults=faults)
    message = str(failed.value)
    assert faults.log[0].target in message and "no static worker was left" in message
    assert "--resources static=1" in message, "it says what to start"
