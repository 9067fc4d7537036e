"""The controller for one job: `train(job, address=... | cluster=...)`.

Owns the job's lifecycle on a Dask cluster: validates the inputs before touching the cluster, registers
the job id, starts the data servers and the coordinator (actors on static workers), runs a compute loop on
every elastic worker, drives survival detection (every `liveness_interval`, and at once when the
scheduler reports a worker added or removed), and at the end collects the parameters, the ledger and the
events into a `TrainResult`. It decides nothing about membership itself: the coordinator does.

The Prefect flow (a later layer) calls this; users may call it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import distributed
import torch
from distributed import Client, Future
from distributed.actor import Actor
from distributed.security import Security

from .channel import ChannelAddress
from .checkpoint import Persistence, ShardStart
from .compute import LoopStats, compute_loop, leave_links
from .compute_async import MIN_LEASE
from .connect import (
    WORKER_EVENTS_TOPIC,
    AnnounceRunning,
    CloseOnSigterm,
    GracefulLeaves,
    NannyKeepsWorkerOnSigterm,
    answering,
    has_plugin,
    is_static_worker,
    load_engine,
    scheduler_view_of_workers,
)
from .coordinator import STEADY_SYNC_SECONDS, SYNC_SECONDS, Coordinator, ShardUnreachable, actor_key
from .data_server import DataServer, plan_shards, warm_standby
from .dataset import DatasetInfo, partition_bounds
from .errors import (
    DataServerLostError,
    ElasticError,
    FatalError,
    JobConfigError,
    NotEnoughWorkersError,
    SchedulerLostError,
    TrainingFailedError,
    TrainingStopped,
)
from .job import ElasticJob
from .ledger import LedgerEntry
from .messages import (
    CoordinatorHandle,
    EventKind,
    Journal,
    MembershipEvent,
    Outcome,
    Progress,
    Promotion,
    Resume,
    ShardHandle,
)
from .registry import claim_job, publish_progress, release_job
from .schedule import Schedule
from .survival import wait_for_group, wait_for_losses, wait_for_start

log = logging.getLogger(__name__)

# How often the controller polls progress between survival checks; bounds how late a fault schedule or a
# progress callback sees a step. Each poll is a call to the coordinator, and on a machine whose cores the
# compute workers share every background call slows them (measured: 5 to 10% on a 20 ms step with 2
# cores), so the fast poll is only for runs that act on steps (a fault schedule, a progress callback).
PROGRESS_POLL_SECONDS = 0.02
PROGRESS_POLL_IDLE_SECONDS = 0.1
# How often the controller publishes its progress to the scheduler's metadata (see `read_progress`).
PUBLISH_SECONDS = 0.2
# A worker registers with the scheduler while its status is still "init" and reports "running" a message
# later, so the check its add-worker event triggers may not count it yet. `AnnounceRunning` wakes the
# controller when it turns "running"; in case that event is missed, the controller looks at the membership
# again this soon instead of a liveness interval later.
STARTING_RECHECK_SECONDS = 0.05
# How often the controller reads the scheduler's view of the workers between survival checks: a worker
# that froze (SIGSTOP, a hung device) stops sending heartbeats, and this is how soon that is seen.
MEMBERSHIP_POLL_SECONDS = 0.25
# While a call to the coordinator waits (a survival check calls every shard), how often the controller looks
# for a static worker that died under it: a call to it would otherwise wait for Dask's 30 s connect timeout.
WATCH_WHILE_CALLING_SECONDS = 0.1
# A worker silent for more than this many of the scheduler's heartbeat intervals (and for more than a
# liveness interval) is out of the membership: 0.5 s heartbeats on small clusters make it 1.25 s.
SILENT_HEARTBEATS = 2.5
# Liveness intervals (at least a second each) without a scheduler connection before the job stops: Dask's
# client tries to reconnect for 30 s, and a scheduler that restarts on the same address is back sooner.
SCHEDULER_LOST_INTERVALS = 3
# An error the controller meets is put down to the scheduler's loss if the client loses it within this long.
SCHEDULER_GRACE_SECONDS = 1.0
SCHEDULER_POLL_SECONDS = 0.05  # how often the client's connection is looked at while it is down
# Workers lost within this long of the first are one membership change (`survival.wait_for_losses`): the
# scheduler removes workers killed together a few milliseconds apart. Waited only while a member still
# listed does not answer a connection (it may be dying too).
LOSS_GROUP_SECONDS = 0.05
# How long a static worker that holds a role and is silent to the scheduler is given to answer Dask's
# handshake before it counts as silent (at most a liveness interval): a live one answers in milliseconds.
SILENT_PROBE_SECONDS = 0.5
# A compute loop that keeps failing on a live worker is restarted at most this many times.
MAX_LOOP_RESTARTS = 5
# How long the controller waits on a coordinator call between two looks at whether its worker is gone: a
# call to a worker that died waits for Dask's connect timeout, not for an answer that will never come.
CALL_SLICE_SECONDS = 0.05
# A call to a static worker that broke is given this long to turn out a loss of that worker before the error
# counts as the call's own: the broken connection to a killed worker can reach the controller before the
# scheduler has removed the worker.
LEAVING_GRACE_SECONDS = 2.0


class SchedulerGone(Exception):
    """Inside the controller: no scheduler connection for `seconds`; becomes a `SchedulerLostError`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no scheduler for {seconds:.1f} s")
        self.seconds = seconds


class CoordinatorLost(DataServerLostError):
    """The coordinator's static worker left the cluster: the controller rebuilds it on another one."""


class ControllerCoordinatorHandle(Actor):
    """The controller's handle on its coordinator: a Dask `Actor` whose calls raise `CoordinatorLost`
    when its worker is lost, where Dask raises a `RuntimeError`.

    Dask raises it at the attribute's lookup (`handle.progress`), before any call, once the actor's
    future is in error: outside `Controller._call`, which turns the same error from an answer into
    `CoordinatorLost`. A coordinator killed between two calls therefore ended the job instead of being
    rebuilt (the async chaos soak in CI), and a handler that tells `CoordinatorLost` from other errors
    (`_keep`) took it for a data server's failure. It pickles as a plain `Actor` (`Actor.__reduce__`), so
    the compute loops and the data servers get Dask's own handle."""

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except RuntimeError as exc:
            if "Actor was lost" not in str(exc):
                raise
            raise CoordinatorLost(f"its static worker {self._address} was lost ({exc})") from exc


def controller_handle(coordinator: Actor) -> ControllerCoordinatorHandle:
    """`coordinator`, as the controller holds it (`ControllerCoordinatorHandle`): the same actor, bound
    to the same client as Dask binds the handle it gives back (`Actor.__reduce__`)."""
    return ControllerCoordinatorHandle(coordinator._cls, coordinator._address, coordinator.key)


