"""A data server's static worker lost: a standby takes its role, against what a user did before
it existed (the job fails, and a new run resumes from the persistent checkpoint).

Each scenario starts its own cluster of real processes: the shared pool has no standby, and these kill
static workers for good.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from prefect_elastic.checkpoint import Checkpoint, CheckpointStore
from prefect_elastic.data_server import DataServer, plan_shards, warm_standby
from prefect_elastic.errors import DataServerLostError
from prefect_elastic.job import ElasticJob
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, MembershipEvent, Progress
from prefect_elastic.training import prepare, train

from .elastic import make_job, next_commit, snapshot_excess, snapshot_windows, steady_throughput, summary

STANDBY_READY_S = 5.0


def standby_recovery(
    workload: str,
    data: str,
    kills: int,
    epochs: int,
    settle: int = 30,
    role: str = "data-server",
    ready_s: float = STANDBY_READY_S,
) -> dict[str, Any]:
    """3 static workers (the job's roles on 2, one standby) and 2 compute workers; `kills` times, once
    training went `settle` steps on the current placement and a snapshot of that time is confirmed,
    SIGKILL the static worker of data server 1 (`role` "coordinator": of the coordinator, which shares it
    with a data server) for good and start a new static worker (the next standby). A standby is killed onto
    only once it has been listed `ready_s` seconds (the smoke run waits less: it checks the code).

    Per kill: seconds from the kill to the next committed step, and its parts: detection (the kill to the
    controller seeing it), the coordinator's rebuild (for the coordinator), then the promotion's own parts
    (`TrainResult.promotions`), then the first step.
    """
    with LocalElasticCluster(static_workers=3, elastic_workers=2) as cluster:
        kill_times: list[float] = []
        since: dict[str, int] = {}  # the placement of data server 1 -> the step it was first seen at
        listed: dict[str, float] = {}  # standby -> when it was first listed

        def on_progress(p: Progress) -> None:
            if len(kill_times) >= kills or p.state != "running" or p.lost_shards or not p.data_servers:
                return
            holder = p.data_servers[1] if role == "data-server" else str(p.coordinator_at)
            first = since.setdefault(holder, p.committed_steps)
            if first < 0:
                return  # killed, not replaced yet
            now = time.time()
            for w in p.standbys:
                listed.setdefault(w, now)
            # A standby that has been there a while, as in a job that runs for hours (one that joined a
            # second ago is still importing the model, which a promotion onto it waits for).
            ready = any(now - listed[w] >= ready_s for w in p.standbys)
            settled = p.committed_steps >= first + settle and p.snapshot_step >= first + settle // 2
            if settled and ready:
                kill_times.append(time.time())
                cluster.kill_worker(holder)
                since[holder] = -1
                cluster.add_worker(static=True, wait=False)  # the standby for the next kill

        job = make_job(workload, data, micro_batches=2, epochs=epochs, policy="reassign", job_id="standby")
        result = train(job, cluster=cluster, on_progress=on_progress)
    rebuilds = [e for e in result.events if e.kind == EventKind.COORDINATOR_REBUILT]
    kills_out: list[dict[str, Any]] = []
    for n, (kill, promotion) in enumerate(zip(kill_times, result.promotions, strict=False)):
        nc = next_commit(result, kill)
        rebuilt = rebuilds[n] if role == "coordinator" and n < len(rebuilds) else None
        seen = promotion.seen if rebuilt is None else rebuilt.time - rebuilt.seconds
        kills_out.append(
            {
                "recovery_s": None if nc is None else nc - kill,
                "detect_s": seen - kill,
                "rebuild_s": None if rebuilt is None else rebuilt.seconds,
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
        "role": role,
        "kills": len(kill_times),
        "coordinator_rebuilds": len(rebuilds),
        "promotions": len(result.promotions),
        "per_kill": kills_out,
        "recovery_s": summary(recoveries) if recoveries else None,
        "parts_median_s": {
            part: statistics.median(k[part] for k in kills_out if k[part] is not None)
            for part in (
                "detect_s",
                "rebuild_s",
                "suspend_s",
                "start_s",
                "adopt_s",
                "promote_s",
                "first_step_s",
            )
            if any(k[part] is not None for k in kills_out)
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
        # Twice from the same checkpoint (each run goes on writing its own copy): as a user runs a job
        # again, in a new process (a script, `prefect-elastic train`), and in this process, whose imports
        # and connection are warm already (the floor of any run again). Each on a static worker just
        # started, as after a real loss: the first run on a new worker pays its imports (docs/benchmarks.md,
        # "Standby static workers": a standby must be warm), and a second run on the same worker would not.
        copy = Path(folder) / "copy"
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("copy"))
        fresh = cluster.add_worker(static=True, wait=True)
        again = time.time()
        new_process_first = _first_commit_in_a_new_process(
            job.model_copy(update={"checkpoint": f"file://{copy}"}), cluster.scheduler_address
        )
        cluster.retire_worker(fresh)
        cluster.add_worker(static=True, wait=True)
        again_here = time.time()
        result = train(job, cluster=cluster)
    resumed = next(t for t in result.commit_times if t == t)  # the first step this run committed (not nan)
    fail_s = failed_at - killed[0]
    return {
        "workload": workload,
        "fail_s": fail_s,
        "rerun_to_first_step_s": resumed - again_here,
        "recovery_s": fail_s + (resumed - again_here),
        "new_process_to_first_step_s": new_process_first - again,
        "recovery_new_process_s": fail_s + (new_process_first - again),
        "resumed_from": result.resumed_from,
    }


# A run of the job again in a process of its own, as a user's script does; prints its first commit's time.
_RERUN = """
import sys
from prefect_elastic import ElasticJob, train
result = train(ElasticJob.model_validate_json(sys.argv[1]), address=sys.argv[2])
print("first-commit", next(t for t in result.commit_times if t == t))
"""


def _first_commit_in_a_new_process(job: ElasticJob, address: str) -> float:
    root = Path(__file__).resolve().parent.parent  # (the model is imported from `benchmarks`)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", _RERUN, job.model_dump_json(), address],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("first-commit ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the run again in a new process failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    return float(lines[-1].split()[1])


def replica_cost(workload: str, data: str, epochs: int, repeats: int) -> dict[str, Any]:
    """Steady throughput of one compute worker with peer replicas and without (`peer_replicas=False`),
    in alternating pairs on one cluster, snapshots every second; the cost is 1 - the median of the pairs'
    ratios (with over without).

    Inside each run too (`elastic.snapshot_excess`): what the steps near a snapshot took over the others,
    a snapshot's window running from the shards' own copies to the end of their copies to the peers. With
    replicas it is what snapshots and replicas cost together, a bound on the replicas' share that no drift
    of the machine between two runs moves (how far the pairs spread: docs/benchmarks.md, "Standby static
    workers")."""
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        job = make_job(workload, data, epochs=epochs, job_id="replicas")
        train(job.model_copy(update={"epochs": 1}), cluster=cluster)  # warm-up, uncounted
        pairs: list[dict[str, float]] = []
        for i in range(repeats):
            pair: dict[str, float] = {}
            for on in (True, False) if i % 2 == 0 else (False, True):
                result = train(job.model_copy(update={"peer_replicas": on}), cluster=cluster)
                side = "with" if on else "without"
                pair[side] = steady_throughput(result)
                pair[f"snapshots_{side}"] = result.counters["snapshots"]
                pair[f"in_run_{side}"] = snapshot_excess(result.commit_times, snapshot_windows(result))[
                    "overhead"
                ]
            pairs.append(pair)
    ratios = [p["with"] / p["without"] for p in pairs]
    return {
        "workload": workload,
        "pairs": pairs,
        "ratios": ratios,
        "cost": 1.0 - statistics.median(ratios),
        "in_run_with": statistics.median(p["in_run_with"] for p in pairs),
        "in_run_without": statistics.median(p["in_run_without"] for p in pairs),
    }


def _actors_on(address: str, dask_scheduler: Any = None) -> int:
    """How many actors the scheduler places on the worker at ``address`` (run on the scheduler)."""
    worker = dask_scheduler.workers.get(address)
    return 0 if worker is None else len(worker.actors)


def _drop_page_cache() -> bool:
    """Empty the kernel's page cache (root only), so a file read next comes from the disk."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def shard_restore(data: str, repeats: int, model: str = "benchmarks.workloads:wide_mlp") -> dict[str, Any]:
    """A data server's shard of 200 MB (`model`, by default `workloads.wide_mlp`: the 5000x5000 weight and its
    SGD momentum; the smoke run's `wide_mlp_smoke` makes one of 8 MB) restored on a standby, `repeats`
    times each way, in one run: from its peer's memory (a data server
    started empty, then `DataServer.adopt`: the peer sends its replica straight to the standby), against
    from a checkpoint file on the local disk (read and unpickled by the controller, sent to the standby's
    worker, and the data server started from it: what a restart does, and what the checkpoint fallback
    does). Both include starting the data server (reading its data partition). The file is read with the
    page cache emptied first (`cold`) and again right after (`warm`). Every restore is on a static worker
    just started and warmed, as every real promotion is: a process's first large allocation is its slow
    one (the kernel may compact memory for huge pages first), and a second restore in one process reads
    several times faster than any promotion would."""
    from distributed import Client

    # (1 MiB: the smoke run's small shards split as the 200 MB one does, its own weight on one server)
    job = make_job("mlp", data, job_id="restore").model_copy(
        update={"model": model, "min_shard_bytes": 2**20}
    )
    prepared = prepare(job)
    _, initial = job.initial_tensors()
    plan = plan_shards(initial, job.data_servers, job.min_shard_bytes)
    index = max(range(len(plan)), key=lambda i: sum(initial[n].numel() for n in plan[i]))
    shards: list[dict[str, torch.Tensor]] = [{n: initial[n] for n in names} for names in plan]
    optimizers: list[dict[str, Any]] = []
    for params in shards:
        tensors = [t.detach().clone().requires_grad_(True) for t in params.values()]
        optimizer = job.build_optimizer(tensors)
        for t in tensors:
            t.grad = torch.zeros_like(t)
        optimizer.step()  # the momentum buffers exist from the first step on
        optimizers.append(optimizer.state_dict())
    shard_bytes = sum(t.numel() * t.element_size() for t in shards[index].values()) * 2  # + momentum

    def start(client: Client, where: str, i: int, tensors: list[Any], version: int) -> Any:
        return client.submit(
            DataServer, i, prepared.specs.shard, prepared.batches, prepared.schedule, *tensors, version,
            mode=prepared.mode.applies, actor=True, workers=[where], allow_other_workers=False, pure=False,
        )  # fmt: skip

    with (
        tempfile.TemporaryDirectory() as folder,
        LocalElasticCluster(static_workers=2, elastic_workers=0, memory_limit="8GiB") as cluster,
        Client(cluster.scheduler_address, set_as_default=False) as client,
        client.as_current(),  # actor handles bind to the current client
    ):
        holder, peer_at = cluster.static_addresses()[:2]

        def fresh_standby() -> tuple[str, str]:
            """A static worker just started and warmed as the controller warms a standby: each promotion
            lands on a standby whose process has never held a shard, so every restore here is a first."""
            name = cluster.add_worker(static=True, wait=True)
            where = cluster.address_of(name)
            assert where is not None
            client.submit(warm_standby, prepared.specs.shard, workers=[where], pure=False).result()
            return name, where

        def retire(name: str, where: str) -> None:
            """Retire a standby once the scheduler has let go of the actor on it: a cancel reaches the
            scheduler asynchronously, and Dask refuses to retire a worker that still holds an actor."""
            deadline = time.monotonic() + 30
            while client.run_on_scheduler(_actors_on, where):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the scheduler still holds an actor on {where} 30 s after its cancel")
                time.sleep(0.05)
            cluster.retire_worker(name)

        live = []
        for i, where in ((index, holder), (1 - index, peer_at)):
            scattered = client.scatter([shards[i], {}, optimizers[i]], workers=[where], hash=False)
            live.append(start(client, where, i, scattered, 1).result())
        shard, peer = live
        shard.set_peer(0, peer).result()
        deadline = time.monotonic() + 120
        while not shard.status(0).result().snapshots:  # reported once the replica is whole on the peer
            if time.monotonic() > deadline:
                raise RuntimeError("the shard's replica did not reach its peer in 120 s")
            time.sleep(0.05)
        store = CheckpointStore(f"file://{folder}")
        store.write(
            Checkpoint(
                job_id=job.job_id, fingerprint=prepared.persistence.expected, generation=0, committed_steps=1,
                ledger=[], history=[], tensors=dict(initial), optimizers=optimizers,
            )
        )  # fmt: skip
        file_bytes = sum(p.stat().st_size for p in Path(folder).glob("ckpt-*.pt"))
        peer_runs: list[dict[str, float]] = []
        file_runs: list[dict[str, Any]] = []
        for _ in range(repeats):
            name, standby = fresh_standby()
            began = time.perf_counter()
            empty = start(client, standby, index, [{}, {}, None], 1)
            restored = empty.result()
            started = time.perf_counter() - began
            restored.adopt(peer, 1).result()
            peer_runs.append({"start_s": started, "restore_s": time.perf_counter() - began - started})
            client.cancel([empty])
            del restored
            retire(name, standby)
            for cache in ("cold", "warm"):
                name, standby = fresh_standby()
                cold = _drop_page_cache() if cache == "cold" else False
                began = time.perf_counter()
                found = store.latest()
                assert found is not None
                checkpoint = found[0]
                start_state = prepared.persistence.shard_start(index, plan[index], checkpoint)
                read = time.perf_counter() - began
                scattered = client.scatter(
                    [start_state.params, start_state.buffers, start_state.optimizer_state],
                    workers=[standby],
                    hash=False,
                )
                future = start(client, standby, index, scattered, start_state.version)
                future.result()
                total = time.perf_counter() - began
                file_runs.append({"cache": cache, "dropped": cold, "read_s": read, "total_s": total})
                client.cancel([future, *scattered])
                del checkpoint, start_state, found
                retire(name, standby)
    peer_total = [r["start_s"] + r["restore_s"] for r in peer_runs]
    cold_total = [r["total_s"] for r in file_runs if r["cache"] == "cold"]
    warm_total = [r["total_s"] for r in file_runs if r["cache"] == "warm"]
    return {
        "shard_mb": shard_bytes / 1e6,
        "checkpoint_file_mb": file_bytes / 1e6,
        "peer": peer_runs,
        "file": file_runs,
        "peer_s": summary(peer_total),
        "peer_restore_s": summary([r["restore_s"] for r in peer_runs]),
        "start_s": summary([r["start_s"] for r in peer_runs]),
        "file_cold_s": summary(cold_total),
        "file_warm_s": summary(warm_total),
        "speedup_cold": statistics.median(cold_total) / statistics.median(peer_total),
        "speedup_warm": statistics.median(warm_total) / statistics.median(peer_total),
        "page_cache_dropped": all(r["dropped"] for r in file_runs if r["cache"] == "cold"),
    }
