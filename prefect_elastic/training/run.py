"""One run of a job on a connected client (`TrainingRun`), in phases: `start`, `supervise`, `finish`,
`release`. The run holds the job's state; the objects beside it act on one concern each (`Actors`,
`Calls`, `Workers`, `ComputeLoops`, `StaticRoles`, `Promotions`, `SchedulerWatch`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from distributed import Client, Future

from ..cluster import (
    WORKER_EVENTS_TOPIC,
)
from ..compute import MIN_LEASE, LoopStats
from ..errors import (
    ElasticError,
    FatalError,
)
from ..messages import (
    EventKind,
    Journal,
    MembershipEvent,
    Progress,
    Promotion,
)
from ..registry import publish_progress, release_job
from ..sharding import Piece
from ..survival import wait_for_group, wait_for_losses, wait_for_start
from ..wire import ChannelAddress
from . import ending
from .actors import Actors
from .calls import Calls
from .loops import ComputeLoops
from .pacing import (
    LOSS_GROUP_SECONDS,
    MEMBERSHIP_POLL_SECONDS,
    PROGRESS_POLL_IDLE_SECONDS,
    PROGRESS_POLL_SECONDS,
    PUBLISH_SECONDS,
    STARTING_RECHECK_SECONDS,
)
from .prepare import Prepared
from .promotion import Promotions
from .result import FaultInjector, TrainResult
from .roles import StaticRoles
from .scheduler import SCHEDULER_GRACE_SECONDS, SCHEDULER_POLL_SECONDS, SchedulerWatch
from .signals import CoordinatorLost, EngineSignal, SchedulerGone
from .workers import Workers

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
        self.actor_futures: list[Future] = []  # the data servers', by shard index
        self.loops: dict[str, Future] = {}
        self.loop_restarts: dict[str, int] = {}
        self.loop_stats: list[LoopStats] = []
        self.registered = False
        self.worker_event = threading.Event()
        # Set with `worker_event` by all but an add-worker event: a check that must run now, not wait for
        # a worker still starting (`survival.wait_for_start`).
        self.check_now = False
        self._stopping = False
        self._published = 0.0
        self.started = time.monotonic()
        self.coordinator: Any = None  # a CoordinatorHandle once started
        self.shards: list[Any] = []  # ShardHandles
        self.channels: list[ChannelAddress] = []  # where each shard listens for compute loops
        self.plan: list[list[Piece]] = []
        # Where the roles live: the static worker of each data server, and of the coordinator. Static
        # workers that hold none of them are standbys: a lost data server's role goes to one of them.
        self.placement: list[str] = []
        self.coordinator_at = ""
        self.standbys: tuple[str, ...] = ()
        self.promotions: list[Promotion] = []
        self._scheduler_gone_since: float | None = None  # since when the client has had no scheduler
        self.committed_seen = 0  # the committed steps of the last progress read
        self.warmed: dict[str, Future] = {}  # standbys made ready to take a role (`warm_standby`)
        self._told_lost: set[int] = set()  # data servers the coordinator was told of during a long call
        # Static workers that answered a direct call while silent to the scheduler (`Calls.answering`), and
        # when: the answer counts as a heartbeat.
        self._answered_at: dict[str, float] = {}
        self._unanswered: set[str] = set()  # silent static workers that did not answer the handshake since
        self._promoting: tuple[int, str, str] | None = None  # the shard, standby and key being promoted
        self._kept: Counter[tuple[int, str]] = Counter()  # data servers (index, worker) kept: they answered
        # The controller's copy of the coordinator's record (ledger, history, events), taken after every
        # survival check: a coordinator whose worker dies is rebuilt from it and from the shards.
        self.journal = Journal()
        self.left: set[str] = set()  # workers the scheduler said it removed (its events)
        self.retiring: set[str] = set()  # workers someone asked to retire, which the scheduler refused
        self.retire_waiting: set[str] = set()  # of those, the ones told that no standby can relieve them yet
        self.known_live: list[str] = []
        self.leaving: set[str] = set()  # static workers whose roles are handed over: never a standby
        self._loop_serial = 0  # numbers the compute loops' task keys
        self.loop_failures = 0  # compute loops that ended with an error (and were started again)
        self.coordinator_future: Future | None = None
        # Per worker, the task that imports the engine there before it takes a role (`load_engine`): a
        # worker is a member, or a data server's home, only once it has.
        self.engine: dict[str, Future] = {}  # loads in flight
        self.engine_loaded: set[str] = set()
        # The objects that act on one concern each, on this run's state.
        self.calls = Calls(self)
        self.actors = Actors(self)
        self.workers = Workers(self)
        self.compute = ComputeLoops(self)
        self.roles = StaticRoles(self)
        self.promotion = Promotions(self)
        self.scheduler = SchedulerWatch(self)

    @public_errors
    def start(self) -> None:
        """Register the job id, start the data servers and the coordinator, watch the scheduler."""
        self.started = time.monotonic()
        self.actors.register()
        # Watched from the start: a static worker lost while the servers start is a start to try again.
        self.client.subscribe_topic("all", self._on_scheduler_event)
        self.client.subscribe_topic(WORKER_EVENTS_TOPIC, self._on_scheduler_event)
        elastic = self.workers.view().listed  # (their engine loads while the servers start)
        self.coordinator, self.shards, self.plan = self.actors.start_servers()
        # The compute workers there from the start are its first members, not joins a moment later.
        for where in sorted(elastic):
            with contextlib.suppress(Exception):  # (gone, or failed: the membership tells, as for any)
                self.actors.await_engine(where, self.job.call_timeout, elastic=True)
        # (After their engines loaded: the call reads each one's cores, on its event loop.)
        self.specs = self.actors.overlap_decided(self.specs, self.plan, elastic)
        self._copy_journal()
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
                raise self.scheduler.lost_error(gone.seconds) from None
            except Exception:
                # Whatever failed, with the scheduler gone that is why (the client cancels every future,
                # the compute loops' included, the moment it loses the scheduler).
                if not self.scheduler.lost_within(SCHEDULER_GRACE_SECONDS):
                    raise
                raise self.scheduler.lost_error(0.0) from None

    def public_error(self, exc: Exception) -> ElasticError:
        """What a phase raises for `exc`, which is none of the public errors: the scheduler's loss if the
        client lost it (Dask then cancels the job's futures, whatever failed first), what an engine signal
        nothing answered means, or `unexpected`."""
        if isinstance(exc, ElasticError):
            return exc
        if self.client.status != "running":
            return self.scheduler.lost_error(0.0)
        if isinstance(exc, EngineSignal):
            return exc.public(self.job.job_id)
        return self.unexpected(exc)

    def unexpected(self, exc: BaseException) -> FatalError:
        """The public error for a failure no other error names (`ending.unexpected`)."""
        return ending.unexpected(self, exc)

    @public_errors
    def finish(self, progress: Progress) -> TrainResult:
        """Write the last checkpoint and collect the result; raise what ended a failed or stopped run."""
        return ending.finish(self, progress)

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
                self.left.add(msg["worker"])
            if msg.get("action") == "retire-workers":
                # The scheduler refuses to retire a worker that holds an actor: a static worker with a role
                # of this job. The controller hands its roles over, then retires it (`StaticRoles.hand_over`).
                self.retiring.update(str(w) for w in msg.get("could-not-retire") or ())
            self.worker_event.set()

    def _check_soon(self) -> None:
        """Wake the supervision loop for a survival check at once (one that does not wait for a worker
        that is still starting)."""
        self.check_now = True
        self.worker_event.set()

    def _supervise(self) -> Progress:
        job = self.job
        # `self.coordinator` is read anew at each use: a hand-over rebuilds it in the middle of a pass.
        shards, plan = self.shards, self.plan
        next_check = 0.0
        next_look = 0.0  # the next read of the scheduler's view between survival checks
        # The live workers the last survival check saw; kept across a coordinator's rebuild, whose first
        # check re-admits them (they are not joins to wait on for the rest of a group).
        known = self.known_live
        group_since: float | None = None  # when joins that wait for the rest of their group were first seen
        loss_since: float | None = None  # when a loss that waits for the rest of its group was first seen
        while True:
            if not self.scheduler.up():
                # Nothing about membership can be learned without it: wait, briefly, for it to come back.
                time.sleep(min(0.1, job.liveness_interval))
                continue
            now = time.monotonic()
            triggered = self.worker_event.is_set()
            if not triggered and now >= next_look:
                # A starting worker turning "running", or a member that stopped sending heartbeats, is a
                # membership change that no scheduler event announces: look, and check if it changed.
                view = self.workers.view()
                self.roles.keep_roles(view)
                triggered = view.live != known or self.compute.to_restart(view.live)
                next_look = now + (STARTING_RECHECK_SECONDS if view.starting else MEMBERSHIP_POLL_SECONDS)
            if triggered or now >= next_check:
                self.worker_event.clear()
                must_check, self.check_now = self.check_now, False
                view = self.workers.view()
                self.roles.keep_roles(view)
                # (A member without a loop too: the loops were dropped with a coordinator rebuilt.)
                restarts = any(a not in self.loops or self.loops[a].done() for a in view.live)
                if (
                    triggered
                    and not must_check
                    and now < next_check
                    and wait_for_start(known, view.live, view.starting, restarts)
                ):
                    # Only add-worker events woke it, and the worker is not running yet: its
                    # `worker-running` event (or the next look) triggers the check that admits it; this one
                    # would find nothing new.
                    next_look = now + STARTING_RECHECK_SECONDS
                    self.worker_event.wait(timeout=STARTING_RECHECK_SECONDS)
                    continue
                # Workers that join together join as one group: hold the check while the cluster still
                # has workers on their way, for at most a liveness interval (a loss is acted on at once).
                if not set(view.live) > set(known):
                    group_since = None
                elif group_since is None:
                    group_since = now
                waited = 0.0 if group_since is None else now - group_since
                on_the_way = view.pending + int(view.starting)  # not registered yet, or not running yet
                if not set(known) - set(view.live):
                    loss_since = None
                elif loss_since is None:
                    loss_since = now
                lost_for = now - (loss_since or now)
                alive = (
                    # (Only while a loss waits: each member still listed is asked, about a millisecond.)
                    self.calls.members_answering(set(known) & set(view.live), LOSS_GROUP_SECONDS - lost_for)
                    if loss_since is not None and lost_for < LOSS_GROUP_SECONDS
                    else frozenset()
                )
                if wait_for_losses(set(known), set(view.live), lost_for, LOSS_GROUP_SECONDS, alive):
                    self.worker_event.wait(timeout=LOSS_GROUP_SECONDS / 5)  # woken by the next removal
                    self._check_soon()  # look again at once
                    continue
                if wait_for_group(set(known), set(view.live), on_the_way, waited, job.liveness_interval):
                    next_look = now + STARTING_RECHECK_SECONDS
                    self.worker_event.wait(timeout=STARTING_RECHECK_SECONDS)
                    continue
                group_since = loss_since = None
                known = self.known_live = view.live
                renew = self.compute.ensure(view, self.coordinator, plan)
                # It may wait for a sync in progress, then call every shard: each bounded by call_timeout.
                events: list[MembershipEvent] = self.calls.call(
                    self.coordinator.survival_check(
                        view.live, "worker event" if triggered else "interval", renew, sorted(view.graceful)
                    ),
                    timeout=3 * job.call_timeout,
                )
                next_check = time.monotonic() + job.liveness_interval
                next_look = time.monotonic() + (
                    STARTING_RECHECK_SECONDS if view.starting else MEMBERSHIP_POLL_SECONDS
                )
                self._copy_journal()
                for event in events:
                    if event.kind is EventKind.SNAPSHOT:
                        self.persistence.after_snapshot(
                            self.coordinator, shards, job.call_timeout, self.on_event
                        )
                    if self.on_event is not None:
                        self.on_event(event)
            progress: Progress = self.calls.call(self.coordinator.progress())
            if progress.events > len(self.journal.events):
                # Recorded between survival checks (a snapshot confirmed by every shard, a promotion, a
                # worker excluded): copied now, so that a coordinator lost before the next check does not
                # take them from `result.events`.
                self._copy_journal()
            if progress.lost_shards:
                # A call to a shard failed before its worker left the scheduler's list.
                self.promotion.promote_standbys(list(progress.lost_shards))
                progress = self.calls.call(self.coordinator.progress())
            progress = replace(
                progress,
                data_servers=tuple(self.placement),
                coordinator_at=self.coordinator_at,
                standbys=self.standbys,
            )
            self._publish(progress)
            self.committed_seen = progress.committed_steps
            if self.on_progress is not None:
                self.on_progress(progress)
            if progress.state in ("done", "failed"):
                return progress
            if self.stop is not None and self.stop.is_set():
                self._stopping = True
                return progress
            if self.faults is not None:
                self.faults.apply(progress)
            self.worker_event.wait(timeout=max(0.0, min(self.progress_poll, next_check - time.monotonic())))

    def _publish(self, progress: Progress) -> None:
        # Anyone with a client to the cluster can follow the job (`read_progress`), at a cost of one small
        # scheduler call every PUBLISH_SECONDS.
        now = time.monotonic()
        if now - self._published < PUBLISH_SECONDS and progress.state == "running":
            return
        self._published = now
        publish_progress(self.client, self.job.job_id, progress)

    def _copy_journal(self) -> None:
        """Bring the controller's copy of the coordinator's record up to date (`Journal`)."""
        part: Journal = self.calls.call(
            self.coordinator.journal(self.journal.committed_steps, len(self.journal.events))
        )
        self.journal.extend(part)

    def release(self) -> None:
        """Stop loops, drop the actors, unregister the job; safe to call after any failure."""
        if self.client.status != "running":
            # The scheduler is gone: it cancelled every future already, and a call to it would wait for
            # the client's reconnection (30 s) to fail.
            self.loops.clear()
            self.actor_futures.clear()
            return
        for topic in ("all", WORKER_EVENTS_TOPIC):
            with contextlib.suppress(Exception):
                self.client.unsubscribe_topic(topic)
        for loop in self.loops.values():
            loop.cancel()
        self.loops.clear()
        self.warmed.clear()
        self.engine.clear()
        self.engine_loaded.clear()
        for shard in self.shards:
            with contextlib.suppress(Exception):
                shard.close_channel().result(timeout=5)
        if self.coordinator_future is not None:
            self.actor_futures.append(self.coordinator_future)
            self.coordinator_future = None
        if self.actor_futures:
            try:
                self.client.cancel(self.actor_futures)
            except Exception as exc:
                log.debug("releasing actors: %s", exc)
            self.actor_futures.clear()
        if self.registered:
            try:
                release_job(self.client, self.job.job_id, self.run_id)
            except Exception as exc:
                log.debug("unregistering job: %s", exc)