class StaticWorkerLeft(Exception):
    """A static worker that a call depends on left the cluster while the call waited."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"static worker {worker} left")
        self.worker = worker


class StartCancelled(Exception):
    """Dask cancelled the task that starts an actor while the controller waited for it (seen in the chaos
    soak with its worker alive): the start is tried again."""

    def __init__(self, key: str) -> None:
        super().__init__(f"Dask cancelled the start of {key}")
        self.key = key


# How long a settled future's result may take to fetch from its worker.
GATHER_SECONDS = 30.0

# How many cancelled starts of one role in a row the controller tries again before it gives up.
START_TRIES = 3
# How many times a data server taken for lost may keep its role because it answered (`_answering`): a
# worker that stays silent to the scheduler while it answers would otherwise be fenced over and over.
KEEP_TRIES = 3


def settled_result(future: Any, timeout: float) -> Any:
    """The result of the Dask future `future` (the start of an actor, a compute loop) within `timeout` s,
    raising `TimeoutError` if it has not finished, and `StartCancelled` for a future Dask cancelled.

    Not `future.result(timeout)` alone: when that timeout lands while the client gathers a result that has
    just finished, it cancels the client's shared gather task before the task ran, and every later result
    on that client fails (distributed 2026.8; an `UnboundLocalError` out of `distributed.utils.sync`; the
    chaos soak lost its job to it; `test_static_roles.py` shows it). So it first waits for the future to
    settle, a wait that shares nothing with other calls, and gathers only a settled future. (An actor's
    method call returns an `ActorFuture`, whose result waits on an event of its own: no such trap.)"""
    if not isinstance(future, Future):
        return future.result(timeout=timeout)
    try:
        with future.client.as_current():
            distributed.wait([future], timeout=timeout)
        # Settled: the gather fetches a value that exists, from a worker that may still die meanwhile.
        return future.result(timeout=max(timeout, GATHER_SECONDS))
    except TimeoutError:
        _unjam_gather(future.client)
        raise
    except Exception as exc:
        # A cancellation raises Dask's CancelledError, a BaseException that `sync` turns into an
        # UnboundLocalError.
        if future.cancelled():
            raise StartCancelled(str(future.key)) from exc
        raise


def _unjam_gather(client: Client) -> None:
    """Drops a gather task that a timeout cancelled before it ran: left in place, every later gather on
    this client waits on it and fails (see `settled_result`)."""
    pending = getattr(client, "_gather_future", None)
    if pending is not None and pending.cancelled():
        client._gather_future = None


class FaultInjector(Protocol):
    """Anything that acts on the cluster as training progresses (see `prefect_elastic.local.faults`)."""

    def bind(self, cluster: Any) -> Any: ...

    def apply(self, progress: Progress) -> None: ...


@dataclass
class TrainResult:
    job: ElasticJob
    state_dict: dict[str, torch.Tensor]
    ledger: list[LedgerEntry]
    events: list[MembershipEvent]
    history: list[float]  # mean loss of each committed step
    generation: int
    counters: dict[str, int]
    elapsed: float
    total_steps: int  # of the schedule
    total_batches: int
    loops: list[LoopStats] = field(default_factory=list)
    commit_times: list[float] = field(default_factory=list)  # wall time of each step in `history`
    checkpoint: str | None = None  # the last persistent checkpoint written
    resumed_from: str | None = None  # the checkpoint this run started from
    # Per data server, seconds spent on the step path by phase, summed over the run (`DataServer.phases`):
    # where a step's fixed cost goes on the shards' side.
    shard_phases: list[dict[str, float]] = field(default_factory=list)
    # Lost data servers whose role a standby took, with the time each part of the promotion took.
    promotions: list[Promotion] = field(default_factory=list)
    # Which of the model's tensors each data server held (`plan_shards`; see `ElasticJob.min_shard_bytes`).
    shard_plan: list[list[str]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.history)

    @property
    def steps_lost(self) -> int:
        """Committed steps undone by rollbacks over the whole run."""
        return sum(e.steps_lost for e in self.events)

    @property
    def batches_dropped(self) -> int:
        """Micro-batches of steps in flight that membership changes dropped and re-queued."""
        return sum(e.batches_dropped for e in self.events)

    @property
    def staleness(self) -> dict[int, int]:
        """How many committed batch ids had each staleness (async mode: the most versions any shard had
        moved on between the parameters a gradient was computed on and its apply; all 0 in sync mode)."""
        return dict(sorted(Counter(e.staleness for e in self.ledger).items()))

    @property
    def candidate_steps(self) -> int:
        """Async mode: batch ids a worker trained on a candidate model (its own gradient applied to its
        copy of the parameters, because the shards' answers were late)."""
        return sum(loop.candidate_steps for loop in self.loops)

    def membership_events(self) -> list[MembershipEvent]:
        """The membership changes: the first admission and every rollback or reassign."""
        return [e for e in self.events if e.kind in (EventKind.START, EventKind.ROLLBACK, EventKind.REASSIGN)]


def build_schedule(job: ElasticJob, dataset: DatasetInfo) -> Schedule:
    sizes = tuple(
        stop - start
        for start, stop in (
            partition_bounds(dataset.total, job.data_servers, i) for i in range(job.data_servers)
        )
    )
    try:
        # Async mode applies every micro-batch on its own: a step is one batch id.
        per_step = 1 if job.mode == "async" else job.micro_batches
        return Schedule(sizes, job.batch_size, per_step, job.epochs, job.seed)
    except ValueError as exc:
        raise JobConfigError("batch_size", job.batch_size, str(exc)) from exc


def train(
    job: ElasticJob | str | os.PathLike[str],
    address: str | None = None,
    cluster: Any = None,
    *,
    on_progress: Callable[[Progress], None] | None = None,
    on_event: Callable[[MembershipEvent], None] | None = None,
    faults: FaultInjector | None = None,
    stop: threading.Event | None = None,
    security: Security | None = None,
) -> TrainResult:
    """Train `job` on the Dask cluster at `address` (or the `cluster` object) and return the result.

    Raises `JobConfigError` before any cluster work for an impossible job, `TrainingFailedError` when the
    model raises or the loss is not finite, `NotEnoughWorkersError` when fewer than `min_workers` compute
    workers stay alive for longer than `min_workers_timeout`, `DataServerLostError` when a static worker
    holding a data server or the coordinator dies, `TrainingStopped` when `stop` is set (after a final
    checkpoint), `CheckpointMismatchError` when `job.checkpoint` holds a checkpoint of another job or model.
    With `job.checkpoint` set, a run resumes from the latest checkpoint there. `security`: Dask's
    `Security` for a cluster with TLS (by default the `security` of the `cluster` object, if it has one);
    the step path's own connections then use TLS too, with the workers' certificates.
    """
    prepared = prepare(job)
    if (address is None) == (cluster is None):
        raise JobConfigError("address", address, "give exactly one of address= or cluster=")
    if isinstance(cluster, str):
        # As distributed.Client does: a scheduler address given where a cluster object was expected.
        address, cluster = cluster, None
    if address is not None:
        target = address
    elif isinstance(getattr(cluster, "scheduler_address", None), str):
        target = cluster.scheduler_address
    else:
        raise JobConfigError(
            "cluster",
            cluster,
            "not a Dask cluster object (it has no scheduler_address); give a cluster such as "
            "LocalCluster or SLURMCluster, or a scheduler address as address='tcp://host:8786'",
        )
    if faults is not None and cluster is not None:
        faults.bind(cluster)
    if security is None:
        # A cluster object with TLS (LocalElasticCluster(security=True), any distributed cluster made with
        # a Security) carries the client's certificates.
        security = getattr(cluster, "security", None)
    with connect_client(target, prepared.job.call_timeout, security) as client:
        run = TrainingRun(
            client, prepared, on_progress=on_progress, on_event=on_event, faults=faults, stop=stop,
            cluster=cluster,
        )  # fmt: skip
        # Actor handles bind to the current client on first use; make it ours, not a global default.
        with client.as_current():
            try:
                run.start()
                return run.finish(run.supervise())
            except ElasticError:
                raise
            except Exception as exc:
                # (Starting or finishing without a scheduler: Dask cancelled the job's futures.)
                if client.status != "running":
                    raise run._scheduler_lost(0.0) from None
                raise run.unexpected(exc) from exc
            finally:
                run.release()


def connect_client(address: str, timeout: float, security: Security | None = None) -> Client:
    """A client of the scheduler at `address`; a refused connection fails at once, naming the address,
    instead of being retried for the whole timeout."""
    from distributed.comm import parse_address

    try:
        scheme, location = parse_address(address)
    except Exception as exc:
        raise JobConfigError("address", address, f"not a scheduler address ({exc})") from exc
    if scheme in ("tcp", "tls") and ":" in location:
        import socket

        host, _, port = location.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 5.0)):
                pass
        except (OSError, ValueError) as exc:
            raise FatalError(
                f"no Dask scheduler answers at {address} ({exc}); start one (`dask scheduler`) or give "
                "the address it listens on"
            ) from exc
    return Client(address, set_as_default=False, timeout=timeout, security=security)


@dataclass(frozen=True)
class Prepared:
    """A job checked and ready: everything decided before any cluster work."""

    job: ElasticJob
    dataset: DatasetInfo
    schedule: Schedule
    persistence: Persistence


def prepare(job: ElasticJob | str | os.PathLike[str]) -> Prepared:
    """Validate the job's inputs (model, loss, dataset, checkpoint folder) before touching a cluster."""
    if not isinstance(job, ElasticJob):
        job = ElasticJob.from_yaml(Path(job))
    dataset = job.check_inputs()
    schedule = build_schedule(job, dataset)
    layout, initial = job.initial_tensors()
    return Prepared(job, dataset, schedule, Persistence(job, layout, initial))


@dataclass(frozen=True)
class WorkersView:
    live: list[str]  # elastic workers that run and were heard from lately
    starting: bool
    listed: set[str]  # elastic workers the scheduler lists (a frozen one stays listed)
    static: tuple[str, ...] = ()  # static workers that run, in the order roles are placed on them
    pending: int = 0  # workers the cluster object started that the scheduler does not list yet
    graceful: frozenset[str] = frozenset()  # workers that left gracefully lately (retired, not lost)
    # Static workers the scheduler still lists but has not heard from lately: left out of `static`, but
    # asked before their loss would cost a shard's last copy (`TrainingRun._answering`).
    silent_static: frozenset[str] = frozenset()


def standbys(static: tuple[str, ...] | list[str], placement: list[str]) -> tuple[str, ...]:
    """The live static workers that hold no data server of the job: where a lost one's role can go. (The
    coordinator starts beside data server 0; one rebuilt on a standby leaves room there for a data
    server, since it holds little.)"""
    return tuple(w for w in static if w not in placement)


