"""Where the controller decides a membership change: events in (a scheduler worker event, a timer, a loss
a loop or the coordinator reported, a retire request), a decision out, as pure functions tested without a
cluster (tests/unit/test_membership.py); `TrainingRun._supervise` carries each decision out.

The compute members: `looked` (between checks, whether the view changed) and `decide` (a survival check now,
or held: for a joiner still starting, for the rest of a group of joins, for the rest of a group of
losses, or until the members still listed answered a handshake). The static roles: `role_changes` (the
coordinator's worker lost: rebuild it; a data server's: promote a standby) and `retire` (a retiring worker's
roles handed over, or held while no standby can take them). The coordinator's own decision of what a change
does to training (snapshot, rollback, reassign) stays in `survival.survival_check`, which it runs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from .pacing import LOSS_GROUP_SECONDS, MEMBERSHIP_POLL_SECONDS, STARTING_RECHECK_SECONDS


@dataclass(frozen=True)
class MembershipState:
    """What the controller remembers between passes: the members of the last survival check, and its
    timers."""

    known: tuple[str, ...] = ()  # the live workers the last survival check saw
    group_since: float | None = None  # when joins that wait for the rest of their group were first seen
    loss_since: float | None = None  # when a loss that waits for the rest of its group was first seen
    next_check: float = 0.0  # the next survival check by the interval
    next_look: float = 0.0  # the next read of the scheduler's view between survival checks


@dataclass(frozen=True)
class Seen:
    """What one pass of the controller sees of the compute members."""

    live: tuple[str, ...]
    starting: bool  # an elastic worker registered but not running (or its engine not loaded) yet
    pending: int  # workers the cluster object started that the scheduler does not list yet
    restarts: bool  # a member without a running loop
    triggered: bool  # a worker event woke the controller, or a look found a change
    must_check: bool  # an event other than an add-worker's: check now, whatever is starting
    answering: frozenset[str] | None = None  # the members that answered a handshake, once asked


@dataclass(frozen=True)
class Check:
    """Run a survival check on `live` now."""

    state: MembershipState
    live: tuple[str, ...]
    reason: str  # "worker event" or "interval"


@dataclass(frozen=True)
class Hold:
    """Hold the check: wait up to `seconds` for the next event, then look again (at once with
    `check_soon`)."""

    state: MembershipState
    seconds: float
    why: str
    check_soon: bool = False


@dataclass(frozen=True)
class AskMembers:
    """Before the check can be decided, ask `workers` (the members still listed while a loss waits for the
    rest of its group) for a handshake within `seconds`; then decide again with the answers."""

    state: MembershipState
    workers: frozenset[str]
    seconds: float


Decision = Check | Hold | AskMembers


def look_due(state: MembershipState, now: float, triggered: bool) -> bool:
    """Whether to read the scheduler's view now, between survival checks: a starting worker turning
    "running", or a member that stopped sending heartbeats, is a change no scheduler event announces."""
    return not triggered and now >= state.next_look


def looked(
    state: MembershipState, now: float, live: Collection[str], starting: bool, loops_ended: bool
) -> tuple[MembershipState, bool]:
    """After a look between checks: the state, and whether the members changed (or a loop ended)."""
    following = now + (STARTING_RECHECK_SECONDS if starting else MEMBERSHIP_POLL_SECONDS)
    return replace(state, next_look=following), tuple(live) != state.known or loops_ended


def check_due(state: MembershipState, now: float, triggered: bool) -> bool:
    return triggered or now >= state.next_check


def decide(state: MembershipState, seen: Seen, now: float, liveness_interval: float) -> Decision:
    """The membership decision of one pass whose check is due (`check_due`)."""
    known, live = set(state.known), set(seen.live)
    if (
        seen.triggered
        and not seen.must_check
        and now < state.next_check
        and wait_for_start(known, live, seen.starting, seen.restarts)
    ):
        # Only add-worker events woke it, and the worker is not running yet: its `worker-running` event (or
        # the next look) triggers the check that admits it; this one would find nothing new.
        state = replace(state, next_look=now + STARTING_RECHECK_SECONDS)
        return Hold(state, STARTING_RECHECK_SECONDS, "a joiner is still starting")
    # Workers that join together join as one group: hold the check while the cluster still has workers on
    # their way, for at most a liveness interval (a loss is acted on at once).
    group_since = None if not live > known else (now if state.group_since is None else state.group_since)
    loss_since = None if not known - live else (now if state.loss_since is None else state.loss_since)
    state = replace(state, group_since=group_since, loss_since=loss_since)
    lost_for = now - (loss_since or now)
    alive: frozenset[str] = frozenset()
    if loss_since is not None and lost_for < LOSS_GROUP_SECONDS:
        # (Only while a loss waits: each member still listed is asked, about a millisecond.)
        if seen.answering is None:
            return AskMembers(state, frozenset(known & live), LOSS_GROUP_SECONDS - lost_for)
        alive = seen.answering
    if wait_for_losses(known, live, lost_for, LOSS_GROUP_SECONDS, alive):
        return Hold(state, LOSS_GROUP_SECONDS / 5, "a member may be leaving too", check_soon=True)
    waited = 0.0 if group_since is None else now - group_since
    on_the_way = seen.pending + int(seen.starting)  # not registered yet, or not running yet
    if wait_for_group(known, live, on_the_way, waited, liveness_interval):
        state = replace(state, next_look=now + STARTING_RECHECK_SECONDS)
        return Hold(state, STARTING_RECHECK_SECONDS, "more joiners are on their way")
    state = replace(state, known=tuple(seen.live), group_since=None, loss_since=None)
    return Check(state, tuple(seen.live), "worker event" if seen.triggered else "interval")


def checked(state: MembershipState, now: float, starting: bool, liveness_interval: float) -> MembershipState:
    """The timers after a survival check ended at `now`."""
    following = now + (STARTING_RECHECK_SECONDS if starting else MEMBERSHIP_POLL_SECONDS)
    return replace(state, next_check=now + liveness_interval, next_look=following)


def wait_for_group(
    known: frozenset[str] | set[str],
    live: frozenset[str] | set[str],
    pending: int,
    waited: float,
    limit: float,
) -> bool:
    """Whether to hold a membership check back so that workers joining together join as one group (seed
    001's node groups: `cluster.scale(+4)`, a SLURM job array): only when the change is joins alone (a
    loss is acted on at once), the cluster still has `pending` workers it started that have not
    registered yet, and the first of these joins has waited less than `limit` seconds (one liveness
    interval)."""
    joins_only = set(live) > set(known)
    return joins_only and pending > 0 and waited < limit


def wait_for_start(known: Collection[str], live: Collection[str], starting: bool, restarts: bool) -> bool:
    """Whether a check that a worker event triggered can wait for a worker that is still starting: a
    worker registers while "init", so the check its add-worker event triggers would find the membership
    unchanged (and at most take a snapshot) while the worker turns "running" a few milliseconds later.
    Only when nothing else changed: no member lost or joined, no member's compute loop to start over. The
    worker's turn to "running" (`cluster.plugins.AnnounceRunning`) triggers the check that admits it."""
    return starting and set(live) == set(known) and not restarts


