"""Gradients that leave bucket by bucket during backward (`ElasticJob.overlap_push`), on a real cluster: the
shards sum the parts as they come and commit at the seals, so a run gives the parameters of the whole-push
run bit for bit, with workers killed and joining, and every batch id once (docs/design/overlapped-step.md).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from prefect_elastic import ElasticJob, TrainResult, train
from prefect_elastic.cluster import CpuShare, cpu_share
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.messages import Progress

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    make_job,
    top_up,
    train_killed_between_pushes,
)
from .models import GATE, waiting_marks

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
POLICIES = ["rollback", "reassign"]


def first_made(marks: list[Path]) -> Path:
    """The mark made first. Where the gate closed while one member was past it, that member may be asked
    to train the micro-batch of one held there as a backup, and waits at the gate in it: killing the backup's
    trainer would let the member whose micro-batch it is seal the step as usual once the gate opens, with no
    step dropped. The member waiting longest is the one whose own micro-batch it is."""

    def made(mark: Path) -> int:
        try:
            return int(mark.read_text() or 2**63)  # (`time.monotonic_ns()` when it began to wait)
        except (FileNotFoundError, ValueError):  # (gone meanwhile: its process no longer waits)
            return 2**63

    return min(marks, key=made)


def train_killing_a_waiting_member(
    cluster: LocalElasticCluster, job: ElasticJob, members: int
) -> tuple[TrainResult, dict[str, int]]:
    """Train `job`, a model that waits at the gate (`tests.models`) with a mark per process; from step 6
    the gate is closed, and once every one of the `members` waits there the one that waits longest is
    SIGKILLed (`first_made`) and the gate opened. Returns the result and the pid killed with the step
    (empty if none was)."""
    killed: dict[str, int] = {}

    def kill_a_waiting_member(p: Progress) -> None:
        if "pid" in killed or p.committed_steps < 6:
            return
        GATE.write_text(str(members))  # (the gated models wait in the second micro-batch of each share)
        marks = waiting_marks()
        if len(marks) == members == len(p.workers):  # each waits at the gate
            killed.update(pid=int(first_made(marks).name.rsplit("-", 1)[1]), step=p.committed_steps)
            os.kill(killed["pid"], signal.SIGKILL)
            GATE.unlink()

    try:
        return train(job, cluster=cluster, on_progress=kill_a_waiting_member), killed
    finally:
        GATE.unlink(missing_ok=True)
        for mark in waiting_marks():
            mark.unlink(missing_ok=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_run_whose_gradients_leave_during_backward_gives_the_whole_push_runs_parameters(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    top_up(cluster, 2)
    job = make_job(digits_url, policy, overlap_push=True, job_id=f"overlap-{policy}")
    faults = FaultSchedule(seed=3).kill_worker(at_step=8).add_worker(at_step=12)
    result = train(job, cluster=cluster, faults=faults)
    assert [r.kind for r in faults.log] == ["kill", "add"]
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    # Every step's gradients went in parts, a bucket or more to each of the 2 shards (the loops that lived
    # to the end say so; one that joined as the job ended may have trained nothing).
    assert any(loop.steps for loop in result.loops), result.loops
    assert all(loop.parts >= 2 * loop.steps for loop in result.loops), result.loops


@pytest.mark.parametrize("policy", POLICIES)
def test_a_run_whose_parameters_arrive_during_forward_gives_the_whole_pull_runs_parameters(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    """`overlap_pull=True`: each step's parameters come back bucket by bucket (on this machine too, where
    they would be read in place), each module's forward waiting for its own, a tensor split across the
    data servers joined from its pieces as they come, through a kill and a join."""
    top_up(cluster, 2)
    job = make_job(
        digits_url, policy, model="tests.models:wide_mlp", overlap_pull=True, job_id=f"pull-{policy}"
    )
    faults = FaultSchedule(seed=5).kill_worker(at_step=8).add_worker(at_step=12)
    result = train(job, cluster=cluster, faults=faults)
    assert [r.kind for r in faults.log] == ["kill", "add"]
    assert_same_parameters(result, reference(job))  # (which pulls and pushes whole)
    assert_ledger_exactly_once(result)
    # The loops read buckets: every step but a loop's first in a generation (which it fetches whole).
    assert sum(loop.pulled for loop in result.loops) > 0, result.loops
    # ... also of the 1 MB layer split across both data servers, joined as its pieces arrived.
    assert set(result.shard_plan[0]) & set(result.shard_plan[1]), result.shard_plan


@pytest.mark.parametrize("policy", POLICIES)
def test_a_worker_killed_between_its_buckets_leaves_no_shard_committed(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    """Members of two micro-batches a step each; from step 6 each waits between its two (the first one's
    buckets sent to both shards, the second not computed) and one is SIGKILLed there. Every shard holds
    parts of the open step and no seal of the killed member, so none commits it; the fence drops the
    parts, and the members left train the step again: the whole-push run's parameters, bit for bit, and
    every batch id once."""
    top_up(cluster, 2)
    members = len(cluster.elastic_addresses())  # (two, or more that earlier tests of the session left)
    job = make_job(
        digits_url, policy, model="tests.models:second_forward_gated_mlp", overlap_push=True,
        micro_batches=2 * members, job_id=f"between-{policy}",
    )  # fmt: skip
    result, killed = train_killing_a_waiting_member(cluster, job, members)
    assert "pid" in killed, "both members waited between their micro-batches"
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert [e for e in result.membership_events() if e.left], "the killed member left"
    dropped = sum(shard.get("parts_dropped", 0) for shard in result.shard_phases)
    assert dropped >= 2, "each shard held parts of the open step, dropped by the fence"
    assert all(shard["parts"] > 0 for shard in result.shard_phases), "both shards took parts"


@pytest.mark.parametrize("policy", POLICIES)
def test_buckets_applied_before_a_kill_are_dropped_with_their_step(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    """Members of two micro-batches a step each; from step 6 each waits in the backward of its second,
    after every layer but the first has its gradients (`backward_gated_mlp`): those buckets can be whole
    at the shards and applied into the copy the loops do not read. One member is SIGKILLed there. The
    fence drops whatever the open step held (and under `rollback` the shards go back to the snapshot):
    the whole-push run's parameters bit for bit, every batch id once."""
    top_up(cluster, 2)
    members = len(cluster.elastic_addresses())
    job = make_job(
        digits_url, policy, model="tests.models:backward_gated_mlp", overlap_push=True,
        micro_batches=2 * members, job_id=f"applied-{policy}",
    )  # fmt: skip
    result, killed = train_killing_a_waiting_member(cluster, job, members)
    assert "pid" in killed, "every member waited in its last backward"
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    phases = result.shard_phases
    # The fence dropped buckets applied into the other copy with their step (unless the members left had
    # trained the killed member's micro-batch as a backup, and committed the step, before the fence).
    undone = sum(shard.get("buckets_undone", 0) for shard in phases)
    keys = ("parts", "parts_dropped", "buckets_applied", "buckets_undone")
    assert undone >= 1 or result.counters["backups"] >= 1, (
        [{k: shard.get(k) for k in keys} for shard in phases],
        result.counters,
        killed,
    )
    # The steps that committed had their buckets applied before the commit, into the other copy.
    assert all(shard["buckets_applied"] > 0 for shard in phases if shard["parts"]), phases


