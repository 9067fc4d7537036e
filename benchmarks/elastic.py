"""prefect-elastic runs for the benchmark suite: a real LocalElasticCluster, real processes, real kills."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from prefect_elastic import ElasticJob
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import Progress
from prefect_elastic.training import TrainResult, train

from .workloads import LR, MOMENTUM, THREADS, WORKLOADS


def make_job(
    workload: str,
    data: str,
    *,
    micro_batches: int = 1,
    epochs: int = 1,
    liveness_interval: float = 1.0,
    policy: str = "rollback",
    job_id: str = "bench",
    mode: str = "sync",
    overlap_push: bool | None = None,
) -> ElasticJob:
    # batch_size is per micro-batch: one micro-batch (128 unless the workload says otherwise) is exactly the
    # plain loop's step.
    return ElasticJob(
        job_id=job_id,
        model=WORKLOADS[workload].model,
        dataset=f"file://{data}",
        optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        batch_size=WORKLOADS[workload].batch,
        micro_batches=micro_batches,
        epochs=epochs,
        data_servers=2,
        liveness_interval=liveness_interval,
        on_membership_change=policy,
        threads_per_worker=THREADS,
        min_workers=1,
        mode=mode,
        overlap_push=overlap_push,
    )


class ClusterPool:
    """One LocalElasticCluster shared by the scenarios (2 static workers), resized to the compute workers
    each needs: starting a cluster costs seconds that the suite would otherwise pay per scenario."""

    def __init__(self) -> None:
        self.cluster: LocalElasticCluster | None = None

    @contextlib.contextmanager
    def elastic(self, workers: int) -> Iterator[LocalElasticCluster]:
        if self.cluster is None:
            self.cluster = LocalElasticCluster(static_workers=2, elastic_workers=workers).start()
        cluster = self.cluster
        cluster.wait_for_pending()  # a worker added by the last scenario may still be starting
        names = cluster.worker_names(static=False)
        for name in names[workers:]:
            cluster.retire_worker(name)
        for _ in range(workers - len(names)):
            cluster.add_worker()
        yield cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None


def run(cluster: LocalElasticCluster, job: ElasticJob) -> tuple[TrainResult, float]:
    """Train `job` on `cluster`; returns the result and the wall time the call took."""
    started = time.time()
    result = train(job, cluster=cluster)
    return result, time.time() - started


def steady_throughput(result: TrainResult, skip: int = 5) -> float:
    """Samples per second between the `skip`-th committed step and the last one."""
    times = result.commit_times
    skip = min(skip, (len(times) - 2) // 2)  # tiny (smoke) runs skip less
    steps = len(times) - 1 - skip
    if steps < 1:
        raise ValueError(f"too few steps ({len(times)}) for a steady-state figure")
    # (In async mode a step is one micro-batch.)
    samples = result.job.batch_size * (1 if result.job.mode == "async" else result.job.micro_batches)
    return steps * samples / (times[-1] - times[skip])


def snapshot_excess(
    commit_times: list[float], windows: list[tuple[float, float]], skip: int = 5
) -> dict[str, Any]:
    """The time snapshots added to a run, measured inside the run: no second run, so no drift between runs.

    `windows` are the (start, end) of each snapshot. A step "near" a snapshot is one whose interval
    between commits overlaps a window widened by one typical step on each side (the controller's
    membership query comes just before the window; a slowed reply may land in the next step). The excess
    is the time those steps took over what as many of the other steps take on average; divided by the
    run's time, it is the share of throughput the snapshots cost. Two biases, both small here: a long step
    overlaps a window more often, so near steps are a little longer even without any cost (the figure
    errs high); a cost landing more than one step after its window counts among the typical steps (it
    errs low). `placebo_windows` shows what the measure reads where there is nothing to find.
    """
    times = commit_times[min(skip, (len(commit_times) - 2) // 2) :]  # tiny (smoke) runs skip less
    gaps = list(itertools.pairwise(times))
    if len(gaps) < 2:
        raise ValueError(f"too few steps ({len(commit_times)}) to measure snapshots")
    margin = statistics.median(b - a for a, b in gaps)
    inside = [(s, e) for s, e in windows if e > times[0] and s < times[-1]]
    wide = [(s - margin, e + margin) for s, e in inside]
    near: list[float] = []
    far: list[float] = []
    for a, b in gaps:
        (near if any(a < e and b > s for s, e in wide) else far).append(b - a)
    typical = statistics.mean(far) if far else margin
    excess = sum(near) - len(near) * typical
    return {
        "overhead": excess / (times[-1] - times[0]),
        "excess_s": excess,
        "snapshots": len(wide),
        "near_steps": len(near),
        "step_s": typical,
        "window_s": statistics.mean(e - s for s, e in inside) if inside else 0.0,
    }


def snapshot_windows(result: TrainResult) -> list[tuple[float, float]]:
    return [(e.time - e.seconds, e.time) for e in result.events if e.kind == "snapshot"]


def placebo_windows(result: TrainResult, every: float, length: float) -> list[tuple[float, float]]:
    """Windows where snapshots would have been, in a run without them: `snapshot_excess` of these is
    what the measure reads when there is nothing to find (its zero)."""
    first, last = result.commit_times[0], result.commit_times[-1]
    return [(t, t + length) for t in np.arange(first + every, last, every).tolist()]


def step_gaps(result: TrainResult) -> list[float]:
    return [b - a for a, b in zip(result.commit_times, result.commit_times[1:], strict=False)]


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


class SchedulerWatch:
    """Times at which the scheduler registered workers, from its own event log (its own clock)."""

    def __init__(self, cluster: LocalElasticCluster) -> None:
        self.client = cluster.client(set_as_default=False)
        self.added: list[tuple[float, str]] = []
        self.client.subscribe_topic("all", self._on_event)

    def _on_event(self, event: Any) -> None:
        stamp, msg = event if isinstance(event, tuple) else (time.time(), event)
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "add-worker":
            self.added.append((float(stamp), str(msg.get("worker"))))

    def __enter__(self) -> SchedulerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.client.unsubscribe_topic("all")
        self.client.close()


def first_commit_of(result: TrainResult, worker: str, after: float) -> float | None:
    """When the first step holding a batch that `worker` computed committed (after `after`)."""
    steps = sorted({e.step for e in result.ledger if e.worker == worker})
    for step in steps:
        if step < len(result.commit_times) and result.commit_times[step] >= after:
            return result.commit_times[step]
    return None


def next_commit(result: TrainResult, after: float) -> float | None:
    later = [t for t in result.commit_times if t > after]
    return min(later) if later else None


COMPUTE_PHASE = "compute"  # the compute loop's phase of forward and backward (LoopStats.phases)
SHARD_PHASES = ("handle", "send", "apply")  # the times among a data server's `phases` (not its counts)


def fixed_cost(result: TrainResult, skip: int = 5) -> dict[str, Any]:
    """What a step costs beyond its compute: the wall time per committed step of the steady part of the run
    (as `steady_throughput` counts it) minus the compute loops' compute time per step.

    The phases (`LoopStats.phases`, seconds summed per phase name over the run) are given per step, in ms,
    whatever their names; they are summed over every loop of the run and divided by the steps the loops
    trained (by the committed steps where the loops do not count theirs). With one worker and one
    micro-batch a step, the compute phase is forward and backward of the plain loop's step.
    """
    times = result.commit_times
    skip = min(skip, (len(times) - 2) // 2)
    if len(times) - 1 - skip < 1:
        raise ValueError(f"too few steps ({len(times)}) for a step time")
    step_s = (times[-1] - times[skip]) / (len(times) - 1 - skip)
    # The loops' phases from their steady steps on (leaving out each loop's first steps, as the step time
    # leaves out the first commits), else over the whole run.
    steady = sum(loop.steady_steps for loop in result.loops)
    phases: dict[str, float] = {}
    for loop in result.loops:
        for name, seconds in (loop.steady_phases if steady else loop.phases).items():
            phases[name] = phases.get(name, 0.0) + seconds
    counted = steady or sum(loop.steps for loop in result.loops)
    steps = counted or result.steps
    phase_ms = {name: 1000 * seconds / max(1, steps) for name, seconds in phases.items()}
    compute_ms = phase_ms.get(COMPUTE_PHASE)
    # The shards' side of the step path, per committed step: each shard's `handle` (its part of the push
    # and the answer, the optimizer step included), `apply` (the optimizer step alone) and `send`.
    shard_ms = [
        {k: 1000 * v / max(1, result.steps) for k, v in shard.items() if k in SHARD_PHASES}
        for shard in result.shard_phases
    ]
    return {
        "shard_ms": shard_ms,
        # Frames with tensors each shard received through shared memory and through its sockets.
        "shard_bodies": [
            {way: int(shard.get(f"bodies_{way}", 0)) for way in ("shared", "socket")}
            for shard in result.shard_phases
        ],
        "step_ms": 1000 * step_s,
        "compute_ms": compute_ms,
        "fixed_ms": None if compute_ms is None else 1000 * step_s - compute_ms,
        "phase_ms": phase_ms,
        "phase_sum_ms": sum(phase_ms.values()),
        "phase_steps": steps,
        "phase_steps_from": "steady loop steps" if steady else ("loops" if counted else "commits"),
    }


def steady(
    pool: ClusterPool,
    workload: str,
    data: str,
    epochs: int,
    liveness_interval: float,
    workers: int = 1,
    overlap_push: bool | None = None,
) -> dict[str, Any]:
    """`workers` compute workers, sync mode, one micro-batch (of the workload's batch) per worker and step.
    With one worker, the step of the plain loop, plus the framework; with two, the step of DDP with two
    processes."""
    with pool.elastic(workers) as cluster:
        job = make_job(
            workload, data, micro_batches=workers, epochs=epochs, liveness_interval=liveness_interval,
            job_id=f"steady-{workers}", overlap_push=overlap_push,
        )  # fmt: skip
        result, wall = run(cluster, job)
    cost = fixed_cost(result)
    return {
        "system": "prefect-elastic",
        "workload": workload,
        "workers": workers,
        "micro_batches": job.micro_batches,
        "liveness_interval": liveness_interval,
        "overlap_push": overlap_push,
        "steps": result.steps,
        "samples_per_s": steady_throughput(result),
        "snapshots": result.counters.get("snapshots", 0),
        "in_run": snapshot_excess(result.commit_times, snapshot_windows(result)),
        # Without periodic snapshots: where they would have been, every second, 5 ms long.
        "placebo": snapshot_excess(result.commit_times, placebo_windows(result, 1.0, 0.005)),
        **cost,
        "wall_s": wall,
    }


def scaling(pool: ClusterPool, workload: str, data: str, workers: int, epochs: int) -> dict[str, Any]:
    """Throughput with `workers` compute workers; a step is 4 micro-batches of 128 whatever the count."""
    with pool.elastic(workers) as cluster:
        job = make_job(workload, data, micro_batches=4, epochs=epochs, job_id=f"scale-{workers}")
        result, wall = run(cluster, job)
    return {
        "workload": workload,
        "workers": workers,
        "samples_per_s": steady_throughput(result),
        "steps": result.steps,
        "wall_s": wall,
    }


def recovery(
    pool: ClusterPool, workload: str, data: str, policy: str, kills: int, epochs: int, settle_steps: int = 20
) -> dict[str, Any]:
    """Two compute workers; `kills` times SIGKILL one (its nanny starts it again, so it rejoins).

    Measures, per kill: seconds from the kill to the next committed step (recovery), and for the worker
    that comes back, seconds from its registration with the scheduler to its first committed batch
    (scale-up). The run uses micro_batches=2, so each worker computes one micro-batch of 128 per step.
    """
    with pool.elastic(2) as cluster, SchedulerWatch(cluster) as sched:
        kill_times: list[float] = []
        # Kill when both workers have trained together for `settle_steps` steps since the last one came back.
        together_since: int | None = None

        def on_progress(p: Progress) -> None:
            nonlocal together_since
            if len(p.workers) < 2 or p.state != "running":
                together_since = None
                return
            if together_since is None:
                together_since = p.committed_steps
            if len(kill_times) < kills and p.committed_steps >= together_since + settle_steps:
                victim = sorted(cluster.elastic_addresses())[len(kill_times) % 2]
                kill_times.append(time.time())
                cluster.kill_worker(victim, restart=True)  # its nanny starts it again: it rejoins
                together_since = None

        job = make_job(workload, data, micro_batches=2, epochs=epochs, policy=policy, job_id=f"rec-{policy}")
        started = time.time()
        result = train(job, cluster=cluster, on_progress=on_progress)
        wall = time.time() - started
    recoveries = [nc - k for k in kill_times if (nc := next_commit(result, k)) is not None]
    joins = [(t, w) for t, w in sched.added if t > started]
    scale_up = [fc - t for t, w in joins if (fc := first_commit_of(result, w, t)) is not None]
    step_s = statistics.median(step_gaps(result))
    losses = [e for e in result.membership_events() if e.left]
    # Work redone per failure: committed steps undone, plus the dropped micro-batches of the step in flight
    # (each a 1/micro_batches share of a step); in seconds at the median step time.
    lost = [e.steps_lost + e.batches_dropped / job.micro_batches for e in losses]
    return {
        "workload": workload,
        "policy": policy,
        "kills": len(kill_times),
        "recovery_s": summary(recoveries) if recoveries else None,
        "scale_up_s": summary(scale_up) if scale_up else None,
        "liveness_interval": job.liveness_interval,
        "median_step_s": step_s,
        "steps_lost": [e.steps_lost for e in losses],
        "batches_dropped": [e.batches_dropped for e in losses],
        "lost_steps_per_failure": statistics.mean(lost) if lost else 0.0,
        "lost_seconds_per_failure": step_s * statistics.mean(lost) if lost else 0.0,
        "steps": result.steps,
        "wall_s": wall,
    }


def timeline(
    pool: ClusterPool, workload: str, data: str, epochs: int, kill_at: float, join_at: float
) -> dict[str, Any]:
    """Two compute workers; one SIGKILLed for good at `kill_at` s, a new one started at `join_at` s.

    Returns every committed step (time from the start of training, loss) and the events with their times,
    for the plot beside torchrun's run of the same kill and join.
    """
    with pool.elastic(2) as cluster, SchedulerWatch(cluster) as sched:
        marks: list[dict[str, Any]] = []
        first: list[float] = []

        def on_progress(p: Progress) -> None:
            if p.committed_steps == 0:
                return
            if not first:
                first.append(time.time())
            elapsed = time.time() - first[0]
            if not any(m["kind"] == "kill" for m in marks) and elapsed >= kill_at:
                victim = sorted(cluster.elastic_addresses())[0]
                marks.append({"kind": "kill", "t": time.time(), "worker": victim})
                cluster.kill_worker(victim)
            if not any(m["kind"] == "join" for m in marks) and elapsed >= join_at:
                marks.append({"kind": "join", "t": time.time()})
                cluster.add_worker(wait=False)

        job = make_job(workload, data, micro_batches=2, epochs=epochs, job_id="timeline")
        result = train(job, cluster=cluster, on_progress=on_progress)
    t0 = first[0] if first else result.commit_times[0]
    marks += [{"kind": "registered", "t": t, "worker": w} for t, w in sched.added if t > t0]
    marks += [
        {"kind": e.kind, "t": e.time, "steps_lost": e.steps_lost, "batches_dropped": e.batches_dropped}
        for e in result.membership_events()
    ]
    samples = job.batch_size * job.micro_batches
    return {
        "system": "prefect-elastic",
        "workload": workload,
        "steps": [
            {"t": t - t0, "step": i, "loss": loss, "samples": samples}
            for i, (t, loss) in enumerate(zip(result.commit_times, result.history, strict=True))
        ],
        "events": sorted(({**m, "t": m["t"] - t0} for m in marks), key=lambda m: m["t"]),
        "policy": job.on_membership_change,
    }