def _async_snapshot_every(job: ElasticJob) -> int:
    """Survival checks between two snapshots in async mode (0: none), each a brief pause of every shard: a
    checkpoint's (`checkpoint_every`), or, with peer replicas, what a standby goes back to when a data
    server's worker dies (else it would go back to the start)."""
    if job.mode != "async":
        return 0
    if job.checkpoint or (job.peer_replicas and job.data_servers > 1):
        return job.checkpoint_every
    return 0


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
        self.plan: list[list[str]] = []
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
        # Static workers that answered a direct call while silent to the scheduler (`_answering`), and
        # when: the answer counts as a heartbeat.
        self._answered_at: dict[str, float] = {}
        self._unanswered: set[str] = set()  # silent static workers that did not answer the handshake since
        self._promoting: tuple[int, str, str] | None = None  # the shard, standby and key being promoted
        self._kept: Counter[tuple[int, str]] = Counter()  # data servers (index, worker) kept by `_answering`
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

    # -- setup -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Register the job id, start the data servers and the coordinator, watch the scheduler."""
        self.started = time.monotonic()
        self._register()
        # Watched from the start: a static worker lost while the servers start is a start to try again.
        self.client.subscribe_topic("all", self._on_scheduler_event)
        self.client.subscribe_topic(WORKER_EVENTS_TOPIC, self._on_scheduler_event)
        elastic = self._workers_view().listed  # (their engine loads while the servers start)
        self.coordinator, self.shards, self.plan = self._start_servers()
        # The compute workers there from the start are its first members, not joins a moment later.
        for where in sorted(elastic):
            with contextlib.suppress(Exception):  # (gone, or failed: the membership tells, as for any)
                self._await_engine(where, self.job.call_timeout, elastic=True)
        self._copy_journal()
        job = self.job
        if job.mode == "async":
            log.info(
                "job %s: async mode, %d batch ids of %d applied one by one (max staleness %d), %d data "
                "servers, leases of %d",
                job.job_id, self.schedule.total_batches, job.batch_size, job.max_staleness,
                job.data_servers, max(MIN_LEASE, job.micro_batches),
            )  # fmt: skip
            return
        log.info(
            "job %s: %d steps of %d micro-batches of %d, %d data servers, policy %s",
            job.job_id, self.schedule.total_steps, job.micro_batches, job.batch_size, job.data_servers,
            job.on_membership_change,
        )  # fmt: skip

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
                    while not self._scheduler_up():
                        time.sleep(SCHEDULER_POLL_SECONDS)
                    self._rebuild_coordinator(str(exc))
            except SchedulerGone as gone:
                raise self._scheduler_lost(gone.seconds) from None
            except Exception:
                # Whatever failed, with the scheduler gone that is why (the client cancels every future,
                # the compute loops' included, the moment it loses the scheduler).
                if not self._scheduler_lost_within(SCHEDULER_GRACE_SECONDS):
                    raise
                raise self._scheduler_lost(0.0) from None

    def _scheduler_up(self) -> bool:
        """Whether the client has its scheduler. When it lost it, Dask cancelled every future of the job
        (its compute loops, its actors' keys): nothing comes back with the scheduler, so the job stops
        (`SchedulerGone`) within `SCHEDULER_LOST_INTERVALS` liveness intervals of the first sign."""
        if self.client.status == "running":
            self._scheduler_gone_since = None
            return True
        now = time.monotonic()
        if self._scheduler_gone_since is None:
            self._scheduler_gone_since = now
            log.warning("job %s: the connection to the Dask scheduler is lost", self.job.job_id)
        gone = now - self._scheduler_gone_since
        if self.client.status in ("closing", "closed") or gone >= SCHEDULER_LOST_INTERVALS * max(
            1.0, self.job.liveness_interval
        ):
            raise SchedulerGone(gone)
        return False

    def _scheduler_lost_within(self, grace: float) -> bool:
        """Whether the client lost its scheduler, or loses it within `grace` seconds: a call to the
        scheduler that broke because the scheduler died can fail before the client has seen its own
        connection close (CI: the coordinator's rebuild failed with a raw CommClosedError, the client still
        "running")."""
        deadline = time.monotonic() + grace
        while self.client.status == "running":
            if time.monotonic() >= deadline:
                return False
            time.sleep(SCHEDULER_POLL_SECONDS)
        return True

    def _scheduler_lost(self, seconds: float) -> SchedulerLostError:
        """The error that stops a job without its scheduler, saying where to resume from: the last periodic
        checkpoint (and, if the client is back already, a last one written now)."""
        job, step = self.job, self.committed_seen
        if self.client.status == "running":  # (reached again: the job's futures are gone all the same)
            timeout = min(job.call_timeout, 10.0)
            with contextlib.suppress(Exception):
                step = self._call(self.coordinator.stop("the Dask scheduler was lost"), timeout=timeout)
            with contextlib.suppress(Exception):
                self.persistence.write(self.coordinator, self.shards, timeout)
        # (While the client reconnects, a call to an actor waits for the reconnection, 30 s, and fails: the
        # last periodic checkpoint is where the next run resumes.)
        written = self.persistence.last_written
        where = self.client.scheduler.address if self.client.scheduler is not None else "?"
        if written:
            then = f"the last checkpoint is {written}: once a scheduler and workers are back, run the job "
            then += "again; it resumes there"
        elif job.checkpoint:
            then = "no checkpoint was written yet, so a new run starts over"
        else:
            then = "the job has no checkpoint, so a new run starts over (set `checkpoint` to resume instead)"
        return SchedulerLostError(
            f"job {job.job_id} lost the Dask scheduler at {where} (it died, or its host did"
            + (f"; no connection for {seconds:.1f} s" if seconds >= 0.1 else "")
            + f"); training stopped at step {step} of {self.schedule.total_steps}; {then}",
            checkpoint=written,
        )

    def unexpected(self, exc: BaseException) -> FatalError:
        """The public error for a failure no other error names (one of Dask's, a bug): what `train()`
        raises is always one of `errors.py`'s, and says where the job can go on from."""
        written = self.persistence.last_written
        then = (
            f"run the job again: it resumes from the last checkpoint, {written}"
            if written
            else "run the job again (it has no checkpoint to resume from, so it starts over)"
        )
        return FatalError(
            f"job {self.job.job_id} stopped at step {self.committed_seen} of {self.schedule.total_steps} "
            f"on an unexpected {type(exc).__name__}: {exc}; {then}, and if it happens again, report it "
            "with this message"
        )

    def finish(self, progress: Progress) -> TrainResult:
        """Write the last checkpoint and collect the result; raise what ended a failed or stopped run."""
        coordinator, shards = self.coordinator, self.shards
        timeout = self.job.call_timeout
        if self._stopping and progress.state in ("running", "waiting"):
            # Every shard fenced and brought to one version, which is snapshotted: the last checkpoint
            # holds every step committed before the stop.
            self._call(coordinator.stop("stopped by the controller"), timeout=3 * timeout)
            self.persistence.write(coordinator, shards, timeout)
        elif progress.state == "done":
            try:
                self._call(coordinator.snapshot_now(), timeout=3 * timeout)
            except ShardUnreachable as exc:
                # Every step was applied, but a data server's worker died before the last snapshot (and
                # the result) could be read from it: its state since its last copy is gone with it.
                raise DataServerLostError(
                    f"job {self.job.job_id} trained every step, but {exc} before its final state could be "
                    "read; run the job again"
                    + (
                        f": it resumes from the last checkpoint, {self.persistence.last_written}"
                        if self.persistence.last_written
                        else " (no checkpoint was written: set `checkpoint` to resume, not start over)"
                    )
                ) from exc
            self.persistence.write(coordinator, shards, timeout)
        if self._stopping:
            self._stop_loops()
            raise TrainingStopped(
                f"job {self.job.job_id} stopped at step {progress.committed_steps} of {progress.total_steps}"
                + (f"; checkpoint {self.persistence.last_written}" if self.persistence.last_written else ""),
                checkpoint=self.persistence.last_written,
            )
        outcome: Outcome = coordinator.outcome().result(timeout=timeout)
        if progress.state == "failed":
            raise self._failure(progress)
        state: dict[str, torch.Tensor] = {}
        for f in [s.state() for s in shards]:
            state.update(f.result(timeout=self.job.call_timeout))
        shard_phases = [f.result(timeout=timeout) for f in [s.phases() for s in shards]]
        self._stop_loops()
        return TrainResult(
            job=self.job,
            state_dict=self.layout.export(state),
            ledger=outcome.ledger,
            events=sorted([*outcome.events, *self.persistence.events], key=lambda e: e.time),
            history=outcome.history,
            generation=outcome.generation,
            counters={
                **outcome.counters,
                "loop_failures": self.loop_failures,
                "candidate_steps": sum(loop.candidate_steps for loop in self.loop_stats),
                "stale_refusals": sum(loop.refused for loop in self.loop_stats),
            },
            elapsed=time.monotonic() - self.started,
            total_steps=self.schedule.total_steps,
            total_batches=self.schedule.total_batches,
            loops=self.loop_stats,
            commit_times=outcome.commit_times,
            checkpoint=self.persistence.last_written,
            resumed_from=self.persistence.resumed_from,
            shard_phases=shard_phases,
            promotions=list(self.promotions),
            shard_plan=[list(names) for names in self.plan],
        )

    def _register(self) -> None:
        # Roles register under the job id (seed 003): a second live controller of the same job would
        # train the same batches twice, so it is refused; a key left by a controller that died is taken
        # over. Check and set run in one function on the scheduler, so two controllers cannot both pass.
        # Tells a retired worker from a lost one (a graceful leave is not rolled back); kept if registered.
        if not self.client.run_on_scheduler(has_plugin, name=GracefulLeaves.name):
            self.client.register_plugin(GracefulLeaves(), name=GracefulLeaves.name)
            self.client.register_plugin(CloseOnSigterm(), name=CloseOnSigterm.name)
            self.client.register_plugin(NannyKeepsWorkerOnSigterm(), name=NannyKeepsWorkerOnSigterm.name)
        if not self.client.run_on_scheduler(has_plugin, name=AnnounceRunning.name):
            self.client.register_plugin(AnnounceRunning(), name=AnnounceRunning.name)
        holder = claim_job(self.client, self.job.job_id, self.run_id)
        if holder is not None:
            raise FatalError(
                f"job_id={self.job.job_id!r} is already training on this cluster "
                f"(controller {holder['client']}); give this job another job_id or wait for that one to end"
            )
        self.registered = True

    def _static_workers(self) -> list[str]:
        # Read on the scheduler, not from `Client.scheduler_info()`: the client's periodic refresh of that
        # cache (which carries no workers) can land between its fetch and its return.
        view = self.client.run_on_scheduler(scheduler_view_of_workers, silent_heartbeats=SILENT_HEARTBEATS)
        static = [
            r
            for r in view["workers"]
            if is_static_worker(r, self.job.static_resource)
            and r["status"] in ("running", "paused")
            and r["address"] not in self.left
        ]
        if not static:
            raise FatalError(
                f"no static workers on the cluster: start some with "
                f"`dask worker <scheduler> --resources {self.job.static_resource}=1`; data servers and the "
                "coordinator must live on workers that are never taken away"
            )
        return [r["address"] for r in sorted(static, key=lambda r: (str(r["name"]), r["address"]))]

    def _start_servers(self) -> tuple[CoordinatorHandle, list[ShardHandle], list[list[str]]]:
        """Start the data servers and the coordinator on the static workers. Nothing is trained before they
        all stand, so a static worker lost meanwhile costs nothing but the start: it is tried again on the
        static workers left (a standby is one more of them), up to `START_TRIES` times."""
        job = self.job
        plan = plan_shards(self.persistence.initial, job.data_servers, job.min_shard_bytes)
        tries = 0
        while True:
            static = self._static_workers()
            for where in static:  # (a standby's engine loads too: it may be promoted soon)
                self._load_engine(where)
            try:
                return self._start_servers_on(static, plan)
            except Exception as exc:
                gone = sorted(
                    w
                    for w in {*self.placement, self.coordinator_at} - {""}
                    if self._leaves_soon(w, LEAVING_GRACE_SECONDS, heard=False)
                )
                if not gone:
                    raise
                self._abandon_start()
                tries += 1
                if tries >= START_TRIES:
                    raise DataServerLostError(
                        f"job {job.job_id} could not start: static workers were lost while its data servers "
                        f"started, {tries} times (the last: {', '.join(gone)}); check why its static workers "
                        "die, then run the job again"
                    ) from exc
                log.warning(
                    "job %s: static worker %s lost while the data servers started (%s: %s); starting them "
                    "again on the static workers left",
                    job.job_id, ", ".join(gone), type(exc).__name__, exc,
                )  # fmt: skip

    def _start_servers_on(
        self, static: list[str], plan: list[list[str]]
    ) -> tuple[CoordinatorHandle, list[ShardHandle], list[list[str]]]:
        job = self.job
        self.placement = [static[i % len(static)] for i in range(len(plan))]
        self.coordinator_at = static[0]
        for where in sorted(set(self.placement)):
            self._await_engine(where, self._startup_timeout(), heard=False)
        for i, names in enumerate(plan):
            start = self.persistence.shard_start(i, names)
            self.actor_futures.append(self._submit_data_server(i, self.placement[i], start))
        self.coordinator_future = self._submit_coordinator(self.coordinator_at, self.persistence.resume())
        # Reading a partition may take a while on a big dataset; the wait is still bounded.
        slow = self._startup_timeout()
        shards = [
            self._wait_unless_left(f, self.placement[i], slow, heard=False)
            for i, f in enumerate(self.actor_futures)
        ]
        coordinator = controller_handle(
            self._wait_unless_left(self.coordinator_future, self.coordinator_at, slow, heard=False)
        )
        # The step path's own connections (channel.py): compute loops reach each shard there.
        self.channels = [
            self._wait_unless_left(s.open_channel(), self.placement[i], job.call_timeout, heard=False)
            for i, s in enumerate(shards)
        ]
        self._wait_unless_left(
            coordinator.attach(shards, self.channels), self.coordinator_at, job.call_timeout, heard=False
        )
        return coordinator, shards, plan

    def _abandon_start(self) -> None:
        """Drop what a start that lost a static worker made: its actors (on the workers left) and places."""
        futures = [*self.actor_futures, *([self.coordinator_future] if self.coordinator_future else [])]
        with contextlib.suppress(Exception):
            self.client.cancel(futures)
        self.actor_futures.clear()
        self.coordinator_future = None
        self.placement = []
        self.coordinator_at = ""

    def _load_engine(self, where: str) -> Future | None:
        """The task that imports the engine on the worker `where` (`connect.load_engine`), started once;
        None once it has ended. (Its future is then dropped: a worker holding its result would have to hand
        it to another before it could retire, and would stay "closing_gracefully" meanwhile, a graceful
        leave taken for a loss.)"""
        if where in self.engine_loaded:
            return None
        future = self.engine.get(where)
        if future is not None and future.done():
            del self.engine[where]
            self.engine_loaded.add(where)
            return None
        if future is None:
            self._loop_serial += 1
            future = self.engine[where] = self.client.submit(
                load_engine, workers=[where], allow_other_workers=False, pure=False,
                key=f"prefect-elastic-{self.job.job_id}-{self.run_id}-load-{where}-{self._loop_serial}",
            )  # fmt: skip
            # Its end may make a member: look at once, not at the next poll.
            future.add_done_callback(lambda _: self._check_soon())
        return future

    def _engine_loaded(self, workers: Iterable[str]) -> set[str]:
        """Of `workers`, those that imported the engine; it starts loading on the others. (A load that
        failed counts as loaded: the role it was for fails there, and says why, as it would have.)"""
        return {w for w in workers if self._load_engine(w) is None}

    def _await_engine(self, where: str, timeout: float, **watch: bool) -> None:
        """Wait for the engine to be loaded on `where` (`_wait_unless_left`, `watch` its options)."""
        future = self._load_engine(where)
        if future is not None:
            self._wait_unless_left(future, where, timeout, **watch)
            self._load_engine(where)  # (drops the future)

    def _submit_coordinator(self, where: str, resume: Resume | None) -> Future:
        job = self.job
        self._placed_on(where)
        return self.client.submit(
            Coordinator, job.job_id, self.schedule, job.data_servers, job.on_membership_change,
            job.min_workers, job.min_workers_timeout, job.call_timeout, resume, job.mode,
            _async_snapshot_every(job), self._steady_sync(),
            actor=True, workers=[where], allow_other_workers=False, pure=False,
            key=f"prefect-elastic-{job.job_id}-{self.run_id}-coordinator-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip

    def _steady_sync(self) -> float:
        """How often the coordinator reads the shards in a sync job's steady state: as often as near the
        end where this controller polls progress for a caller that acts on steps as they commit (faults,
        `on_progress`), whose fault at step 5 of a short job would otherwise come after its end."""
        return SYNC_SECONDS if self.progress_poll < PROGRESS_POLL_IDLE_SECONDS else STEADY_SYNC_SECONDS

    def _placed_on(self, where: str) -> None:
        """A role goes to the live static worker `where`: from now on `left` tells whether it left since.
        A worker the scheduler removed once and that came back at the same address (a paused process
        that resumed and registered again) stayed in `left`, and a role put there later was taken for
        lost at its first call (the chaos soak: a coordinator rebuilt there failed the job)."""
        self.left.discard(where)

    def _startup_timeout(self) -> float:
        return max(self.job.call_timeout, 600.0)

    def _submit_data_server(
        self, index: int, where: str, start: ShardStart | None, version: int = 0
    ) -> Future:
        """A data server for shard `index` on the static worker `where`: with the tensors of `start`
        (scattered straight to that worker, not put in the task graph, which would make a big model's
        graph big), or empty, to take its state from its peer (`adopt`) at `version`."""
        applied: tuple[int, ...] = ()
        if start is None:
            tensors: list[Any] = [{}, {}, None]
        else:
            applied = start.applied
            version = start.version
            tensors = self.client.sync(
                self._scatter_unless_left, [start.params, start.buffers, start.optimizer_state], where
            )
        self._placed_on(where)
        return self.client.submit(
            DataServer, index, self.job, self.dataset, self.schedule, *tensors, version, applied,
            actor=True, workers=[where], allow_other_workers=False,
            key=f"prefect-elastic-{self.job.job_id}-{self.run_id}-data-server-{index}-{uuid.uuid4().hex[:6]}",
            pure=False,
        )  # fmt: skip

    async def _scatter_unless_left(self, data: list[Any], where: str) -> list[Future]:
        """`data` scattered to the worker `where`, unless it leaves first: a scatter to a worker that died
        waits for Dask's connect timeout (30 s) before it fails."""
        scatter = asyncio.ensure_future(self.client._scatter(data, workers=[where], hash=False))
        while True:
            done, _ = await asyncio.wait([scatter], timeout=WATCH_WHILE_CALLING_SECONDS)
            if done:
                futures: list[Future] = scatter.result()
                return futures
            if where in self.left:
                scatter.cancel()
                raise StaticWorkerLeft(where)

    # -- supervision -----------------------------------------------------------------------------

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
                # of this job. The controller hands its roles over, then retires it (`_hand_over`).
                self.retiring.update(str(w) for w in msg.get("could-not-retire") or ())
            self.worker_event.set()

    def _members_answering(self, workers: set[str], timeout: float) -> frozenset[str]:
        """The workers among `workers` whose process answers a connection within `timeout` seconds
        (`connect.answering`); none if asking fails."""
        if not workers:
            return frozenset()
        try:
            alive: frozenset[str] = self.client.sync(
                answering, workers, timeout, callback_timeout=timeout + 1, **self.client.connection_args
            )
        except Exception:  # (the client's loop closing under it: nothing is known, so wait)
            return frozenset()
        return alive

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
            if not self._scheduler_up():
                # Nothing about membership can be learned without it: wait, briefly, for it to come back.
                time.sleep(min(0.1, job.liveness_interval))
                continue
            now = time.monotonic()
            triggered = self.worker_event.is_set()
            if not triggered and now >= next_look:
                # A starting worker turning "running", or a member that stopped sending heartbeats, is a
                # membership change that no scheduler event announces: look, and check if it changed.
                view = self._workers_view()
                self._keep_roles(view)
                triggered = view.live != known or self._loops_to_restart(view.live)
                next_look = now + (STARTING_RECHECK_SECONDS if view.starting else MEMBERSHIP_POLL_SECONDS)
            if triggered or now >= next_check:
                self.worker_event.clear()
                must_check, self.check_now = self.check_now, False
                view = self._workers_view()
                self._keep_roles(view)
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
                    self._members_answering(set(known) & set(view.live), LOSS_GROUP_SECONDS - lost_for)
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
                renew = self._ensure_loops(view, self.coordinator, plan)
                # It may wait for a sync in progress, then call every shard: each bounded by call_timeout.
                events: list[MembershipEvent] = self._call(
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
            progress: Progress = self._call(self.coordinator.progress())
            if progress.events > len(self.journal.events):
                # Recorded between survival checks (a snapshot confirmed by every shard, a promotion, a
                # worker excluded): copied now, so that a coordinator lost before the next check does not
                # take them from `result.events`.
                self._copy_journal()
            if progress.lost_shards:
                # A call to a shard failed before its worker left the scheduler's list.
                self._promote_standbys(list(progress.lost_shards))
                progress = self._call(self.coordinator.progress())
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

    # -- static roles: a lost data server's role goes to a standby (seed 001) ---------------------

    def _keep_roles(self, view: WorkersView) -> None:
        """Check that every role's static worker is still there; give a lost data server's role to a
        standby. A lost coordinator raises `CoordinatorLost`, which `supervise` answers by rebuilding it."""
        self.standbys = standbys([w for w in view.static if w not in self.leaving], self.placement)
        for worker in self._engine_loaded(self.standbys):
            if worker not in self.warmed:
                # Fire and forget: a standby promoted before it finished is only slower to start.
                self.warmed[worker] = self.client.submit(
                    warm_standby, self.job, workers=[worker], allow_other_workers=False, pure=False,
                    key=f"prefect-elastic-{self.job.job_id}-{self.run_id}-warm-{worker}",
                )  # fmt: skip
        if self.coordinator_at not in view.static:
            raise CoordinatorLost(f"its static worker {self.coordinator_at} left the cluster")
        lost = [i for i, where in enumerate(self.placement) if where not in view.static]
        if lost:
            self._promote_standbys(lost)
        for worker in sorted(self.retiring):
            # (Dropped first: a hand-over that raises is not tried again at every check.)
            self.retiring.discard(worker)
            if worker in view.static and not self._hand_over(worker):
                # No standby can relieve it yet: asked again at the next check, so it goes once one is
                # heard from (a SIGTERMed one closes by itself meanwhile, after `SIGTERM_HAND_OVER_SECONDS`).
                self.retiring.add(worker)

    def _hand_over(self, worker: str) -> bool:
        """Someone asked to retire the static worker `worker` (`Client.retire_workers`, a cluster scaling
        down), which the scheduler refuses while it holds an actor: hand its roles over before it goes.
        Training stops at a step every shard applied, which is snapshotted (its copies whole on the peers);
        its data servers go to standbys from that snapshot and its coordinator is rebuilt elsewhere, so no
        committed step is redone. Then it is retired. False if no standby can take its data servers now (none
        is there, or none was heard from lately: a loaded machine delays heartbeats); it is then asked
        again at the next survival check."""
        job = self.job
        indices = [i for i, w in enumerate(self.placement) if w == worker]
        if indices or worker == self.coordinator_at:
            if indices and not standbys(self._workers_view().static, self.placement):
                if worker not in self.retire_waiting:
                    self.retire_waiting.add(worker)
                    log.warning(
                        "job %s: static worker %s is asked to retire, but no standby can take data servers "
                        "%s now; it is retired once one can (start a static worker if there is none)",
                        job.job_id, worker, indices,
                    )  # fmt: skip
                return False
            self.retire_waiting.discard(worker)
            reason = f"static worker {worker} is retiring"
            self.leaving.add(worker)
            log.warning("job %s: %s; handing over its roles", job.job_id, reason)
            self._call(self.coordinator.hand_over(indices, reason), timeout=3 * job.call_timeout)
            if indices:
                self._promote_standbys(indices)
            if worker == self.coordinator_at:
                self._copy_journal()
                self._rebuild_coordinator(reason)
        self.client.retire_workers([worker], close_workers=True)
        self._check_soon()  # a survival check hands roles out again at once
        return True

    def _promote_standbys(self, lost: list[int], ask: bool = True) -> None:
        """Suspend training, then for each lost data server: start one on a standby static worker, from
        its peer's in-memory replica of the last snapshot every shard holds, and let the coordinator bring
        every shard to that snapshot in a new generation (`Coordinator.promote`). Where that would lose a
        shard, lost data servers are asked first if `ask` (`_answering`; once: not again when this calls
        itself after asking)."""
        job, coordinator, shards = self.job, self.coordinator, self.shards
        seen, clock = time.time(), time.monotonic()
        left = ", ".join(sorted({self.placement[i] for i in lost}))
        told = coordinator.shards_lost(lost, f"static worker {left} left", [shards[i].key for i in lost])
        targets = dict.fromkeys(lost, self._call(told))
        if job.mode == "async":
            # Each shard snapshots at its own version in async mode: each standby starts from its own.
            targets = {i: self._call(coordinator.snapshot_version(i)) for i in lost}
        suspended = time.monotonic() - clock

        def peer_holding_replica(i: int) -> ShardHandle | None:
            # The peer, if it holds the copy of the snapshot to go back to (one promoted since holds none).
            peer = (i + 1) % len(shards)
            if not job.peer_replicas or peer in lost or peer == i:
                return None
            try:
                asked = shards[peer].status(self.schedule.total_steps)
            except RuntimeError as exc:  # Dask already knows the peer's worker is gone
                raise StaticWorkerLeft(self.placement[peer]) from exc
            status = self._wait_unless_left(asked, self.placement[peer], job.call_timeout)
            return shards[peer] if targets[i] in status.replicas else None

        try:
            replicas = {i: peer_holding_replica(i) for i in lost}
        except StaticWorkerLeft as left:
            # A peer died too, after the first loss was seen: its replica is gone with it.
            self._promote_standbys(
                sorted({*lost, *(j for j, w in enumerate(self.placement) if w == left.worker)}), ask
            )
            return
        unrestorable = [
            i
            for i in lost
            if replicas[i] is None and targets[i] != self.persistence.shard_start(i, []).version
        ]
        # Only silent for a moment (`_answering`): each keeps its role, and the rest are promoted.
        asked = ask and bool(unrestorable)
        kept = [i for i in sorted(self._answering(lost) if asked else ()) if self._keep(i)]
        if kept:
            rest = [i for i in lost if i not in kept]
            if rest:
                self._promote_standbys(rest, ask=False)
            else:
                self._copy_journal()
            return
        if unrestorable:
            if not job.peer_replicas:
                why = "the job has peer_replicas=False, so no copy of a shard was kept"
            else:
                why = "; ".join(
                    f"data server {i}'s replica was held by data server {(i + 1) % len(shards)}, "
                    + ("lost with it" if (i + 1) % len(shards) in lost else "whose own worker died since")
                    for i in unrestorable
                )
            self._restore_from_checkpoint(lost, f"data servers {unrestorable} cannot be restored: {why}")
            return
        for i in lost:
            replica = replicas[i]
            start = None if replica is not None else self.persistence.shard_start(i, self.plan[i])
            while True:
                try:
                    standby, future, shard, channel, started, adopted = self._start_on_standby(
                        i, start, targets[i], replica
                    )
                except StaticWorkerLeft:
                    # The peer died too (after the first loss was seen): its replica is gone with it.
                    self._promote_standbys(
                        sorted({*lost[lost.index(i) :], (i + 1) % len(shards)}), ask=not asked
                    )
                    return
                clock = time.monotonic()
                try:
                    event = self._promote_on(i, standby, future, shard, channel)
                    break
                except StaticWorkerLeft:
                    continue  # the standby died in the middle of its promotion: the next one
            promotion = Promotion(
                index=i, lost_worker=self.placement[i], standby=standby, step=event.step, seen=seen,
                suspend=suspended, start=started, adopt=adopted, promote=time.monotonic() - clock,
                source="start" if replica is None else "replica",
            )  # fmt: skip
            self.promotions.append(promotion)
            # The old data server's actor is released: it is gone with its worker, or (a hand-over) its
            # worker is retiring and must not hold it.
            old, self.actor_futures[i] = self.actor_futures[i], future
            with contextlib.suppress(Exception):
                self.client.cancel([old])
            moved = self.channels[i]
            shards[i], self.channels[i], self.placement[i] = shard, channel, standby
            self._told_lost.discard(i)
            self._leave_links([moved])
            log.warning(
                "job %s: data server %d now on standby %s at step %d, %.2f s after it was lost (suspend "
                "%.3f s, start %.3f s, copy from the peer %.3f s, promote %.3f s)",
                job.job_id, i, standby, event.step, time.time() - seen, suspended, started, adopted,
                promotion.promote,
            )  # fmt: skip
            suspended = 0.0
        self.standbys = tuple(w for w in self.standbys if w not in self.placement)
        self._copy_journal()

    def _leave_links(self, channels: list[ChannelAddress]) -> None:
        """Tell the compute loops to drop their connections to `channels`, where shards whose roles moved
        listened (`compute.leave_links`): one blocked on a frozen static worker would wait a call timeout.
        Not waited for: a member that does not answer has its own loop to wake, or none."""
        members = sorted(a for a in self.known_live if a in self.loops)
        if not members:
            return

        async def tell() -> None:
            with contextlib.suppress(Exception):
                await self.client._run(
                    leave_links,
                    self.job.job_id,
                    [tuple(c) for c in channels],
                    workers=members,
                    on_error="return",
                )

        if self.client.loop is not None:
            self.client.loop.add_callback(tell)

    def _keep(self, index: int) -> bool:
        """Data server `index`, taken for lost, answered (`_answering`): it keeps its role, every shard
        brought to the snapshot as in a promotion (`Coordinator.promote` with its own handle: event `kept`).
        False if that failed (it died or stalled meanwhile): it is lost after all."""
        where = self.placement[index]
        try:
            event = self._call(
                self.coordinator.promote(index, self.shards[index], self.channels[index], where)
            )
        except CoordinatorLost:
            raise
        except Exception as exc:
            log.warning("job %s: data server %d could not keep its role (%s)", self.job.job_id, index, exc)
            return False
        self._kept[(index, where)] += 1
        self._told_lost.discard(index)
        log.warning("job %s: data server %d keeps its role at step %d", self.job.job_id, index, event.step)
        return True

    def _promote_on(
        self, index: int, standby: str, future: Future, shard: ShardHandle, channel: ChannelAddress
    ) -> MembershipEvent:
        """`Coordinator.promote`: the data server just started on `standby` takes the role of lost shard
        `index`. If the standby dies meanwhile, the coordinator is told at once (`_tell_lost_shards`: a
        call to a dead worker waits for Dask's connect timeout), the data server is released and
        `StaticWorkerLeft` raised, for the next standby; so is it when the coordinator is lost (its
        rebuild promotes a standby again)."""
        key = actor_key(shard) or ""  # what `shards_lost` matches
        self._promoting = (index, standby, key)
        try:
            return self._call(self.coordinator.promote(index, shard, channel, standby))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.client.cancel([future])
            if isinstance(exc, CoordinatorLost) or not self._leaves_soon(standby, LEAVING_GRACE_SECONDS):
                raise
            log.warning(
                "job %s: standby %s left while data server %d was promoted on it (%s); taking the next",
                self.job.job_id, standby, index, exc,
            )  # fmt: skip
            # It may have died after the coordinator counted it promoted (while peers were named again):
            # then it is lost again, for the next standby (keyed: a no-op where it was not promoted).
            reason = f"standby {standby} left during its promotion"
            self._call(self.coordinator.shards_lost([index], reason, [key]))
            raise StaticWorkerLeft(standby) from exc
        finally:
            self._promoting = None

    def _start_on_standby(
        self, index: int, start: ShardStart | None, version: int, replica: ShardHandle | None
    ) -> tuple[str, Future, ShardHandle, ChannelAddress, float, float]:
        """A data server for shard `index` on a standby: started from `start`, or empty and then given the
        snapshot of `version` from `replica` (the peer). A standby that dies meanwhile is passed over for
        the next one (a call to it would wait for the startup timeout); the peer's death raises
        `StaticWorkerLeft` for the peer. Returns the standby, the actor's future, its handle, where its
        channel listens, and the seconds its start and the copy from the peer took."""
        peer_at = self.placement[(index + 1) % len(self.placement)]
        cancelled = 0
        while True:
            standby = self._wait_for_standby(index)
            clock = time.monotonic()
            future: Future | None = None
            watched = standby  # the worker whose loss would explain a broken call
            try:
                self._await_engine(standby, self._startup_timeout())
                future = self._submit_data_server(index, standby, start, version)
                shard: ShardHandle = self._wait_unless_left(future, standby, self._startup_timeout())
                started = time.monotonic() - clock
                if replica is not None:
                    watched = peer_at
                    self._wait_unless_left(shard.adopt(replica, version), peer_at, self._startup_timeout())
                    watched = standby
                adopted = time.monotonic() - clock - started
                channel = self._wait_unless_left(shard.open_channel(), standby, self.job.call_timeout)
                return standby, future, shard, channel, started, adopted
            except Exception as exc:
                if future is not None:
                    with contextlib.suppress(Exception):
                        self.client.cancel([future])
                if isinstance(exc, StartCancelled):
                    cancelled += 1
                    if cancelled >= START_TRIES:
                        raise DataServerLostError(
                            f"data server {index} of job {self.job.job_id} could not be started on a "
                            f"standby: Dask cancelled its start {cancelled} times ({exc})"
                        ) from exc
                    log.warning("job %s: %s on standby %s; starting it again", self.job.job_id, exc, standby)
                    continue
                gone = isinstance(exc, StaticWorkerLeft) and exc.worker == standby
                if isinstance(exc, StaticWorkerLeft) and not gone:
                    raise  # the peer
                # A broken call to the standby had its grace in `_wait_unless_left`; the copy from the peer
                # may have broken because the standby, which receives it, died.
                if not gone and (watched == standby or not self._leaves_soon(standby, LEAVING_GRACE_SECONDS)):
                    raise
                log.warning(
                    "job %s: standby %s left while data server %d started on it (%s); taking the next",
                    self.job.job_id, standby, index, exc,
                )  # fmt: skip

    def _restore_from_checkpoint(self, lost: list[int], why: str) -> None:
        """Data servers lost with the replicas of their shards: every shard goes back to the newest
        persistent checkpoint in the same run (the lost ones on standbys, the others on their workers, all
        started afresh from it), and the coordinator to the record of that step (`Coordinator.rebuild`
        from the controller's copy). Without `checkpoint` on the job, fails naming the lost data servers."""
        job = self.job
        if job.mode == "async":
            # (The coordinator's loss too, with data server 0 and no replica of its shard: the shards stand
            # at different versions, which the rebuild from a checkpoint does not handle yet.)
            raise DataServerLostError(
                f"{why}; async mode cannot go back to a checkpoint in the same run yet "
                "(docs/design/async.md): run the job again (it resumes from its checkpoint), or use "
                "mode='sync'"
            )
        found = self.persistence.fallback()
        if found is None:
            raise DataServerLostError(
                f"{why}. Job {job.job_id} has no `checkpoint` to go back to in the same run: set one, or "
                "run the job again (with `checkpoint` set it resumes from the last checkpoint)"
            )
        checkpoint, source = found
        began, clock = time.time(), time.monotonic()
        log.warning("job %s: %s; every shard goes back to %s", job.job_id, why, source)
        holders = list(self.placement)
        for i in lost:
            holders[i] = self._wait_for_standby(i, taken=holders)
        futures = [
            self._submit_data_server(i, holders[i], self.persistence.shard_start(i, names, checkpoint))
            for i, names in enumerate(self.plan)
        ]
        shards = [settled_result(f, self._startup_timeout()) for f in futures]
        channels = [s.open_channel().result(timeout=job.call_timeout) for s in shards]
        old, self.actor_futures = self.actor_futures, futures
        for i, shard in enumerate(self.shards):
            if i not in lost:
                with contextlib.suppress(Exception):
                    shard.close_channel().result(timeout=job.call_timeout)
        with contextlib.suppress(Exception):
            self.client.cancel(old)
        self.shards[:], self.channels[:], self.placement[:] = shards, channels, holders
        version = checkpoint.committed_steps if checkpoint is not None else 0
        event: MembershipEvent = self._call(
            self.coordinator.rebuild(
                self.journal, self.shards, self.channels, [], self.coordinator_at,
                f"{why}; every shard went back to {source} (step {version})", began, EventKind.RESTORED,
            ),
            timeout=3 * job.call_timeout,
        )  # fmt: skip
        self._told_lost.clear()
        self.standbys = tuple(w for w in self.standbys if w not in self.placement)
        self.journal = Journal()
        self._copy_journal()
        self._check_soon()
        log.warning(
            "job %s: every shard back to %s at step %d in %.2f s (%d committed steps to train again)",
            job.job_id, source, event.step, time.monotonic() - clock, event.steps_lost,
        )  # fmt: skip

    def _wait_for_standby(self, index: int, taken: list[str] | None = None) -> str:
        """A static worker holding no data server of this job (nor one of `taken`); waits up to
        `min_workers_timeout` for one to join, then fails naming the role."""
        deadline = time.monotonic() + self.job.min_workers_timeout
        while True:
            view = self._workers_view()
            free = standbys([w for w in view.static if w not in self.leaving], taken or self.placement)
            if free:
                return free[0]
            if time.monotonic() >= deadline:
                raise DataServerLostError(
                    f"data server {index} of job {self.job.job_id} was lost with its static worker "
                    f"{self.placement[index]}, and no standby static worker joined within "
                    f"{self.job.min_workers_timeout:g} s (min_workers_timeout): start one with "
                    f"`dask worker <scheduler> --resources {self.job.static_resource}=1`"
                )
            time.sleep(MEMBERSHIP_POLL_SECONDS)

    def _publish(self, progress: Progress) -> None:
        # Anyone with a client to the cluster can follow the job (`read_progress`), at a cost of one small
        # scheduler call every PUBLISH_SECONDS.
        now = time.monotonic()
        if now - self._published < PUBLISH_SECONDS and progress.state == "running":
            return
        self._published = now
        publish_progress(self.client, self.job.job_id, progress)

    def _call(self, future: Any, timeout: float | None = None) -> Any:
        """The answer to a call to the coordinator. If its static worker leaves meanwhile, raises
        `CoordinatorLost` at once (the call itself would wait for Dask's connect timeout)."""
        deadline = time.monotonic() + (timeout or self.job.call_timeout)
        next_look = time.monotonic() + WATCH_WHILE_CALLING_SECONDS
        while True:
            try:
                return future.result(timeout=max(0.001, min(CALL_SLICE_SECONDS, deadline - time.monotonic())))
            except TimeoutError as exc:
                if self.coordinator_at in self.left:
                    raise CoordinatorLost(
                        f"its static worker {self.coordinator_at} left the cluster"
                    ) from exc
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + WATCH_WHILE_CALLING_SECONDS
                    self._tell_lost_shards()
                if now < deadline:
                    continue
                raise DataServerLostError(
                    f"the coordinator of job {self.job.job_id} on {self.coordinator_at} did not answer "
                    f"within {timeout or self.job.call_timeout:g} s; its static worker is probably frozen"
                ) from exc
            except (OSError, RuntimeError) as exc:
                if isinstance(exc, RuntimeError) and "Actor was lost" not in str(exc):
                    raise
                # The connection to its worker broke, or the scheduler said the worker is gone.
                raise CoordinatorLost(
                    f"its static worker {self.coordinator_at} was lost ({type(exc).__name__}: {exc})"
                ) from exc

    def _wait_unless_left(
        self, future: Any, worker: str, timeout: float, elastic: bool = False, heard: bool = True
    ) -> Any:
        """`future`'s result, unless the static worker `worker` (an elastic one with `elastic`), which the
        call depends on, leaves first: a call to a dead worker waits for Dask's connect timeout. With
        `heard`, a static worker the scheduler has not heard from lately has left too (a promotion must not
        wait on a frozen standby); without, only one the scheduler no longer lists (at the start, a worker
        busy with its first import is silent for a moment)."""
        deadline = time.monotonic() + timeout
        next_look = time.monotonic() + WATCH_WHILE_CALLING_SECONDS
        while True:
            try:
                slice_s = max(0.001, min(CALL_SLICE_SECONDS, deadline - time.monotonic()))
                return settled_result(future, slice_s)
            except TimeoutError:
                now = time.monotonic()
                if worker in self.left:
                    raise StaticWorkerLeft(worker) from None
                if now >= next_look:
                    next_look = now + WATCH_WHILE_CALLING_SECONDS
                    if not self._listed(worker, elastic, heard):
                        raise StaticWorkerLeft(worker) from None
                if now >= deadline:
                    raise
            except StartCancelled:
                raise
            except Exception as exc:
                # The call broke: if `worker` is gone, that is why (the error itself may be any of
                # Dask's: a closed comm, an actor whose worker was lost, one from a worker in its death).
                if not elastic and self._leaves_soon(worker, LEAVING_GRACE_SECONDS, heard):
                    raise StaticWorkerLeft(worker) from exc
                raise

    def _listed(self, worker: str, elastic: bool = False, heard: bool = True) -> bool:
        """Whether `worker` is still there: an elastic one listed by the scheduler; a static one listed and
        (with `heard`) heard from lately."""
        view = self._workers_view()
        if elastic:
            return worker in view.listed
        return worker in view.static or (not heard and worker in view.silent_static)

    def _leaves_soon(self, worker: str, grace: float, heard: bool = True) -> bool:
        """Whether the static worker `worker` is gone, or goes within `grace` seconds."""
        deadline = time.monotonic() + grace
        while True:
            if worker in self.left or not self._listed(worker, heard=heard):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(WATCH_WHILE_CALLING_SECONDS)

    def _answering(self, indices: Iterable[int]) -> set[int]:
        """Of the data servers `indices`, taken for lost, those that answer a call within `call_timeout`.

        A static worker the scheduler lists but has not heard from for a moment is taken for lost, so that
        a cut or frozen one's roles move within seconds. But a worker, or the scheduler itself, starved of
        CPU is silent for a moment too (CI's chaos soak on 2 cores: the coordinator's worker and both data
        servers' silent at once, and a job that had lost nothing failed for want of a live shard). So where
        silence would cost a shard its last copy (the job would go back to a checkpoint, or fail), the
        silent ones are asked first: one that answers is not lost, and its answer counts as a heartbeat
        (for one silence limit). A worker being handed over is not asked, nor one whose data server was kept
        `KEEP_TRIES` times (silent to the scheduler while it answers, it would be fenced over and over)."""
        view = self._workers_view()
        listed = {*view.static, *view.silent_static}  # (heard again, perhaps, since it was taken for lost)
        asked: dict[int, Any] = {}
        for i in sorted(set(indices)):
            where = self.placement[i]
            if where not in listed or where in self.leaving or self._kept[(i, where)] >= KEEP_TRIES:
                continue  # gone; handing its roles over; or kept too often already
            with contextlib.suppress(RuntimeError):  # Dask already knows its worker is gone
                asked[i] = self.shards[i].status(self.schedule.total_steps)
        if asked:
            log.warning(
                "job %s: data servers %s, taken for lost, are still listed by the scheduler; asking them "
                "before they count as lost (up to %g s, call_timeout)",
                self.job.job_id, sorted(asked), self.job.call_timeout,
            )  # fmt: skip
        answered: set[int] = set()
        deadline = time.monotonic() + self.job.call_timeout
        while asked and time.monotonic() < deadline:
            for i, future in list(asked.items()):
                if self.placement[i] in self.left:
                    del asked[i]  # the scheduler removed its worker: lost after all
                    continue
                try:
                    future.result(timeout=CALL_SLICE_SECONDS)
                except TimeoutError:
                    continue
                except Exception:  # its worker died meanwhile
                    del asked[i]
                    continue
                del asked[i]
                answered.add(i)
                self._answered_at[self.placement[i]] = time.monotonic()
        if answered:
            log.warning("job %s: data servers %s answered: not lost", self.job.job_id, sorted(answered))
        return answered

    def _tell_lost_shards(self) -> None:
        """While a coordinator call waits (it may be calling every shard), look at the static workers: a
        call to a shard whose worker just died waits for Dask's connect timeout, so the coordinator is told
        of the loss at once (`shards_lost`, not waited for), which makes it give that call up."""
        static = set(self._workers_view().static)
        if self.coordinator_at not in static:
            raise CoordinatorLost(f"its static worker {self.coordinator_at} left the cluster")
        if self._promoting is not None and self._promoting[1] not in static:
            # Told again at each look while the promotion lasts: a report that reaches the coordinator
            # before the promotion put the standby's data server in place does not match its key.
            index, standby, key = self._promoting
            self.coordinator.shards_lost([index], f"standby {standby} left during its promotion", [key])
        for i, where in enumerate(self.placement):
            if where not in static and i not in self._told_lost:
                self._told_lost.add(i)
                # Not waited for: the answer may come after the promotion, which the key fences out.
                self.coordinator.shards_lost([i], f"static worker {where} left", [self.shards[i].key])

    def _copy_journal(self) -> None:
        """Bring the controller's copy of the coordinator's record up to date (`Journal`)."""
        part: Journal = self._call(
            self.coordinator.journal(self.journal.committed_steps, len(self.journal.events))
        )
        self.journal.extend(part)

    def _rebuild_coordinator(self, reason: str) -> None:
        """The coordinator's static worker died: start a coordinator on another static worker and rebuild
        its record from the controller's copy and from the shards (`Coordinator.rebuild`). Compute loops
        start over with the new handle; data servers lost with it are promoted next, as any lost one."""
        began, clock = time.time(), time.monotonic()
        job, lost_at = self.job, self.coordinator_at
        log.warning("job %s: the coordinator is lost (%s); rebuilding it", job.job_id, reason)
        cancelled = 0
        while True:
            # The worker chosen may be dying too (two static workers killed at once): place it again then.
            where = self._place_coordinator(lost_at)
            future = self._submit_coordinator(where, None)
            try:
                coordinator = controller_handle(
                    self._wait_unless_left(future, where, self._startup_timeout())
                )
                break
            except (StaticWorkerLeft, StartCancelled) as exc:
                with contextlib.suppress(Exception):
                    self.client.cancel([future])
                cancelled += isinstance(exc, StartCancelled)
                if cancelled >= START_TRIES:
                    raise DataServerLostError(
                        f"the coordinator of job {job.job_id} could not be rebuilt: Dask cancelled its start "
                        f"{cancelled} times ({exc})"
                    ) from exc
        static = self._workers_view().static
        lost = [i for i, holder in enumerate(self.placement) if holder not in static]
        started = time.monotonic() - clock
        old, self.coordinator_future = self.coordinator_future, future
        self.coordinator, self.coordinator_at = coordinator, where
        with contextlib.suppress(Exception):
            self.client.cancel([old])  # released: gone with its worker, or (a hand-over) that worker retires
        # Compute loops hold the old coordinator's handle: they start over with the new one (a loop that
        # was cancelled ends at its next step, and whatever it sends is of an old generation).
        for addr, loop in self.loops.items():
            loop.cancel()
            self.loop_restarts[addr] = max(0, self.loop_restarts.get(addr, 1) - 1)
        self.loops.clear()
        self._check_soon()
        for ask in (True, False):  # the second time with the data servers that answered
            try:
                event: MembershipEvent = self._call(
                    coordinator.rebuild(
                        self.journal, self.shards, self.channels, lost, where, reason, began,
                        EventKind.COORDINATOR_REBUILT,
                    ),
                    timeout=3 * job.call_timeout,
                )  # fmt: skip
                break
            except CoordinatorLost:
                raise
            except DataServerLostError as exc:
                # Data servers died with it, and with them the replicas of their shards; or they were
                # only silent for a moment, and answer (then the rebuild takes them in).
                back = self._answering(lost) if ask else set()
                if not back:
                    why = f"the coordinator's static worker {lost_at} died: {exc}"
                    self._restore_from_checkpoint(lost, why)
                    return
                lost = [i for i in lost if i not in back]
                self._told_lost -= back
                for i in back:
                    self._kept[(i, self.placement[i])] += 1
        # The copy is kept until the new coordinator's first part replaces it whole (a rebuilt record
        # sends everything from step 0): the shards dropped the records of the steps it holds
        # (`records_kept_from`), so if the new coordinator died before that part came, the next one would
        # have nothing else to rebuild those steps from.
        self._copy_journal()
        log.warning(
            "job %s: coordinator rebuilt on %s at step %d, %.2f s after it was seen lost (start %.3f s, "
            "rebuild %.3f s)%s",
            job.job_id, where, event.step, time.monotonic() - clock, started,
            time.monotonic() - clock - started, f"; data servers {lost} lost with it" if lost else "",
        )  # fmt: skip

    def _place_coordinator(self, lost_at: str) -> str:
        """Where a rebuilt coordinator goes: beside a live data server (it needs little memory, and the
        standbys stay free for data servers), else on a standby; waits up to `min_workers_timeout` for a
        static worker to join."""
        deadline = time.monotonic() + self.job.min_workers_timeout
        while True:
            static = [w for w in self._workers_view().static if w not in self.leaving]
            beside = [w for w in self.placement if w in static]
            if beside or static:
                return (beside or list(static))[0]
            if time.monotonic() >= deadline:
                raise DataServerLostError(
                    f"the coordinator of job {self.job.job_id} was lost with its static worker {lost_at}, "
                    f"and no static worker was left or joined within {self.job.min_workers_timeout:g} s "
                    f"(min_workers_timeout) to rebuild it on: start one with "
                    f"`dask worker <scheduler> --resources {self.job.static_resource}=1`"
                )
            time.sleep(MEMBERSHIP_POLL_SECONDS)

    def _workers_view(self) -> WorkersView:
        """The elastic workers as the scheduler sees them: live ones (running, and heard from lately),
        whether one is still starting, and every one the scheduler still lists (a frozen worker stays
        listed until its worker-ttl, minutes later)."""
        silent_after = max(self.job.liveness_interval, 0.0)
        view = self.client.run_on_scheduler(scheduler_view_of_workers, silent_heartbeats=SILENT_HEARTBEATS)
        rows = view["workers"]
        listed = {r["address"] for r in rows}
        for gone in [w for w in self.engine if w not in listed]:
            del self.engine[gone]
        self.engine_loaded &= listed
        elastic = [r for r in rows if not is_static_worker(r, self.job.static_resource)]
        running = [
            r["address"]
            for r in elastic
            if r["status"] in ("running", "paused") and r["silent"] <= max(silent_after, r["silent_limit"])
        ]
        # A worker that has not imported the engine yet is still starting: the import would otherwise
        # happen on its event loop, which would send no heartbeat meanwhile (`connect.load_engine`).
        loaded = self._engine_loaded(running)
        live = sorted(a for a in running if a in loaded)
        # A static worker asked to retire is "closing_gracefully" while the scheduler tries (and refuses:
        # it holds an actor), then "running" again: it is still there, and its roles are handed over.
        static = [
            r
            for r in rows
            if is_static_worker(r, self.job.static_resource)
            and r["status"] in ("running", "paused", "closing_gracefully")
        ]
        # A static worker that stopped sending heartbeats (its network cut, or frozen) is gone too, as a
        # silent compute worker is: the scheduler lists it until Dask's TCP timeout or worker-ttl (12 s to
        # minutes), and every call to its data server waits meanwhile. It is never a standby; its roles
        # move only while a standby that is heard from can take them: with none, declaring it lost would
        # turn a pause into a job that fails after `min_workers_timeout`, so they stay and the controller
        # waits for it (or for Dask to remove it). One that answered a direct call lately was heard then.
        answered = self._answered_at

        def unheard(r: dict[str, Any]) -> bool:
            since = min(r["silent"], time.monotonic() - answered.get(r["address"], -math.inf))
            return bool(since > max(silent_after, r["silent_limit"]))

        # A role's worker silent to the scheduler is asked for Dask's handshake first: one starved of CPU
        # (the chaos soak's 2 cores) still answers, and taking it for lost cost a promotion or the
        # coordinator's rebuild, seconds under that load; a frozen or cut-off one never answers.
        # One that did not answer is not asked again until the scheduler hears from it.
        roles = {*self.placement, self.coordinator_at}
        self._unanswered &= {r["address"] for r in static if unheard(r)}
        asked = {r["address"] for r in static if r["address"] in roles and unheard(r)} - self._unanswered
        alive = self._members_answering(asked, min(SILENT_PROBE_SECONDS, max(silent_after, 0.1)))
        for worker in alive:
            answered[worker] = time.monotonic()
        self._unanswered |= asked - alive
        heard = [r for r in static if not unheard(r)]
        if not standbys([r["address"] for r in heard], self.placement):
            heard += [r for r in static if r not in heard and r["address"] in roles]
        elif self.job.mode == "async":
            # Nor is the coordinator's worker given up for silence in async mode, where its loss ends the
            # job (docs/design/async.md): a worker only starved of CPU for a moment (seen in the chaos
            # soak on 2 cores) would otherwise end it. Dask's removal still counts.
            heard += [r for r in static if r not in heard and r["address"] == self.coordinator_at]
        silent = frozenset(r["address"] for r in static if r not in heard)
        static = heard
        requested = getattr(self.cluster, "requested", None)
        pending = len(set(map(str, requested)) - {str(r["name"]) for r in rows}) if requested else 0
        return WorkersView(
            live=live,
            starting=any(r["status"] == "init" for r in elastic) or len(loaded) < len(running),
            pending=pending,
            listed={r["address"] for r in elastic},
            static=tuple(r["address"] for r in sorted(static, key=lambda r: (str(r["name"]), r["address"]))),
            graceful=frozenset(view["graceful"]),
            silent_static=silent,
        )

    def _loops_to_restart(self, live: list[str]) -> bool:
        return any(self.loops[a].done() for a in live if a in self.loops)

    def _ensure_loops(self, view: WorkersView, coordinator: CoordinatorHandle, plan: list[list[str]]) -> bool:
        """A compute loop on every live worker. Returns whether a live member's loop was started over
        (it needs a fence). The loop of a worker that is listed but silent (frozen) is kept: if it wakes,
        its old messages are refused and it asks for a new role."""
        restarted = False
        for addr in list(self.loops):
            if addr not in view.listed:
                self.loops.pop(addr).cancel()
        for addr in view.live:
            loop = self.loops.get(addr)
            if loop is not None and loop.done():
                self._collect_loop(addr, loop)
                loop = None
                restarted = True
            if loop is None:
                self.loop_restarts[addr] = self.loop_restarts.get(addr, 0) + 1
                self._loop_serial += 1
                self.loops[addr] = self.client.submit(
                    compute_loop, self.job, coordinator, plan, self.layout, self.schedule,
                    key=f"prefect-elastic-{self.job.job_id}-{self.run_id}-compute-{addr}-{self._loop_serial}",
                    workers=[addr], allow_other_workers=False, pure=False,
                )  # fmt: skip
        return restarted

    def _collect_loop(self, addr: str, loop: Future) -> None:
        if loop.status == "finished":
            self.loop_stats.append(loop.result())
        elif loop.status == "error":
            error = loop.exception()
            if isinstance(error, FatalError):
                raise error  # a shard said the job cannot go on: no restart would help
            self.loop_failures += 1
            # With its traceback: which call failed is what tells a restart that helps from one that cannot.
            log.warning(
                "job %s: compute loop on %s ended with %r", self.job.job_id, addr, error, exc_info=error
            )
            if self.loop_restarts.get(addr, 0) > MAX_LOOP_RESTARTS:
                # An error that survives restarts (the model does not import there, a version mismatch)
                # would otherwise keep the worker a member that never trains.
                raise FatalError(
                    f"the compute loop on {addr} failed {self.loop_restarts[addr]} times; last error: "
                    f"{type(error).__name__}: {error}"
                )

    def _failure(self, progress: Progress) -> FatalError:
        message = progress.failure or "training failed"
        if progress.failure_kind == "model":
            return TrainingFailedError(message, progress.failure_step, progress.failure_batch)
        if progress.failure_kind == "not-enough-workers":
            return NotEnoughWorkersError(message)
        if progress.failure_kind == "data-server-lost":
            return DataServerLostError(message)
        return FatalError(message)

    # -- teardown --------------------------------------------------------------------------------

    def _stop_loops(self) -> None:
        # Loops see `stop` within one work poll; wait for their stats briefly, then cancel what is left.
        deadline = time.monotonic() + 2.0
        for addr, loop in list(self.loops.items()):
            with contextlib.suppress(Exception):
                settled_result(loop, max(0.01, deadline - time.monotonic()))
            self._collect_loop(addr, loop) if loop.done() else loop.cancel()
        self.loops.clear()

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
