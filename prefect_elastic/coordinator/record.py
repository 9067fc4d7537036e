"""The coordinator's record, whatever the commit bookkeeping: membership and the generation, the roles, the
ledger with its loss history, the snapshot asked for and confirmed, the events, the counters, and the
controller's copy of it all (`journal`). Pure: no actor, no clock of its own (times are passed in).

Owns what sync commits and async leases share, the ledger included: it writes the commits a `CommitBook`
(`commit_book.py`) returns (`commit`). Does not own when a step or a batch id is whole, or what a
membership change undoes: that is the book's. `state.CoordinatorState` is this record with its book; the
actor (`actor.py`) only reads and changes it through the state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ledger import Ledger
from ..messages import EventKind, Journal, MembershipEvent, Resume, Role, ShardStatus
from ..schedule import Schedule
from ..wire import ChannelAddress
from .survival import Decision, Policy, SurvivalState

if TYPE_CHECKING:  # (the spec names the commit books, which keep this record)
    from .spec import CoordinatorSpec


@dataclass(frozen=True)
class Commit:
    """What a commit book found whole (`CommitBook.absorb`): the batch ids committed as `step`, in the
    generation they were applied in, by which worker each, with their loss and when the last shard applied
    them. The record writes it in its ledger (`CoordinatorRecord.commit`); the book never does."""

    batch_ids: tuple[int, ...]
    step: int
    generation: int
    workers: Mapping[int, str]
    loss: float
    time: float
    staleness: int = 0


@dataclass(frozen=True)
class Failure:
    kind: str  # model | data | not-enough-workers | data-server-lost | stopped | internal
    message: str
    step: int | None = None
    batch_id: int | None = None


class CoordinatorRecord:
    def __init__(self, spec: CoordinatorSpec, resume: Resume | None = None) -> None:
        self.job_id = spec.job_id
        self.schedule: Schedule = spec.schedule
        self.shards = spec.shards
        self.policy: Policy = spec.policy
        self.min_workers = spec.min_workers
        self.min_workers_timeout = spec.min_workers_timeout
        self.ledger = Ledger()
        self.generation = 0
        self.members: tuple[str, ...] = ()
        self.suspended = True  # nothing is handed out until the first survival check has seen workers
        self.waiting = False
        self.below_min_since: float | None = None
        self.history: list[float] = []
        self.commit_times: list[float] = []  # parallel to history; steps resumed from a checkpoint get nan
        if resume is not None:
            self.ledger.restore(resume.ledger, resume.committed_steps)
            self.generation = resume.generation
            self.history = list(resume.history)
            self.commit_times = [math.nan] * len(self.history)
        self.events: list[MembershipEvent] = []
        self.failure: Failure | None = None
        self.versions: dict[int, int] = {}  # shard -> version it last reported
        # shard -> version -> (when taken, seconds its copy took, when whole on the peer or 0)
        self.snapshots_held: dict[int, dict[int, tuple[float, float, float]]] = {}
        self.snapshot_wanted: int | None = None  # the version every shard was asked to snapshot
        self._refused: dict[int, int] = {}
        # Where each shard listens for compute loops; handed out with every role (a promoted shard moves).
        self.channels: tuple[ChannelAddress, ...] = ()
        # Data servers lost with their static worker and not replaced yet: training is suspended, and
        # nothing is decided about membership, until a standby takes each role (`promote_shard`).
        self.lost: set[int] = set()
        self.counters = {
            "rollbacks": 0,
            "reassigns": 0,
            "snapshots": 0,
            "inconsistent_fences": 0,  # membership changes that found the shards at two versions
            "steps_back": 0,  # of those, the ones where the shards ahead stepped back (no restore)
            "promotions": 0,  # data servers that a standby static worker took over
            "coordinator_rebuilds": 0,  # coordinators rebuilt on another static worker (`rebuild`)
            "checkpoint_restores": 0,  # every shard back to a checkpoint: data servers lost with replicas
            "excluded": 0,  # compute workers excluded after their model failed (`model_failed`)
        }
        # The lowest the ledger stood at since the controller last took a part of the journal: a rollback
        # since then replaced the steps after its snapshot, which the next part sends again.
        self._journaled = self.ledger.committed_steps
        # The steps the controller's copy of the record surely holds, right as they stand (`journal`): a
        # rebuilt coordinator takes them from there, so a shard need not keep their records
        # (`records_kept_from`). 0 until the controller tells what it holds.
        self.copied = 0

    # -- where the job is ------------------------------------------------------------------------

    @property
    def committed_steps(self) -> int:
        return self.ledger.committed_steps

    @property
    def finished(self) -> bool:
        return self.failure is not None or self.ledger.committed_steps >= self.schedule.total_steps

    @property
    def refused(self) -> int:
        return sum(self._refused.values())

    def survival_state(self) -> SurvivalState:
        return SurvivalState(
            generation=self.generation,
            workers=frozenset(self.members),
            policy=self.policy,
            min_workers=self.min_workers,
            min_workers_timeout=self.min_workers_timeout,
            committed_steps=self.ledger.committed_steps,
            snapshot_step=self.ledger.snapshot_step,
            below_min_since=self.below_min_since,
        )

    def role(self, worker: str, generation: int) -> Role | None:
        """The role of `worker` in the current generation, if it needs one (it knows `generation`)."""
        if self.finished:
            return Role(self.generation, -1, (), self.ledger.committed_steps, stop=True)
        if self.suspended or self.lost or worker not in self.members or generation == self.generation:
            return None
        return Role(
            self.generation,
            self.members.index(worker),
            self.members,
            self.ledger.committed_steps,
            channels=self.channels,
        )

    @property
    def handing_out(self) -> bool:
        """Whether members hold work now: the job runs, no shard is lost, and it has members."""
        return not (self.finished or self.suspended or self.lost or not self.members)

    # -- what the shards report ------------------------------------------------------------------

    def note(self, status: ShardStatus) -> None:
        """What every status says whatever the bookkeeping: the shard's version, the messages it refused
        as stale, the snapshots it holds."""
        i = status.index
        self.versions[i] = status.version
        self._refused[i] = status.refused
        self.snapshots_held[i] = {s.version: (s.time, s.seconds, s.replicated) for s in status.snapshots}

    def commit(self, commits: Iterable[Commit]) -> list[MembershipEvent]:
        """Write what a commit book found whole in the ledger, in order; returns the event of the job's end
        if the last step is among them."""
        events: list[MembershipEvent] = []
        for c in commits:
            self.ledger.commit(c.batch_ids, c.step, c.generation, dict(c.workers), staleness=c.staleness)
            self.history.append(c.loss)
            self.commit_times.append(c.time)
            if self.finished:
                events.append(self.record(EventKind.DONE, now=c.time))
        return events

    def back_to_snapshot(self) -> int:
        """Drop the steps committed after the last snapshot (every shard was restored to it); returns how
        many."""
        before = self.ledger.committed_steps
        self.ledger.drop_after_snapshot()
        self._journaled = min(self._journaled, self.ledger.committed_steps)
        self.copied = min(self.copied, self.ledger.committed_steps)
        del self.history[self.ledger.committed_steps :]
        del self.commit_times[self.ledger.committed_steps :]
        self.versions = dict.fromkeys(range(self.shards), self.ledger.committed_steps)
        return before - self.ledger.committed_steps

    # -- decisions carried out -------------------------------------------------------------------

    def after_decision(self, decision: Decision, now: float, began: float) -> list[MembershipEvent]:
        """What every decision ends with: the waiting state, the failure when the wait ran out."""
        events: list[MembershipEvent] = []
        self.members = tuple(sorted(decision.workers))
        self.generation = decision.generation
        was_waiting, self.waiting = self.waiting, not decision.resume
        self.below_min_since = decision.below_min_since
        self.suspended = not decision.resume
        if self.waiting and not was_waiting:
            events.append(
                self.record(EventKind.WAITING, reason=decision.reason, now=now, seconds=now - began)
            )
        if decision.failure is not None:
            events += self.fail(
                Failure("not-enough-workers", decision.failure, self.ledger.committed_steps), now
            )
        return events

    def fail(self, failure: Failure, now: float) -> list[MembershipEvent]:
        if self.failure is not None:
            return []
        self.failure = failure
        return [self.record(EventKind.FAILED, reason=failure.message, now=now)]

    def record(
        self,
        kind: EventKind,
        *,
        joined: frozenset[str] = frozenset(),
        left: frozenset[str] = frozenset(),
        steps_lost: int = 0,
        batches_dropped: int = 0,
        reason: str = "",
        now: float,
        seconds: float = 0.0,
        step: int | None = None,
    ) -> MembershipEvent:
        event = MembershipEvent(
            time=now,
            kind=kind,
            generation=self.generation,
            step=self.ledger.committed_steps if step is None else step,
            workers=tuple(sorted(self.members)),
            joined=tuple(sorted(joined)),
            left=tuple(sorted(left)),
            steps_lost=steps_lost,
            batches_dropped=batches_dropped,
            reason=reason,
            seconds=seconds,
        )
        self.events.append(event)
        return event

    # -- the controller's copy of the record, and a coordinator rebuilt from it --------------------

    def journal(self, known_steps: int, known_events: int) -> Journal:
        """The part of the record that a copy holding `known_steps` steps and `known_events` events
        lacks: from the lower of that and where the ledger went back to since the last part."""
        base = min(known_steps, self._journaled, self.ledger.committed_steps)
        first_event = min(known_events, len(self.events))
        # What the copy holds that still stands (the steps since the lowest point the ledger went back to
        # are sent again): surely held, as the caller said so.
        self.copied = base
        self._journaled = self.ledger.committed_steps
        return Journal(
            generation=self.generation,
            committed_steps=self.ledger.committed_steps,
            entries=self.ledger.entries_from(base),
            history=self.history[base:],
            commit_times=self.commit_times[base:],
            events=self.events[first_event:],
            counters=dict(self.counters),
            base_step=base,
            base_event=first_event,
            snapshot_step=self.ledger.snapshot_step,
        )

    def take_over(self, journal: Journal, fenced: list[ShardStatus], lost: set[int], generation: int) -> None:
        """A rebuilt coordinator takes the copy's events and counters, the fenced shards' versions, and
        waits in `generation` for the next survival check to admit members; the controller's copy is
        taken from the start again."""
        self.generation = generation
        self.members = ()
        self.suspended = True
        self.lost = lost
        self.versions = {s.index: s.version for s in fenced}
        self.events = list(journal.events)
        self.counters = {**self.counters, **journal.counters}
        self._journaled = 0
        self.copied = 0
