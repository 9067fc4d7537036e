"""The controller as a Prefect flow: `elastic_training(job, ...)`.

Its phases are Prefect tasks (validate, connect, start servers, restore, supervise, export), so the
Prefect UI shows where a run is. While it trains it keeps a progress artifact up to date, a table artifact
of membership events, and emits a Prefect event for every worker joined or lost, snapshot, rollback,
reassign, suspend and resume, with the flow run as a related resource, so automations can react. It ends
with a markdown summary. Cancelling the flow run stops training, writes a final checkpoint (when the job
has a checkpoint folder) and releases the actors; the run ends Cancelled.

Owns nothing of the training itself: it drives a `TrainingRun` (training.py) and reports.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any
from uuid import UUID

import fsspec
import torch
from distributed import Client
from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.states import Cancelled, State

from .connect import Connection, connect, tls_security
from .errors import TrainingStopped
from .job import ElasticJob
from .messages import MembershipEvent, Progress
from .training import PROGRESS_POLL_IDLE_SECONDS, Prepared, TrainingRun, TrainResult, prepare

log = logging.getLogger(__name__)

# The progress artifact is updated at most this often: each update is a call to the Prefect API.
PROGRESS_UPDATE_SECONDS = 1.0
# How often the flow asks the Prefect API whether its run is being cancelled.
CANCEL_POLL_SECONDS = 1.0


class PrefectReporter:
    """Turns the controller's progress and events into Prefect artifacts, events and log lines."""

    def __init__(self, job: ElasticJob, flow_run_id: str | None) -> None:
        self.job = job
        self.flow_run_id = flow_run_id
        self.key = _artifact_key(job.job_id)
        self.rows: list[dict[str, Any]] = []
        self.logger = get_run_logger()
        self.progress_id: UUID | None = None
        self.last_update = 0.0
        self.last_fraction = -1.0
        self.waiting = False

    def start(self, resumed_step: int, total_steps: int) -> None:
        fraction = resumed_step / max(1, total_steps)
        self.progress_id = create_progress_artifact(  # type: ignore[assignment]
            progress=100.0 * fraction,
            key=f"{self.key}-progress",
            description=f"share of the schedule of job {self.job.job_id} committed ({self.job.mode} mode)",
        )

    def progress(self, p: Progress) -> None:
        fraction = p.committed_steps / max(1, p.total_steps)
        now = time.monotonic()
        due = now - self.last_update >= PROGRESS_UPDATE_SECONDS or p.state in ("done", "failed")
        if self.progress_id is None or not due or fraction == self.last_fraction:
            return
        self.last_update, self.last_fraction = now, fraction
        update_progress_artifact(self.progress_id, progress=100.0 * fraction)

    def event(self, e: MembershipEvent) -> None:
        table = (
            "start",
            "rollback",
            "reassign",
            "waiting",
            "failed",
            "shard-lost",
            "promoted",
            "kept",
            "excluded",
        )
        if e.kind in table:
            self.rows.append(
                {
                    "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)),
                    "generation": e.generation,
                    "live workers": len(e.workers),
                    "decision": e.kind,
                    "joined": ", ".join(e.joined),
                    "lost": ", ".join(e.left),
                    "steps lost": e.steps_lost,
                    "micro-batches trained again": e.batches_dropped,
                    "seconds": round(e.seconds, 3),
                    "step": e.step,
                    "reason": e.reason,
                }
            )
            create_table_artifact(
                self.rows,
                key=f"{self.key}-membership",
                description=f"membership events of job {self.job.job_id}",
            )
            self.logger.info(
                "generation %d, step %d: %s (%d live workers)",
                e.generation,
                e.step,
                e.kind.value,
                len(e.workers),
            )
        for worker in e.joined:
            self._emit("worker.joined", e, worker=worker)
        for worker in e.left:
            # (An exclusion names the worker whose model failed; the membership change after it, which
            # takes its share away, reports it as lost.)
            self._emit("worker.excluded" if e.kind == "excluded" else "worker.lost", e, worker=worker)
        if e.kind in ("snapshot", "rollback", "reassign"):
            self._emit(e.kind.value, e)
        elif e.kind == "shard-lost":
            self._emit("data-server.lost", e)
        elif e.kind == "promoted":
            self._emit("standby.promoted", e)
        if e.kind == "waiting" and not self.waiting:
            self.waiting = True
            self._emit("suspended", e)
        elif (
            e.kind in ("start", "rollback", "reassign")
            and self.waiting
            and len(e.workers) >= self.job.min_workers
        ):
            self.waiting = False
            self._emit("resumed", e)

    def _emit(self, what: str, e: MembershipEvent, worker: str | None = None) -> None:
        related = []
        if self.flow_run_id:
            related.append(
                {
                    "prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}",
                    "prefect.resource.role": "flow-run",
                }
            )
        payload: dict[str, Any] = {
            "generation": e.generation,
            "step": e.step,
            "live_workers": list(e.workers),
            "steps_lost": e.steps_lost,
            "batches_dropped": e.batches_dropped,
            "seconds": e.seconds,
            "reason": e.reason,
        }
        if worker is not None:
            payload["worker"] = worker
        emit_event(
            event=f"prefect-elastic.{what}",
            resource={
                "prefect.resource.id": f"prefect-elastic.job.{self.job.job_id}",
                "prefect.resource.name": self.job.job_id,
            },
            related=related,
            payload=payload,
        )

    def summary(self, result: TrainResult, output: str | None, accuracy: float | None) -> None:
        joined = sum(len(e.joined) for e in result.membership_events())
        lost = sum(len(e.left) for e in result.membership_events())
        samples = result.total_batches * self.job.batch_size
        lines = [
            f"# Job `{self.job.job_id}`",
            "",
            "| | |",
            "|---|---|",
            f"| steps | {result.steps} of {result.total_steps} |",
            f"| final loss | {result.history[-1]:.4f} |" if result.history else "| final loss | - |",
            f"| accuracy (training data) | {accuracy:.3f} |" if accuracy is not None else "| accuracy | - |",
            f"| throughput | {samples / max(result.elapsed, 1e-9):.0f} samples/s, {result.elapsed:.1f} s |",
            f"| failures survived | {lost} workers lost, {joined} joined, generation {result.generation} |",
            f"| committed steps undone | {result.steps_lost} (policy {self.job.on_membership_change}) |",
            f"| resumed from | {result.resumed_from or '-'} |",
            f"| last checkpoint | {result.checkpoint or '-'} |",
            f"| model written to | {output or '-'} |",
            f"| mode | {self.job.mode} |",
        ]
        if self.job.mode == "async":
            lines += [
                f"| candidate steps | {result.candidate_steps} of {result.total_batches} batch ids |",
                f"| refused as stale | {result.counters.get('stale_refusals', 0)} gradients "
                f"(max_staleness {self.job.max_staleness}) |",
                "",
                "Staleness of the applied gradients (versions a shard moved on since the parameters a "
                "gradient was computed on):",
                "",
                "| staleness | batch ids |",
                "|---|---|",
                *(f"| {s} | {n} |" for s, n in result.staleness.items()),
            ]
        create_markdown_artifact("\n".join(lines), key=f"{self.key}-summary", description="training summary")


