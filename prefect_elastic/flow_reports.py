"""What the flow reports to Prefect while a job trains (`PrefectReporter`: the progress artifact, the table of
membership events, a Prefect event per worker joined or lost, snapshot, rollback, reassign, suspend and
resume, the summary at the end), and how it hears that its run is cancelled (`CancelWatch`). Everything goes
out through `reporting.ReportSender`, from a thread of its own: reporting never holds training up.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any
from uuid import UUID

from prefect import get_run_logger
from prefect.context import FlowRunContext
from prefect.events import Event

from .job import ElasticJob
from .messages import MembershipEvent, Progress
from .modes import mode_of
from .reporting import (
    REQUEST_TIMEOUT_SECONDS,
    ArtifactReport,
    ProgressReport,
    ReportSender,
    Unsent,
)
from .training import TrainResult

log = logging.getLogger(__name__)

# The progress artifact is updated at most this often: each update is a call to the Prefect API.
PROGRESS_UPDATE_SECONDS = 1.0
# How often the flow asks the Prefect API whether its run is being cancelled.
CANCEL_POLL_SECONDS = 1.0


class PrefectReporter:
    """Turns the controller's progress and events into Prefect artifacts, events and log lines.

    Every call returns at once: what it makes waits in a `ReportSender`, whose thread sends it to the API
    (and keeps it while the API does not answer). `close` waits a bounded time for what is left.
    """

    def __init__(self, job: ElasticJob, flow_run_id: str | None) -> None:
        self.job = job
        self.flow_run_id = flow_run_id
        self.key = _artifact_key(job.job_id)
        self.rows: list[dict[str, Any]] = []
        self.logger = get_run_logger()
        self.related = _run_resources(flow_run_id)
        self.last_update = 0.0
        self.last_fraction = -1.0
        self.waiting = False
        self.sender = ReportSender(flow_run_id)

    @property
    def answering(self) -> bool:
        """Whether the Prefect API answered the last report sent (True before the first)."""
        return self.sender.answering

    def start(self, resumed_step: int, total_steps: int) -> None:
        self._progress(resumed_step / max(1, total_steps))

    def _progress(self, fraction: float) -> None:
        self.sender.set_progress(
            ProgressReport(
                percent=100.0 * fraction,
                key=f"{self.key}-progress",
                description=(
                    f"share of the schedule of job {self.job.job_id} committed ({self.job.mode} mode)"
                ),
            )
        )

    def progress(self, p: Progress) -> None:
        fraction = p.committed_steps / max(1, p.total_steps)
        now = time.monotonic()
        due = now - self.last_update >= PROGRESS_UPDATE_SECONDS or p.state in ("done", "failed")
        if not due or fraction == self.last_fraction:
            return
        self.last_update, self.last_fraction = now, fraction
        self._progress(fraction)

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
            self.sender.put_artifact(
                ArtifactReport(
                    key=f"{self.key}-membership",
                    kind="table",
                    data=list(self.rows),
                    description=f"membership events of job {self.job.job_id}",
                )
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
        # (Stamped now: an event sent after an outage keeps the time it happened.)
        self.sender.emit(
            Event(
                event=f"prefect-elastic.{what}",
                resource={  # type: ignore[arg-type]  # (validated into a Resource)
                    "prefect.resource.id": f"prefect-elastic.job.{self.job.job_id}",
                    "prefect.resource.name": self.job.job_id,
                },
                related=self.related,  # type: ignore[arg-type]
                payload=payload,
            )
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
        if mode_of(self.job.mode).stale_gradients:
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
        self.sender.put_artifact(
            ArtifactReport(
                key=f"{self.key}-summary",
                kind="markdown",
                data="\n".join(lines),
                description="training summary",
            )
        )

    def close(self, timeout: float) -> Unsent:
        """Wait at most `timeout` seconds for the reports still waiting; what did not go out is said in a
        warning (and returned)."""
        unsent = self.sender.close(timeout)
        if not unsent.nothing:
            log.warning(
                "job %s: the Prefect API at %s did not answer for the last %.0f s; not sent: %s. The "
                "job's own result does not depend on it",
                self.job.job_id, self.sender.api_url, self.sender.silent_for(), unsent.describe(),
            )  # fmt: skip
        return unsent


def _run_resources(flow_run_id: str | None) -> list[dict[str, str]]:
    """The related resources of the job's events: the flow run, its flow, deployment and tags, from the
    run's context (as Prefect's own events worker would attach them, without asking the API)."""
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    related: list[dict[str, str]] = []
    if flow_run_id:
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                "prefect.resource.role": "flow-run",
                **({"prefect.resource.name": run.name} if run is not None else {}),
            }
        )
    if run is not None and context is not None:
        related.append(
            {
                "prefect.resource.id": f"prefect.flow.{run.flow_id}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": context.flow.name if context.flow is not None else "",
            }
        )
        if run.deployment_id:
            related.append(
                {
                    "prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                    "prefect.resource.role": "deployment",
                }
            )
        related += [
            {"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"} for tag in run.tags
        ]
    return related


def _artifact_key(job_id: str) -> str:
    # Artifact keys allow lowercase letters, digits and dashes only.
    return "".join(c if c.isalnum() else "-" for c in job_id.lower()).strip("-") or "job"


class CancelWatch:
    """Sets `stop` once the flow run is being cancelled in Prefect (polled from a thread)."""

    def __init__(self, flow_run_id: str | None) -> None:
        self.flow_run_id = flow_run_id
        self.stop = threading.Event()
        self._done = threading.Event()
        # (In a copy of the flow's context: the same Prefect settings.)
        self._thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._watch,),
            name="prefect-elastic-cancel-watch",
            daemon=True,
        )

    def __enter__(self) -> CancelWatch:
        if self.flow_run_id:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        import httpx
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        # One try per poll, bounded: with Prefect's retries a read during an outage would take a minute,
        # and a cancel made once the API is back would wait for it.
        with (
            temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}),
            get_client(
                httpx_settings={"timeout": httpx.Timeout(REQUEST_TIMEOUT_SECONDS)}, sync_client=True
            ) as client,
        ):
            while not self._done.wait(CANCEL_POLL_SECONDS):
                try:
                    state = client.read_flow_run(UUID(str(self.flow_run_id))).state
                except Exception as exc:  # the API may be briefly unreachable; keep watching
                    log.debug("cancel watch: %s", exc)
                    continue
                if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
                    self.stop.set()
                    return
