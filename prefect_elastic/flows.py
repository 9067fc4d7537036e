"""The controller as a Prefect flow: `elastic_training(job, ...)`.

Its phases are Prefect tasks (validate, connect, start servers, restore, supervise, export), so the
Prefect UI shows where a run is. While it trains it keeps a progress artifact up to date, a table artifact
of membership events, and emits a Prefect event for every worker joined or lost, snapshot, rollback,
reassign, suspend and resume, with the flow run as a related resource, so automations can react. It ends
with a markdown summary. Cancelling the flow run stops training, writes a final checkpoint (when the job
has a checkpoint folder) and releases the actors; the run ends Cancelled.

Owns nothing of the training itself: it drives a `TrainingRun` (training/run.py) and reports. Reporting never
holds it up: artifacts and events go out from a thread of their own (`reporting.ReportSender`), which keeps
them while the Prefect API does not answer and sends them when it does. A job whose API stays away still
ends, its model written to `output`: the flow waits `END_REPORT_SECONDS` at most for the reports left, and
the caller of `elastic_training(...)` gets the job's result even when Prefect cannot record the run's end
(`ElasticTrainingFlow`). Why: docs/design/prefect-reporting.md.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar, overload

import fsspec
import torch
from distributed import Client
from prefect import Flow, Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.settings import Settings
from prefect.states import Cancelled, Completed, Failed, State

from .cluster import Connection, connect, tls_security
from .errors import TrainingStopped
from .flow_reports import CancelWatch, PrefectReporter
from .job import ElasticJob
from .messages import Progress
from .reporting import (
    is_outage,
)
from .training import Prepared, TrainingRun, TrainResult, prepare
from .training.pacing import PROGRESS_POLL_IDLE_SECONDS

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# At its end, the flow waits at most this long for the reports still waiting for the Prefect API (an API
# that answers takes milliseconds; one that restarts, seconds). Then it ends without them, and says so.
END_REPORT_SECONDS = 30.0
INTERRUPTED_REPORT_SECONDS = 2.0  # the same, when the flow was interrupted
# Before each phase the flow asks the API whether it answers, waiting at most this long: a phase runs as a
# Prefect task only if it does (`_phase`).
PHASE_CHECK_SECONDS = 5.0


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
    from .data.batches import BatchMaker

    maker = BatchMaker(prepared.batches)
    fields = prepared.batches.fields
    model = prepared.job.initial_model()
    model.load_state_dict(state)
    model.eval()
    right = seen = 0
    size = prepared.job.batch_size
    try:
        with torch.no_grad():
            for start in range(0, min(limit, prepared.dataset.length), size):
                chunk = list(range(start, min(start + size, limit, prepared.dataset.length)))
                batch = maker.of_samples(0, 0, chunk)
                predicted, target = fields.output_of(model, batch, torch.device("cpu"))
                if target is None or target.dim() != 1:
                    return None  # (class probabilities, or no target: no accuracy to say)
                right += int((predicted.argmax(dim=1) == target).sum())
                seen += len(chunk)
    finally:
        maker.close()
    return right / seen if seen else None


@dataclass
class RunEnding:
    """How one call of `elastic_training` ended, for its `ElasticTrainingFlow.__call__`: the body's own
    outcome (a result, or an error), whether the Prefect API answered at its end, and the Prefect settings
    the engine of this call runs with (a copy of its own, so that the body can shorten what the engine
    waits for when the API did not answer)."""

    settings: Settings | None = None
    finished: bool = False
    result: Any = None
    error: BaseException | None = None
    api_away: bool = False

    @staticmethod
    def current() -> RunEnding:
        """The ending of the `ElasticTrainingFlow` call running this body, or a fresh one nobody reads (the
        body called otherwise: as `elastic_training.fn` inside another flow, or by a deployment's engine)."""
        return _ENDING.get(None) or RunEnding()

    def end(self, reporter: PrefectReporter, result: Any = None, error: BaseException | None = None) -> None:
        # (An interrupt, Ctrl-C or the runner's SIGTERM, is not kept waiting for an API that is away.)
        interrupted = error is not None and not isinstance(error, Exception)
        reporter.close(
            min(END_REPORT_SECONDS, INTERRUPTED_REPORT_SECONDS) if interrupted else END_REPORT_SECONDS
        )
        self.finished, self.result, self.error = True, result, error
        self.api_away = not reporter.answering
        if self.api_away and self.settings is not None:
            # Prefect's engine records the run's end next, each call with 5 retries over about a minute (and
            # a failed one is followed by another, to record a failure). The API has not answered for
            # END_REPORT_SECONDS already: one try each, and `__call__` hands the caller the job's outcome.
            self.settings.client.max_retries = 0

    def for_caller(self, return_state: bool) -> Any:
        """What the call returns (or raises) when the engine could not record the end in the API: what the
        body returned or raised, as the engine would have handed it over."""
        if self.error is not None:
            if return_state and isinstance(self.error, Exception):
                return Failed(message=f"{type(self.error).__name__}: {self.error}", data=self.error)
            raise self.error
        if isinstance(self.result, State):  # Cancelled: the run was stopped
            if return_state:
                return self.result
            raise TrainingStopped(self.result.message or "the flow run was cancelled")
        if return_state:
            return Completed(
                data=self.result, message="the job completed; the Prefect API did not answer at its end"
            )
        return self.result


_ENDING: contextvars.ContextVar[RunEnding] = contextvars.ContextVar("prefect_elastic_run_ending")


class ElasticTrainingFlow(Flow[Any, Any]):
    """The flow of `elastic_training`: a Prefect `Flow` whose caller gets the job's outcome even when the
    Prefect API is away at the end of the run.

    Prefect's engine records the end of a run in the API after the body returns; with the API away that
    takes two calls of about a minute of retries each and then raises httpx's `ConnectError`, which would
    hide a job that completed (its model written to `output`). Here the body, once its reports waited
    `END_REPORT_SECONDS` for the API in vain, makes those calls one try each (`RunEnding.end`), and the
    call returns what the body returned (a `Completed` state when `return_state`) or raises what it raised,
    with a warning that Prefect did not record the end. An error of the API before the body ended is
    raised as Prefect raises it. A deployment's engine calls the body without this `__call__`: the job's
    result is written all the same, and its process ends once the engine gives up.
    """

    # (Typed as `elastic_training`'s calls are: Flow's own overloads are those of any sync or async fn.)
    @overload  # type: ignore[override]
    def __call__(
        self, *args: Any, return_state: Literal[True], wait_for: Any = None, **kwargs: Any
    ) -> State[dict[str, Any] | State[Any]]: ...

    @overload
    def __call__(
        self, *args: Any, return_state: Literal[False] = False, wait_for: Any = None, **kwargs: Any
    ) -> dict[str, Any] | State[Any]: ...

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:
        from prefect.settings import temporary_settings

        ending = RunEnding()
        token = _ENDING.set(ending)
        try:
            with temporary_settings() as settings:  # (a copy this call owns: `RunEnding.end` may change it)
                ending.settings = settings
                return super().__call__(*args, return_state=return_state, wait_for=wait_for, **kwargs)
        except Exception as exc:
            if not ending.finished or exc is ending.error or not is_outage(exc):
                raise
            log.warning(
                "the Prefect API did not answer at the end of the flow run (%s: %s): Prefect has not "
                "recorded how it ended, but the job's own outcome stands and is handed over",
                type(exc).__name__, exc,
            )  # fmt: skip
            return ending.for_caller(return_state)
        finally:
            _ENDING.reset(token)

    def with_options(self, **options: Any) -> ElasticTrainingFlow:
        # (Prefect's makes a plain Flow of the same fields: keep this class, which adds none.)
        plain = super().with_options(**options)
        made = ElasticTrainingFlow.__new__(ElasticTrainingFlow)
        made.__dict__.update(plain.__dict__)
        return made


def elastic_flow(**options: Any) -> Callable[[Callable[..., Any]], ElasticTrainingFlow]:
    """`@flow(**options)`, making an `ElasticTrainingFlow`."""

    def make(fn: Callable[..., Any]) -> ElasticTrainingFlow:
        return ElasticTrainingFlow(fn, **options)

    return make


@elastic_flow(name="elastic-training", log_prints=True)
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
    `{"ca_file": ..., "cert": ..., "key": ...}` (`cluster.connection.tls_security`); a `cluster` object
    with TLS carries its own, and without either Dask's `distributed.comm.tls` config applies.
    """
    prepared = validate_job(job)
    security = tls_security(tls)
    reporter = PrefectReporter(prepared.job, flow_run.id)
    ending = RunEnding.current()
    try:
        outcome = _train(
            prepared, reporter, address, cluster_class, cluster_kwargs, adapt_kwargs, output, cluster,
            static_workers, security,
        )  # fmt: skip
    except BaseException as exc:
        ending.end(reporter, error=exc)
        raise
    ending.end(reporter, result=outcome)
    return outcome


def _train(
    prepared: Prepared,
    reporter: PrefectReporter,
    address: str | None,
    cluster_class: str | None,
    cluster_kwargs: dict[str, Any] | None,
    adapt_kwargs: dict[str, Any] | None,
    output: str | None,
    cluster: Any,
    static_workers: int | None,
    security: Any,
) -> dict[str, Any] | State:
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
                _phase(reporter, start_servers)(run)
                progress = _phase(reporter, supervise)(run)
                try:
                    result, written = _phase(reporter, export)(run, progress, output)
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


def _phase(reporter: PrefectReporter, phase: Task[P, R]) -> Callable[P, R]:
    """A phase as its Prefect task while the API answers, and as its function alone while it does not:
    the task's record would not reach the API, and each of its state changes would wait in Prefect's
    events worker, which holds the process's exit for every one (about 7 s each with the API away)."""
    return phase if reporter.sender.confirm(PHASE_CHECK_SECONDS) else phase.fn


def _security_of(where: Connection) -> Any:
    return getattr(where.cluster, "security", None)


def _log_connection(where: Connection) -> None:
    kind = type(where.cluster).__name__ if where.cluster is not None else "running cluster"
    get_run_logger().info("cluster: %s at %s", kind, where.address)