def test_a_worker_killed_between_its_seals_costs_no_rollback(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """A member SIGKILLed after its seal to shard 0 (which then commits the step) and before its seal to
    shard 1: the shards stand a version apart. Shard 0 still holds the version before whole in its other
    copy, and steps back: no shard restores the snapshot and no committed step is lost (with gradients
    pushed whole, every shard goes back to the snapshot: `test_elastic.py`). The whole-push run's
    parameters bit for bit, every batch id once."""
    top_up(cluster, 2)
    job = make_job(digits_url, "reassign", overlap_push=True, job_id="between-seals")
    target = cluster.elastic_addresses()[0]
    result = train_killed_between_pushes(cluster, job, target)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert (result.counters["inconsistent_fences"], result.counters["steps_back"]) == (1, 1)
    (change,) = [e for e in result.membership_events() if target in e.left]
    assert "stepped back to step" in change.reason, change.reason
    assert change.steps_lost == 0 and change.step >= 8


def test_left_to_the_engine_a_big_model_pushes_whole_where_loops_and_data_servers_share_too_few_cores(
    cluster: LocalElasticCluster, digits_url: str
) -> None:
    """`overlap_push=None`, a model of 19 MB: the overlapped step would put the shards' work on backward's
    cores where a machine runs the loops and the data servers on fewer cores than they want
    (`compute.bucket_push.cores_short`), so the engine pushes whole there; with a core for each, it sends
    the gradients during backward. Which one this machine is, its cores say."""
    top_up(cluster, 2)
    loops = len(cluster.elastic_addresses())
    job = default_overlap_job(digits_url, "overlap-auto")
    result = train(job, cluster=cluster)
    assert_ledger_exactly_once(result)
    assert_pushed_as_the_cores_allow(result, loops)


def default_overlap_job(digits_url: str, job_id: str) -> ElasticJob:
    """A job of a 19 MB model that leaves `overlap_push` (and `overlap_pull`) to the engine."""
    return make_job(
        digits_url, "reassign", model="tests.models:big_mlp", overlap_push=None, overlap_pull=None, epochs=1,
        job_id=job_id,
    )  # fmt: skip


def cores_here(share: CpuShare | None = None) -> float:
    """The cores a process with `share` (None: this process's) may use: its CPU set, or fewer where its
    cgroups' CPU quotas allow fewer."""
    share = share or cpu_share()
    return min(float(len(share.cpus)), share.quota if share.quota is not None else float("inf"))


def assert_pushed_as_the_cores_allow(result: TrainResult, loops: int) -> None:
    """Every loop pushed whole if this machine runs the `loops` compute loops and the 2 data servers
    holding parameters (one thread each) on fewer cores; else in parts, during backward. (Every worker of
    a test cluster runs on this machine, with this process's CPU set and cgroup.)"""
    trained = [loop for loop in result.loops if loop.steps]
    assert trained, result.loops
    if cores_here() < 2 + loops:
        assert all(loop.parts == 0 for loop in trained), result.loops
    else:
        assert all(loop.parts >= 2 * loop.steps for loop in trained), result.loops