def _artifact_key(job_id: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in job_id.lower()).strip("-") or "job"


class CancelWatch:
    """Sets `stop` once the flow run is being cancelled in Prefect (polled from a thread)."""

    def __init__(self, flow_run_id: str | None) -> None:
        self.flow_run_id = flow_run_id
        self.stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefect-elastic-cancel-watch", daemon=True)

    def __enter__(self) -> CancelWatch:
        if self.flow_run_id:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not self._done.wait(CANCEL_POLL_SECONDS):
                try:
                    state = client.read_flow_run(UUID(str(self.flow_run_id))).state
                except Exception as exc:  # the API may be briefly unreachable; keep watching
                    log.debug("cancel watch: %s", exc)
                    continue
                if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
                    self.stop.set()
                    return


@task(name="validate job", cache_policy=NO_CACHE)
def validate_job(job: ElasticJob | str) -> Prepared:
    return prepare(job)


@task(name="start data servers and coordinator", cache_policy=NO_CACHE)
def start_servers(run: TrainingRun) -> None:
    run.start()


@task(name="restore", cache_policy=NO_CACHE)
def restore(prepared: Prepared) -> int:
    """Report where the run starts: the newest checkpoint's step, or 0."""
    resumed = prepared.persistence.resumed
    logger = get_run_logger()
    if resumed is None:
        logger.info("no checkpoint to resume from; training starts at step 0")
        return 0
    logger.info("resuming from %s at step %d", prepared.persistence.resumed_from, resumed.committed_steps)
    return resumed.committed_steps


@task(name="supervise", cache_policy=NO_CACHE)
def supervise(run: TrainingRun) -> Progress:
    return run.supervise()


@task(name="export", cache_policy=NO_CACHE)
def export(run: TrainingRun, progress: Progress, output: str | None) -> tuple[TrainResult, str | None]:
    result = run.finish(progress)
    if output is not None:
        # (The job's storage_options for that URL's protocol: an s3:// output needs its endpoint too.)
        with fsspec.open(output, "wb", **run.job.storage_for(output)) as f:
            torch.save(result.state_dict, f)
    return result, output