def wait_for_losses(
    known: frozenset[str] | set[str],
    live: frozenset[str] | set[str],
    waited: float,
    window: float,
    answering: frozenset[str] | set[str] = frozenset(),
) -> bool:
    """Whether to hold a membership check back so that workers lost together (a rack, a SLURM job array
    ending, `cluster.scale(-4)`) leave as one group: when the change includes a loss first seen less than
    `window` seconds ago, and some member still listed is not known to be alive. The scheduler removes
    workers killed at once a few milliseconds apart (5 to 35 ms here); without the wait each would make a
    generation of its own (and under `rollback`, a rollback each).

    `answering`: the members whose worker answered a connection's handshake just now
    (`cluster.workers.answering`). A process killed with the lost ones answers nothing (its kernel may still
    accept the connection until its memory is torn down, which is also when the scheduler notices); when
    every member still listed answers, none is on its way out and the check goes on at once. The wait is
    on every recovery's path (the survivors' new roles go out after it), so it is paid only when a member
    may be leaving."""
    if not set(known) - set(live) or waited >= window:
        return False
    return not (set(known) & set(live)) <= set(answering)


@dataclass(frozen=True)
class RebuildCoordinator:
    """The coordinator's static worker is gone: rebuild it elsewhere."""

    reason: str


@dataclass(frozen=True)
class Promote:
    """Data servers `indices` are lost: their roles go to standbys (`Promotions.promote`)."""

    indices: tuple[int, ...]


RoleChange = RebuildCoordinator | Promote


def role_changes(
    coordinator_at: str, placement: list[str], static: Collection[str], reported: Collection[int] = ()
) -> tuple[RoleChange, ...]:
    """What the static roles need, given the live static workers `static` (the workers view's: one silent
    with no standby heard keeps its roles) and the data servers the coordinator `reported` lost (a call to
    a shard failed before its worker left the scheduler's list). A lost coordinator comes first: its
    rebuild promotes the data servers lost with it."""
    if coordinator_at not in static:
        return (RebuildCoordinator(f"its static worker {coordinator_at} left the cluster"),)
    lost = {i for i, where in enumerate(placement) if where not in static}
    lost |= {i for i in reported if 0 <= i < len(placement)}
    return (Promote(tuple(sorted(lost))),) if lost else ()


@dataclass(frozen=True)
class HandOver:
    """Hand the retiring worker's roles over (its data servers to standbys, its coordinator rebuilt), then
    retire it."""

    worker: str
    indices: tuple[int, ...]
    coordinator: bool


@dataclass(frozen=True)
class HoldRetire:
    """No standby can take the retiring worker's data servers now: asked again at the next check."""

    worker: str
    indices: tuple[int, ...]


def retire(
    worker: str, placement: list[str], coordinator_at: str, free: Collection[str]
) -> HandOver | HoldRetire:
    """A retire request for the static worker `worker` (which the scheduler refuses while it holds an
    actor), with the standbys `free` that could take a data server now."""
    indices = tuple(i for i, where in enumerate(placement) if where == worker)
    if indices and not free:
        return HoldRetire(worker, indices)
    return HandOver(worker, indices, worker == coordinator_at)
