"""A data server's static worker lost: a standby takes its role (seed 001), against what a user did before
it existed (the job fails, and a new run resumes from the persistent checkpoint).

Each scenario starts its own cluster of real processes: the shared pool has no standby, and these kill
static workers for good.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from prefect_elastic.errors import DataServerLostError
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, MembershipEvent, Progress
from prefect_elastic.training import train

from .elastic import make_job, next_commit, steady_throughput, summary

STANDBY_READY_S = 5.0


def standby_recovery(workload: str, data: str, kills: int, epochs: int, settle: int = 30) -> dict[str, Any]:
    """3 static workers (the job's roles on 2, one standby) and 2 compute workers; `kills` times, once
    training went `settle` steps on the current placement and a snapshot of that time is confirmed,
    SIGKILL the static worker of data server 1 for good and start a new static worker (the next standby).

    Per kill: seconds from the kill to the next committed step, and its parts: detection (the kill to the
    controller seeing it), then the promotion's own parts (`TrainResult.promotions`), then the first step.
    """
    with LocalElasticCluster(static_workers=3, elastic_workers=2) as cluster:
        kill_times: list[float] = []
        since: dict[str, int] = {}  # the placement of data server 1 -> the step it was first seen at
        listed: dict[str, float] = {}  # standby -> when it was first listed

        def on_progress(p: Progress) -> None:
            if len(kill_times) >= kills or p.state != "running" or p.lost_shards or not p.data_servers:
                return
            holder = p.data_servers[1]
            first = since.setdefault(holder, p.committed_steps)
            if first < 0:
                return  # killed, not replaced yet
            now = time.time()
            for w in p.standbys:
                listed.setdefault(w, now)
            # A standby that has been there a while, as in a job that runs for hours (one that joined a
            # second ago is still importing the model, which a promotion onto it waits for).
            ready = any(now - listed[w] >= STANDBY_READY_S for w in p.standbys)
            settled = p.committed_steps >= first + settle and p.snapshot_step >= first + settle // 2
            if settled and ready:
                kill_times.append(time.time())
                cluster.kill_worker(holder)
                since[holder] = -1
                cluster.add_worker(static=True, wait=False)  # the standby for the next kill

        job = make_job(workload, data, micro_batches=2, epochs=epochs, policy="reassign", job_id="standby")
        result = train(job, cluster=cluster, on_progress=on_progress)
    kills_out: list[dict[str, Any]] = []
    for kill, promotion in zip(kill_times, result.promotions, strict=False):
        nc = next_commit(result, kill)
        kills_out.append(
            {
                "recovery_s": None if nc is None else nc - kill,
                "detect_s": promotion.seen - kill,
                "suspend_s": promotion.suspend,
                "start_s": promotion.start,
                "adopt_s": promotion.adopt,
                "promote_s": promotion.promote,
                "first_step_s": None if nc is None else nc - (promotion.seen + promotion.seconds),
                "steps_redone": next(
                    (e.steps_lost for e in result.events if e.kind == "promoted" and e.time >= kill), None
                ),
                "source": promotion.source,
            }
        )
    recoveries = [k["recovery_s"] for k in kills_out if k["recovery_s"] is not None]
    return {
        "workload": workload,
        "kills": len(kill_times),
        "promotions": len(result.promotions),
        "per_kill": kills_out,
        "recovery_s": summary(recoveries) if recoveries else None,
        "parts_median_s": {
            part: statistics.median(k[part] for k in kills_out if k[part] is not None)
            for part in ("detect_s", "suspend_s", "start_s", "adopt_s", "promote_s", "first_step_s")
        }
        if kills_out
        else {},
        "step_s": statistics.median(
            b - a for a, b in zip(result.commit_times, result.commit_times[1:], strict=False)
        ),
    }


def restart_from_checkpoint(workload: str, data: str, epochs: int, kill_at: int = 30) -> dict[str, Any]:
    """What a user did before standbys: no standby, so the job fails when a data server's static worker
    dies; a static worker is started, and the job is run again, resuming from its persistent checkpoint
    (written at every snapshot). Measured: the kill to the failure, plus a new run's start to its first
    committed step (the new static worker's own start is left out, as a standby's is)."""
    with (
        tempfile.TemporaryDirectory() as folder,
        LocalElasticCluster(static_workers=2, elastic_workers=2) as cluster,
    ):
        job = make_job(workload, data, micro_batches=2, epochs=epochs, policy="reassign", job_id="restart")
        job = job.model_copy(
            update={"checkpoint": f"file://{folder}", "checkpoint_every": 1, "min_workers_timeout": 0.1}
        )
        killed: list[float] = []
        written = [0]  # the step of the last checkpoint written (a snapshot's event comes after its write)

        def on_event(e: MembershipEvent) -> None:
            if e.kind == EventKind.SNAPSHOT:
                written[0] = e.step

        def on_progress(p: Progress) -> None:
            if not killed and p.committed_steps >= kill_at and written[0] >= kill_at // 2:
                killed.append(time.time())
                cluster.kill_worker(p.data_servers[1])

        failed_at = None
        try:
            train(job, cluster=cluster, on_progress=on_progress, on_event=on_event)
        except DataServerLostError:
            failed_at = time.time()
        if failed_at is None or not killed:
            raise RuntimeError("the job did not fail after its data server's static worker was killed")
        cluster.add_worker(static=True, wait=True)
        again = time.time()
        result = train(job, cluster=cluster)
    resumed = next(t for t in result.commit_times if t == t)  # the first step this run committed (not nan)
    return {
        "workload": workload,
        "fail_s": failed_at - killed[0],
        "rerun_to_first_step_s": resumed - again,
        "recovery_s": (failed_at - killed[0]) + (resumed - again),
        "resumed_from": result.resumed_from,
    }


def replica_cost(workload: str, data: str, epochs: int, repeats: int) -> dict[str, Any]:
    """Steady throughput of one compute worker with peer replicas and without (`peer_replicas=False`),
    in alternating pairs on one cluster, snapshots every second; the cost is 1 - the median of the pairs'
    ratios (with over without)."""
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        job = make_job(workload, data, epochs=epochs, job_id="replicas")
        train(job.model_copy(update={"epochs": 1}), cluster=cluster)  # warm-up, uncounted
        pairs: list[dict[str, float]] = []
        for i in range(repeats):
            pair: dict[str, float] = {}
            for on in (True, False) if i % 2 == 0 else (False, True):
                result = train(job.model_copy(update={"peer_replicas": on}), cluster=cluster)
                pair["with" if on else "without"] = steady_throughput(result)
                pair["snapshots_with" if on else "snapshots_without"] = result.counters["snapshots"]
            pairs.append(pair)
    ratios = [p["with"] / p["without"] for p in pairs]
    return {
        "workload": workload,
        "pairs": pairs,
        "ratios": ratios,
        "cost": 1.0 - statistics.median(ratios),
    }
