"""One run of a job on a connected client (`TrainingRun`), in phases: `start`, `supervise`, `finish`,
`release`. The run makes the owners of the controller's state (`RoleTable`, `Workers`, `EngineLoads`,
`ComputeLoops`, `RecordCopy`, `SchedulerWatch`, and its `MembershipState`) and the objects that act on
them (`Calls`, `Actors`, `StandbyChoice`, `CheckpointFallback`, `Promotions`, `StaticRoles`, `Ending`),
each handed the others it needs; its supervision loop carries out the membership decision (`membership.py`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from distributed import Client

from ..cluster import (
    WORKER_EVENTS_TOPIC,
)
from ..compute import MIN_LEASE
from ..errors import (
    ElasticError,
    FatalError,
    SchedulerLostError,
)
from ..messages import (
    EventKind,
    MembershipEvent,
    Progress,
)
from ..registry import publish_progress, release_job
from .actors import Actors
from .calls import Calls
from .ending import Ending
from .engine import EngineLoads
from .fallback import CheckpointFallback
from .loops import ComputeLoops
from .membership import (
    AskMembers,
    Check,
    Hold,
    MembershipState,
    Seen,
    check_due,
    checked,
    decide,
    look_due,
    looked,
    role_changes,
)
from .pacing import (
    PROGRESS_POLL_IDLE_SECONDS,
    PROGRESS_POLL_SECONDS,
    PUBLISH_SECONDS,
)
from .prepare import Prepared
from .promotion import Promotions
from .record_copy import RecordCopy
from .result import FaultInjector, TrainResult
from .role_table import RoleTable
from .roles import StaticRoles
from .scheduler import SCHEDULER_GRACE_SECONDS, SCHEDULER_POLL_SECONDS, SchedulerWatch
from .signals import CoordinatorLost, EngineSignal, SchedulerGone
from .standby import StandbyChoice
from .workers import Workers, members_answering

log = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


def public_errors(
    phase: Callable[Concatenate[TrainingRun, P], R],
) -> Callable[Concatenate[TrainingRun, P], R]:
    """A phase of the run that raises only the public errors of `prefect_elastic.errors`, whatever failed
    inside it (`TrainingRun.public_error`): what `train()` and the flow raise is the contract."""

    @functools.wraps(phase)
    def run_phase(self: TrainingRun, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return phase(self, *args, **kwargs)
        except ElasticError:
            raise
        except Exception as exc:
            raise self.public_error(exc) from exc

    return run_phase


class TrainingRun:
    """One run of a job on a connected client, in phases: `start`, `supervise`, `finish`, `release`.

    `train()` runs them in a row; the Prefect flow runs each as a task, so the UI shows the phase.
    """

    def __init__(
        self,
        client: Client,
        prepared: Prepared,
        *,
        on_progress: Callable[[Progress], None] | None = None,
        on_event: Callable[[MembershipEvent], None] | None = None,
        faults: FaultInjector | None = None,
        stop: threading.Event | None = None,
        progress_poll: float | None = None,
        cluster: Any = None,
    ) -> None:
        self.client = client
        # The cluster object, when the caller has one: the workers it started that have not registered yet
        # (`requested`, as Dask's SpecCluster and dask-jobqueue clusters keep it) join as one group.
        self.cluster = cluster
        self.job = prepared.job
        self.dataset = prepared.dataset
        self.schedule = prepared.schedule
        self.mode = prepared.mode  # what differs between sync and async mode (`modes.py`)
        self.specs = prepared.specs  # what each role is handed of the job
        self.persistence = prepared.persistence
        self.layout = prepared.persistence.layout
        self.stop = stop
        self.on_progress = on_progress
        self.on_event = on_event
        self.faults = faults
        self.run_id = uuid.uuid4().hex[:8]
        # Seconds between progress polls: fast where a caller acts on steps, unless it says otherwise.
        acts_on_steps = faults is not None or on_progress is not None
        fast_enough = PROGRESS_POLL_SECONDS if acts_on_steps else PROGRESS_POLL_IDLE_SECONDS
        self.progress_poll = fast_enough if progress_poll is None else progress_poll
        self.stopping = False  # the controller was asked to stop (`stop`)
        self._published = 0.0
        self.started = time.monotonic()
        self.committed_seen = 0  # the committed steps of the last progress read
        self.worker_event = threading.Event()
        # Set with `worker_event` by all but an add-worker event: a check that must run now, not wait for
        # a worker still starting (`membership.wait_for_start`).
        self.check_now = False
        self.membership = MembershipState()
        # The owners of the controller's state, each handed the others it needs (docs/architecture.md,
        # "Who owns what in the controller").
        keys = f"prefect-elastic-{self.job.job_id}-{self.run_id}"
        self.role_table = RoleTable()
        self.engine = EngineLoads(client, keys, self._check_soon)
        # (The members are the membership's, read by the workers' view: `Workers.members`.)
        self.workers = Workers(
            client, self.job, self.mode, self.role_table, self.engine, cluster, lambda: self.membership.known
        )
        self.calls = Calls(self.job, self.role_table, self.workers, self.schedule.total_steps)
        self.actors = Actors(
            client, prepared, self.run_id, self.progress_poll, self.role_table, self.workers, self.engine,
            self.calls,
        )  # fmt: skip
        self.compute = ComputeLoops(client, prepared, keys)
        self.record = RecordCopy(self.calls, self.role_table)
        standbys = StandbyChoice(self.job, self.role_table, self.workers)
        fallback = CheckpointFallback(
            client,
            prepared,
            self.role_table,
            self.calls,
            self.actors,
            standbys,
            self.record,
            self._check_soon,
        )
        self.promotion = Promotions(
            client, prepared, self.role_table, self.workers, self.calls, self.actors, standbys, self.record,
            fallback, self.compute,
        )  # fmt: skip
        self.roles = StaticRoles(
            client, prepared, keys, self.role_table, self.workers, self.calls, self.actors, self.engine,
            self.promotion, fallback, self.compute, self.record, self._check_soon,
        )  # fmt: skip
        self.scheduler = SchedulerWatch(client, self.job)
        self.ending = Ending(
            self.job, self.schedule, self.role_table, self.calls, self.persistence, self.compute
        )

    @public_errors
    def start(self) -> None:
        """Register the job id, start the data servers and the coordinator, watch the scheduler."""
        self.started = time.monotonic()
        self.actors.register()
        # Watched from the start: a static worker lost while the servers start is a start to try again.
        self.client.subscribe_topic("all", self._on_scheduler_event)
        self.client.subscribe_topic(WORKER_EVENTS_TOPIC, self._on_scheduler_event)
        elastic = self.workers.view().listed  # (their engine loads while the servers start)
        self.actors.start_servers()
        # The compute workers there from the start are its first members, not joins a moment later.
        for where in sorted(elastic):
            with contextlib.suppress(Exception):  # (gone, or failed: the membership tells, as for any)
                self.actors.await_engine(where, self.job.call_timeout, elastic=True)
        # (After their engines loaded: the call reads each one's cores, on its event loop.)
        self.specs = self.actors.overlap_decided(self.specs, self.role_table.plan, elastic)
        self.record.update()
        log.info("%s", self.mode.describe(self.job, self.schedule, MIN_LEASE))

    @public_errors
    def supervise(self) -> Progress:
        """Run survival detection and compute loops until the job is done, failed or asked to stop; a
        coordinator whose static worker dies is rebuilt on another one meanwhile."""
        while True:
            try:
                try:
                    return self._supervise()
                except CoordinatorLost as exc:
                    # A call may have broken because the scheduler went, not the coordinator: nothing can
                    # be rebuilt without it, and each call would wait for the client's reconnect (30 s).
                    # Wait for the client to have its scheduler again (a moment's reconnect) or to give it
                    # up. (The rebuild's own calls to the scheduler may break the same way: below.)
                    while not self.scheduler.up():
                        time.sleep(SCHEDULER_POLL_SECONDS)
                    self.roles.rebuild_coordinator(str(exc))
            except SchedulerGone as gone:
                raise self.scheduler_lost(gone.seconds) from None
            except Exception:
                # Whatever failed, with the scheduler gone that is why (the client cancels every future,
                # the compute loops' included, the moment it loses the scheduler).
                if not self.scheduler.lost_within(SCHEDULER_GRACE_SECONDS):
                    raise
                raise self.scheduler_lost(0.0) from None

    def public_error(self, exc: Exception) -> ElasticError:
        """What a phase raises for `exc`, which is none of the public errors: the scheduler's loss if the
        client lost it (Dask then cancels the job's futures, whatever failed first), what an engine signal
        nothing answered means, or `unexpected`."""
        if isinstance(exc, ElasticError):
            return exc
        if self.client.status != "running":
            return self.scheduler_lost(0.0)
        if isinstance(exc, EngineSignal):
            return exc.public(self.job.job_id)
        return self.unexpected(exc)

    def scheduler_lost(self, seconds: float) -> SchedulerLostError:
        """The error that stops a job without its scheduler (`SchedulerWatch.lost_error`)."""
        return self.scheduler.lost_error(
            seconds, self.committed_seen, self.schedule.total_steps, self.persistence, self._last_words
        )

    def _last_words(self, timeout: float) -> int:
        """With the scheduler back: the coordinator stopped and a last checkpoint written; its step."""
        step = self.committed_seen
        with contextlib.suppress(Exception):
            step = self.calls.call(self.role_table.coordinator.stop("the Dask scheduler was lost"), timeout)
        with contextlib.suppress(Exception):
            self.persistence.write(self.role_table.coordinator, self.role_table.shards, timeout)
        return step

    def unexpected(self, exc: BaseException) -> FatalError:
        """The public error for a failure no other error names (`Ending.unexpected`)."""
        return self.ending.unexpected(exc, self.committed_seen)

    @public_errors
    def finish(self, progress: Progress) -> TrainResult:
        """Write the last checkpoint and collect the result; raise what ended a failed or stopped run."""
        return self.ending.finish(progress, stopping=self.stopping, started=self.started)

    def _on_scheduler_event(self, event: Any) -> None:
        msg = event[1] if isinstance(event, tuple) else event
        if isinstance(msg, dict) and msg.get("action") in (
            "add-worker",
            "worker-running",
            "remove-worker",
            "retire-workers",
        ):
            if msg.get("action") != "add-worker":
                self.check_now = True  # (an add-worker alone may wait for the worker to turn running)
            if msg.get("action") == "remove-worker" and isinstance(msg.get("worker"), str):
                self.workers.worker_left(msg["worker"])
            if msg.get("action") == "retire-workers":
                # The scheduler refuses to retire a worker that holds an actor: a static worker with a role
                # of this job. The controller hands its roles over, then retires it (`StaticRoles.hand_over`).
                self.workers.retire_asked(str(w) for w in msg.get("could-not-retire") or ())
            self.worker_event.set()

    def _check_soon(self) -> None:
        """Wake the supervision loop for a survival check at once (one that does not wait for a worker
        that is still starting)."""
        self.check_now = True
        self.worker_event.set()

    def _supervise(self) -> Progress:
        """The supervision loop: each pass reads the events (a worker event, the timers of `membership`),
        asks `membership` for the decision, carries it out, then reads progress."""
        job, table = self.job, self.role_table
        # The timers start afresh (a rebuilt coordinator is checked at once); the members are kept: its first
        # check re-admits them (they are not joins to wait on for the rest of a group).
        self.membership = MembershipState(known=self.membership.known)
        # `table.coordinator` is read anew at each use: a hand-over rebuilds it in the middle of a pass.
        while True:
            if not self.scheduler.up():
                # Nothing about membership can be learned without it: wait, briefly, for it to come back.
                time.sleep(min(0.1, job.liveness_interval))
                continue
            now = time.monotonic()
            triggered = self.worker_event.is_set()
            if look_due(self.membership, now, triggered):
                view = self.workers.view()
                self.roles.keep_roles(view)
                self.membership, triggered = looked(
                    self.membership, now, view.live, view.starting, self.compute.ended(view.live)
                )
            if check_due(self.membership, now, triggered) and not self._membership_pass(now, triggered):
                continue
            progress: Progress = self.calls.call(table.coordinator.progress())
            if self.record.behind(progress.events):
                # Recorded between survival checks (a snapshot confirmed by every shard, a promotion, a
                # worker excluded): copied now, so that a coordinator lost before the next check does not
                # take them from `result.events`.
                self.record.update()
            # A call to a shard failed before its worker left the scheduler's list: the coordinator reported
            # it (no view read here: the placement stands for the live static workers).
            held = {*table.placement, table.coordinator_at}
            for change in role_changes(table.coordinator_at, table.placement, held, progress.lost_shards):
                self.roles.carry_out(change)
                progress = self.calls.call(table.coordinator.progress())
            progress = replace(
                progress,
                data_servers=tuple(table.placement),
                coordinator_at=table.coordinator_at,
                standbys=table.standbys,
            )
            self._publish(progress)
            self.committed_seen = progress.committed_steps
            if self.on_progress is not None:
                self.on_progress(progress)
            if progress.state in ("done", "failed"):
                return progress
            if self.stop is not None and self.stop.is_set():
                self.stopping = True
                return progress
            if self.faults is not None:
                self.faults.apply(progress)
            wait = min(self.progress_poll, self.membership.next_check - time.monotonic())
            self.worker_event.wait(timeout=max(0.0, wait))

    def _membership_pass(self, now: float, triggered: bool) -> bool:
        """A pass whose check is due: the decision (`membership.decide`) carried out. False if it held the
        check (the pass starts over)."""
        job, table = self.job, self.role_table
        self.worker_event.clear()
        must_check, self.check_now = self.check_now, False
        view = self.workers.view()
        self.roles.keep_roles(view)
        seen = Seen(
            live=tuple(view.live), starting=view.starting, pending=view.pending,
            restarts=self.compute.to_restart(view.live), triggered=triggered, must_check=must_check,
        )  # fmt: skip
        decision = decide(self.membership, seen, now, job.liveness_interval)
        if isinstance(decision, AskMembers):
            answering = members_answering(self.client, set(decision.workers), decision.seconds)
            decision = decide(decision.state, replace(seen, answering=answering), now, job.liveness_interval)
        self.membership = decision.state
        if isinstance(decision, Hold):
            self.worker_event.wait(timeout=decision.seconds)  # woken by the next event
            if decision.check_soon:
                self._check_soon()  # look again at once
            return False
        assert isinstance(decision, Check)
        renew = self.compute.ensure(view, table.coordinator, table.plan, self.specs.loop)
        # It may wait for a sync in progress, then call every shard: each bounded by call_timeout.
        events: list[MembershipEvent] = self.calls.call(
            table.coordinator.survival_check(
                list(decision.live), decision.reason, renew, sorted(view.graceful)
            ),
            timeout=3 * job.call_timeout,
        )
        self.membership = checked(self.membership, time.monotonic(), view.starting, job.liveness_interval)
        self.record.update()
        for event in events:
            if event.kind is EventKind.SNAPSHOT:
                self.persistence.after_snapshot(
                    table.coordinator, table.shards, job.call_timeout, self.on_event
                )
            if self.on_event is not None:
                self.on_event(event)
        return True

    def _publish(self, progress: Progress) -> None:
        # Anyone with a client to the cluster can follow the job (`read_progress`), at a cost of one small
        # scheduler call every PUBLISH_SECONDS.
        now = time.monotonic()
        if now - self._published < PUBLISH_SECONDS and progress.state == "running":
            return
        self._published = now
        publish_progress(self.client, self.job.job_id, progress)

    def release(self) -> None:
        """Stop loops, drop the actors, unregister the job; safe to call after any failure."""
        table = self.role_table
        if self.client.status != "running":
            # The scheduler is gone: it cancelled every future already, and a call to it would wait for
            # the client's reconnection (30 s) to fail.
            self.compute.cancel_all()
            table.released()
            return
        for topic in ("all", WORKER_EVENTS_TOPIC):
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(topic)
        self.compute.cancel_all()
        self.engine.clear()
        for shard in table.shards:
            with contextlib.suppress(Exception):
                shard.close_channel().result(timeout=5)
        futures = table.released()
        if futures:
            try:
                self.client.cancel(futures)
            except Exception as exc:
                log.debug("releasing actors: %s", exc)
        if self.actors.registered:
            try:
                release_job(self.client, self.job.job_id, self.run_id)
            except Exception as exc:
                log.debug("unregistering job: %s", exc)
