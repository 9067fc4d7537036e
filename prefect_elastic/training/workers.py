"""The workers as the job sees them: which elastic workers are live members, which are still starting,
which static workers hold roles, which are standbys, and which are silent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed import Client

from ..cluster import (
    answering,
    is_static_worker,
    scheduler_view_of_workers,
)

if TYPE_CHECKING:
    from ..job import ElasticJob
    from ..modes import Mode
    from .engine import EngineLoads
    from .role_table import RoleTable

log = logging.getLogger(__name__)

# A worker silent for more than this many of the scheduler's heartbeat intervals (and for more than a
# liveness interval) is out of the membership: 0.5 s heartbeats on small clusters make it 1.25 s.
SILENT_HEARTBEATS = 2.5

# How long a static worker that holds a role and is silent to the scheduler is given to answer Dask's
# handshake before it counts as silent (at most a liveness interval): a live one answers in milliseconds.
SILENT_PROBE_SECONDS = 0.5
# The same for a compute member silent to the scheduler: short, so that a frozen or cut-off member is still
# out within two liveness intervals (the silence limit, then this).
MEMBER_PROBE_SECONDS = 0.2

# How often a wait for a static worker's leave looks at the scheduler's view.
WATCH_SECONDS = 0.1


@dataclass(frozen=True)
class WorkersView:
    live: list[str]  # elastic workers that run and were heard from lately
    starting: bool
    listed: set[str]  # elastic workers the scheduler lists (a frozen one stays listed)
    static: tuple[str, ...] = ()  # static workers that run, in the order roles are placed on them
    pending: int = 0  # workers the cluster object started that the scheduler does not list yet
    graceful: frozenset[str] = frozenset()  # workers that left gracefully lately (retired, not lost)
    # Static workers the scheduler still lists but has not heard from lately: left out of `static`, but
    # asked before their loss would cost a shard's last copy (`Calls.answering`).
    silent_static: frozenset[str] = frozenset()
    # Of `silent_static`, the seconds since each was last heard from or answered a direct call.
    silence: dict[str, float] = field(default_factory=dict)


def standbys(static: tuple[str, ...] | list[str], placement: list[str]) -> tuple[str, ...]:
    """The live static workers that hold no data server of the job: where a lost one's role can go. (The
    coordinator starts beside data server 0; one rebuilt on a standby leaves room there for a data
    server, since it holds little.)"""
    return tuple(w for w in static if w not in placement)


def readiest_first(free: tuple[str, ...], warm: set[str], warming: set[str]) -> list[str]:
    """The standbys `free`, the one that can take a role soonest first: warmed (`warm_standby` done), then
    warming, then the others, each in the order given. A data server started on a standby that was never
    warmed builds the first optimizer of its process, which imports torch._dynamo: 5 to 11 s on a loaded
    machine (the chaos soak), where a warmed one starts in a fraction of a second."""
    return sorted(free, key=lambda w: (w not in warm, w not in warming))


def running_elastic(
    rows: list[dict[str, Any]],
    static_resource: str,
    silent_after: float,
    now: float = 0.0,
    answered_at: dict[str, float] | None = None,
) -> list[str]:
    """The elastic workers that run and were heard from lately (`scheduler_view_of_workers`'s rows), or
    answered a direct call lately (`answered_at`, by the clock of `now`: `unheard`)."""
    return [
        r["address"]
        for r in rows
        if not is_static_worker(r, static_resource)
        and r["status"] in ("running", "paused")
        and not unheard(r, now, silent_after, answered_at or {})
    ]


def static_rows(rows: list[dict[str, Any]], static_resource: str) -> list[dict[str, Any]]:
    """The static workers that are there. (One asked to retire is "closing_gracefully" while the scheduler
    tries, and refuses, since it holds an actor, then "running" again: it is still there, and its roles
    are handed over.)"""
    return [
        r
        for r in rows
        if is_static_worker(r, static_resource) and r["status"] in ("running", "paused", "closing_gracefully")
    ]


def unheard(row: dict[str, Any], now: float, silent_after: float, answered_at: dict[str, float]) -> bool:
    """Whether the scheduler has not heard from the worker of `row` lately, nor has it answered a direct
    call lately (`answered_at`: such an answer counts as a heartbeat)."""
    since = min(row["silent"], now - answered_at.get(row["address"], -math.inf))
    return bool(since > max(silent_after, row["silent_limit"]))


@dataclass(frozen=True)
class Roles:
    """Where the job's roles live, as the view of the workers needs it."""

    placement: list[str]  # the static worker of each data server
    coordinator_at: str
    # Whether the coordinator's worker keeps its role while silent with standbys heard (async mode, where
    # its loss ends the job: docs/design/async.md).
    keep_silent_coordinator: bool = False


def classify(
    rows: list[dict[str, Any]],
    graceful: Iterable[str],
    *,
    static_resource: str,
    silent_after: float,
    now: float,
    answered_at: dict[str, float],
    loaded: set[str],
    roles: Roles,
    requested: Iterable[Any] | None = None,
) -> WorkersView:
    """The workers as the job sees them, from the scheduler's rows (`scheduler_view_of_workers`): a pure
    decision. Elastic workers are live once running, heard from lately and with the engine `loaded`. A
    static worker that stopped sending heartbeats (its network cut, or frozen) is gone too, as a silent
    compute worker is: the scheduler lists it until Dask's TCP timeout or worker-ttl (12 s to minutes), and
    every call to its data server waits meanwhile. It is never a standby; its roles move only while a
    standby that is heard from can take them: with none, declaring it lost would turn a pause into a job
    that fails after `min_workers_timeout`, so they stay and the controller waits for it (or for Dask to
    remove it). `requested`: the workers a cluster object started (`SpecCluster.requested`), those the
    scheduler does not list yet are `pending`."""
    elastic = [r for r in rows if not is_static_worker(r, static_resource)]
    running = running_elastic(rows, static_resource, silent_after, now, answered_at)
    static = static_rows(rows, static_resource)
    heard = [r for r in static if not unheard(r, now, silent_after, answered_at)]
    holders = {*roles.placement, roles.coordinator_at}
    if not standbys([r["address"] for r in heard], roles.placement):
        heard += [r for r in static if r not in heard and r["address"] in holders]
    elif roles.keep_silent_coordinator:
        heard += [r for r in static if r not in heard and r["address"] == roles.coordinator_at]
    pending = len(set(map(str, requested)) - {str(r["name"]) for r in rows}) if requested else 0
    return WorkersView(
        live=sorted(a for a in running if a in loaded),
        starting=any(r["status"] == "init" for r in elastic) or len(set(running) & loaded) < len(running),
        pending=pending,
        listed={r["address"] for r in elastic},
        static=tuple(r["address"] for r in sorted(heard, key=lambda r: (str(r["name"]), r["address"]))),
        graceful=frozenset(graceful),
        silent_static=frozenset(r["address"] for r in static if r not in heard),
        silence={
            r["address"]: min(r["silent"], now - answered_at.get(r["address"], -math.inf))
            for r in static
            if r not in heard
        },
    )


def pass_over_standby(listed: bool, silent_for: float | None, another_free: bool, patience: float) -> bool:
    """Whether a promotion gives up the standby it is starting a data server on (for another standby, or
    for the next to join): gone (the scheduler no longer `listed` it), or silent (`silent_for`: seconds
    since it was last heard from or answered; None while it is heard from) while another standby heard
    from is free, or for longer than `patience`. A lone standby silent for a moment is waited for: one
    busy with the start itself (imports that starve its event loop: seconds on a loaded machine) had its
    start cancelled and begun again once it was heard from, three starts and 18 s in one chaos soak for a
    start of 0.1 s; a frozen or cut-off one stays silent past `patience`. Pure."""
    if not listed:
        return True
    if silent_for is None:
        return False
    return another_free or silent_for > patience


def members_answering(client: Client, workers: set[str], timeout: float) -> frozenset[str]:
    """The workers among `workers` whose process answers a connection within `timeout` seconds
    (`cluster.workers.answering`); none if asking fails."""
    if not workers:
        return frozenset()
    try:
        alive: frozenset[str] = client.sync(
            answering, workers, timeout, callback_timeout=timeout + 1, **client.connection_args
        )
    except Exception:  # (the client's loop closing under it: nothing is known, so wait)
        return frozenset()
    return alive


class Workers:
    """The static workers' watch, and the run's view of the workers: the scheduler's rows read, the
    engine's loads and the handshakes with silent role holders done, then `classify`. It owns what the
    controller learned of the workers beyond the scheduler's rows: who answered while silent, who left,
    who asked to retire; the others tell it (`heard`, `worker_left`, `retire_asked`, ...) and ask it
    (`has_left`, `retire_requests`), never write its fields. The members of the last survival check are
    the run's (`MembershipState.known`), read through `members`."""

    def __init__(
        self,
        client: Client,
        job: ElasticJob,
        mode: Mode,
        roles: RoleTable,
        engine: EngineLoads,
        cluster: Any,
        members: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.client = client
        self.job = job
        self.mode = mode
        self.roles = roles
        self.engine = engine
        self.cluster = cluster
        # Static workers that answered a direct call while silent to the scheduler (`Calls.answering`), and
        # when: the answer counts as a heartbeat.
        self._answered_at: dict[str, float] = {}
        self._unanswered: set[str] = set()  # silent workers that did not answer the handshake since
        self._left: set[str] = set()  # workers the scheduler said it removed (its events)
        self._retiring: set[str] = set()  # workers someone asked to retire, which the scheduler refused
        self._retire_waiting: set[str] = set()  # of those, the ones told that no standby can relieve them yet
        # The live workers the last survival check saw (kept across a coordinator's rebuild, whose first
        # check re-admits them): the run's, read when a view asks silent members for a handshake.
        self._members = members

    @property
    def members(self) -> tuple[str, ...]:
        """The live workers the last survival check saw."""
        return tuple(self._members())

    def heard(self, worker: str) -> None:
        """`worker` answered a direct call: a heartbeat."""
        self._answered_at[worker] = time.monotonic()

    def worker_left(self, worker: str) -> None:
        """The scheduler said it removed `worker` (its `remove-worker` event)."""
        self._left.add(worker)

    def has_left(self, worker: str) -> bool:
        """Whether the scheduler said it removed `worker` since a role was last placed there."""
        return worker in self._left

    def placed_on(self, where: str) -> None:
        """A role goes to the live static worker `where`: from now on `has_left` tells whether it left
        since. A worker the scheduler removed once and that came back at the same address (a paused process
        that resumed and registered again) stayed in `left`, and a role put there later was taken for
        lost at its first call (the chaos soak: a coordinator rebuilt there failed the job)."""
        self._left.discard(where)

    def retire_asked(self, workers: Iterable[str]) -> None:
        """Someone asked to retire `workers`, which the scheduler refused (they hold an actor of this job:
        a static worker with a role); their roles are handed over at the next look
        (`StaticRoles.keep_roles`)."""
        self._retiring.update(workers)

    def retire_requests(self) -> list[str]:
        """The workers asked to retire whose roles are still to hand over."""
        return sorted(self._retiring)

    def retire_taken(self, worker: str) -> None:
        """`worker`'s retire request is carried out now: dropped (a hand-over that raises is not tried
        again at every check; one that must wait is asked again, `retire_waits`)."""
        self._retiring.discard(worker)

    def retire_waits(self, worker: str) -> bool:
        """No standby can relieve the retiring `worker` yet: its request is asked again at the next check.
        Whether it is the first time it waits (the controller says so once)."""
        self._retiring.add(worker)
        first = worker not in self._retire_waiting
        self._retire_waiting.add(worker)
        return first

    def handing_over(self, worker: str) -> None:
        """The retiring `worker`'s roles are being handed over: it waits no more."""
        self._retire_waiting.discard(worker)

    def view(self) -> WorkersView:
        """The workers as the scheduler sees them now (`classify`)."""
        silent_after = max(self.job.liveness_interval, 0.0)
        view = self.client.run_on_scheduler(scheduler_view_of_workers, silent_heartbeats=SILENT_HEARTBEATS)
        rows = view["workers"]
        self.engine.forget_unlisted({r["address"] for r in rows})
        # A role's worker silent to the scheduler is asked for Dask's handshake first: one starved of CPU
        # (the chaos soak's 2 cores) still answers, and taking it for lost cost a promotion or the
        # coordinator's rebuild, seconds under that load; a frozen or cut-off one never answers.
        # One that did not answer is not asked again until the scheduler hears from it.
        now = time.monotonic()
        silent = {
            r["address"]
            for r in static_rows(rows, self.job.static_resource)
            if unheard(r, now, silent_after, self._answered_at)
        }
        self._unanswered &= silent
        # (So is a standby a data server is starting on: one busy warming, whose import starves its event
        # loop for seconds, was taken for gone and the start tried again on it, 10 s lost each time.)
        holders = self.roles.holders()
        # And a compute member: a false loss costs a membership change, and another when it joins again
        # (the chaos soak: members silent to the scheduler for 1.3 to 2 s under load, then back).
        members = set(self._members())
        silent_members = {
            r["address"]
            for r in rows
            if r["address"] in members
            and not is_static_worker(r, self.job.static_resource)
            and r["status"] in ("running", "paused")
            and unheard(r, now, silent_after, self._answered_at)
        }
        self._unanswered &= silent | silent_members
        asked = silent & holders - self._unanswered
        alive = members_answering(self.client, asked, min(SILENT_PROBE_SECONDS, max(silent_after, 0.1)))
        asked_members = silent_members - self._unanswered
        answered_members = members_answering(self.client, asked_members, MEMBER_PROBE_SECONDS)
        if answered_members:
            log.info(
                "job %s: members %s, silent to the scheduler, answered Dask's handshake: still members",
                self.job.job_id, sorted(answered_members),
            )  # fmt: skip
        for worker in alive | answered_members:
            self.heard(worker)
        self._unanswered |= (asked - alive) | (asked_members - answered_members)
        # A worker that has not imported the engine yet is still starting: the import would otherwise
        # happen on its event loop, which would send no heartbeat meanwhile (`cluster.workers.load_engine`).
        loaded = self.engine.loaded_on(
            running_elastic(rows, self.job.static_resource, silent_after, time.monotonic(), self._answered_at)
        )
        return classify(
            rows,
            view["graceful"],
            static_resource=self.job.static_resource,
            silent_after=silent_after,
            now=time.monotonic(),
            answered_at=self._answered_at,
            loaded=loaded,
            roles=Roles(
                list(self.roles.placement), self.roles.coordinator_at, self.mode.coordinator_kept_while_silent
            ),
            requested=getattr(self.cluster, "requested", None),
        )

    def listed(self, worker: str, elastic: bool = False, heard: bool = True) -> bool:
        """Whether `worker` is still there: an elastic one listed by the scheduler; a static one listed and
        (with `heard`) heard from lately."""
        view = self.view()
        if elastic:
            return worker in view.listed
        return worker in view.static or (not heard and worker in view.silent_static)

    def leaves_soon(self, worker: str, grace: float, heard: bool = True) -> bool:
        """Whether the static worker `worker` is gone, or goes within `grace` seconds."""
        deadline = time.monotonic() + grace
        while True:
            if worker in self._left or not self.listed(worker, heard=heard):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(WATCH_SECONDS)