def training_accuracy(prepared: Prepared, state: dict[str, torch.Tensor], limit: int = 4096) -> float | None:
    """Accuracy on (up to `limit` samples of) the training data, for classification jobs."""
    if prepared.job.loss != "cross_entropy":
        return None
    from .dataset import load_partition

    x, y = load_partition(prepared.dataset, 0, min(limit, prepared.dataset.total))
    model = prepared.job.initial_model()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1)
    return float((predicted == torch.from_numpy(y)).float().mean())


@flow(name="elastic-training", log_prints=True)
def elastic_training(
    job: ElasticJob | str,
    address: str | None = None,
    cluster_class: str | None = None,
    cluster_kwargs: dict[str, Any] | None = None,
    adapt_kwargs: dict[str, Any] | None = None,
    output: str | None = None,
    cluster: Any = None,
    static_workers: int | None = None,
    tls: dict[str, str] | None = None,
) -> dict[str, Any] | State:
    """Train an `ElasticJob` (or the job in a YAML file) on a Dask cluster.

    The cluster: `address` of a running scheduler, or `cluster_class` (import path) with `cluster_kwargs`
    and `adapt_kwargs`, or nothing for a local cluster of 2 static and 2 elastic worker processes.
    `cluster`: a Dask cluster object made by the caller (in-process runs only; it is not closed here).
    `output`: an fsspec URL where the final `state_dict` is written with `torch.save`.
    `static_workers`: static workers to add to the `cluster_class` cluster (a dask-jobqueue cluster such
    as `dask_jobqueue.SLURMCluster`, or any `SpecCluster`): jobs that carry the static resource, kept out
    of adaptive scaling; `adapt_kwargs`' minimum and maximum then count elastic workers only. Jobs that
    end (lifetime, walltime, scancel) are replaced. Without a cluster: the local cluster's static workers.
    See docs/slurm.md.
    `tls`: for a cluster with TLS reached by `address`, the files of this client's side:
    `{"ca_file": ..., "cert": ..., "key": ...}` (`connect.tls_security`); a `cluster` object with TLS
    carries its own, and without either Dask's `distributed.comm.tls` config applies.
    """
    prepared = validate_job(job)
    security = tls_security(tls)
    reporter = PrefectReporter(prepared.job, flow_run.id)
    start_step = restore(prepared)
    reporter.start(start_step, prepared.schedule.total_steps)
    with connect(
        address,
        cluster_class,
        cluster_kwargs,
        adapt_kwargs,
        cluster=cluster,
        static_resource=prepared.job.static_resource,
        static_workers=static_workers,
        security=security,
    ) as where:
        _log_connection(where)
        with (
            CancelWatch(flow_run.id) as watch,
            # (A cluster with TLS, such as LocalElasticCluster(security=True), carries its Security.)
            Client(where.address, set_as_default=False, security=security or _security_of(where)) as client,
            client.as_current(),
        ):
            # The reporter updates the UI at most once a second: the idle poll serves it.
            run = TrainingRun(
                client,
                prepared,
                on_progress=reporter.progress,
                on_event=reporter.event,
                stop=watch.stop,
                progress_poll=PROGRESS_POLL_IDLE_SECONDS,
                cluster=where.cluster,
            )
            try:
                start_servers(run)
                progress = supervise(run)
                try:
                    result, written = export(run, progress, output)
                except TrainingStopped as stopped:
                    return Cancelled(message=f"cancelled: {stopped}")
            finally:
                run.release()
    reporter.summary(result, written, training_accuracy(prepared, result.state_dict))
    return {
        "job_id": prepared.job.job_id,
        "steps": result.steps,
        "final_loss": result.history[-1] if result.history else None,
        "generation": result.generation,
        "steps_lost": result.steps_lost,
        "checkpoint": result.checkpoint,
        "output": written,
        "elapsed": result.elapsed,
        "total_steps": result.total_steps,
        "batches_committed": len(result.ledger),
        "exactly_once": [e.batch_id for e in result.ledger] == list(range(result.total_batches)),
        "snapshots": result.counters.get("snapshots", 0),
        "batches_dropped": result.batches_dropped,
        "events": json.loads(json.dumps([e.__dict__ for e in result.membership_events()], default=str)),
    }


def _security_of(where: Connection) -> Any:
    return getattr(where.cluster, "security", None)


def _log_connection(where: Connection) -> None:
    kind = type(where.cluster).__name__ if where.cluster is not None else "running cluster"
    get_run_logger().info("cluster: %s at %s", kind, where.address)
