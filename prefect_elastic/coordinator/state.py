"""The coordinator's bookkeeping as a pure state machine: what the shards report goes in, the ledger, the
roles, the snapshot requests and the events come out. No actor, no clock of its own (times are passed in),
no cluster: `tests/unit/test_coordinator_state.py` drives it through event sequences.

What it keeps, for one job: the shared record (`record.CoordinatorRecord`: membership and the generation,
the roles, the ledger, the snapshot bookkeeping, the events), the commit bookkeeping of the job's kind (a
`CommitBook`: `SyncCommits` or `AsyncLeases`, given by the caller), and the workers excluded after their
model failed (`exclusion.Exclusions`). This class takes each event in the same way for either bookkeeping
and lets the book do what differs; it never asks which book it has.

The actor (`actor.py`) makes the calls this class asks for and feeds their answers back.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import FatalError
from ..messages import EventKind, Journal, MembershipEvent, Progress, Resume, ShardStatus
from ..wire import ChannelAddress
from .commit_book import (
    CommitBook,
    PromotionPlan,
    Reconciliation,
    SnapshotAt,
    SnapshotCommitted,
    SnapshotWhereFenced,
)
from .exclusion import Exclusions
from .rebuild import check_shards
from .record import CoordinatorRecord
from .spec import CoordinatorSpec
from .survival import Action, Decision


class CoordinatorState(CoordinatorRecord):
    def __init__(self, spec: CoordinatorSpec, resume: Resume | None = None) -> None:
        super().__init__(spec, resume)
        self.commits: CommitBook = spec.commits(self, resume, spec.snapshot_every)
        self.exclusions = Exclusions()

    # -- where the job is ------------------------------------------------------------------------

    @property
    def excluded(self) -> dict[str, str]:
        """Workers excluded after their model failed (`model_failed`), with why."""
        return self.exclusions.excluded

    def holding(self) -> tuple[tuple[str, int], ...]:
        """Each member with the micro-batches of the open step in its share (async: of its lease)."""
        return self.commits.holding() if self.handing_out else ()

    def progress(self) -> Progress:
        f = self.failure
        if f is not None:
            state = "failed"
        else:
            state = "done" if self.finished else ("waiting" if self.waiting else "running")
        return Progress(
            generation=self.generation,
            committed_steps=self.ledger.committed_steps,
            total_steps=self.schedule.total_steps,
            workers=tuple(sorted(self.members)),
            state=state,
            loss=self.history[-1] if self.history else None,
            failure=f.message if f else None,
            failure_kind=f.kind if f else None,
            failure_step=f.step if f else None,
            failure_batch=f.batch_id if f else None,
            holding=self.holding(),
            lost_shards=tuple(sorted(self.lost)),
            snapshot_step=self.ledger.snapshot_step,
            mode=self.commits.mode,
            events=len(self.events),
        )

    def snapshot_record(self) -> Resume:
        step = self.ledger.snapshot_step
        return Resume(
            generation=self.generation,
            committed_steps=step,
            ledger=[e for e in self.ledger.entries() if e.step < step],
            history=self.history[:step],
            versions=self.commits.snapshot_versions,
        )

    def since(self) -> int:
        """The first record a shard's status must carry: every step not committed yet (sync), every apply
        not read yet (async, where the shards' versions differ)."""
        return self.commits.since()

    def records_kept_from(self) -> int:
        """The first step whose record a shard must keep (`CommitBook.records_kept_from`)."""
        return self.commits.records_kept_from()

    def sync_interval(self, quick: float, steady: float) -> float:
        """How long to wait before the shards' status is read again (`pacing.read_interval`)."""
        return self.commits.read_interval(quick, steady)

    def lease(self, worker: str, generation: int, count: int, renew: bool = False) -> list[int] | None:
        """Up to `count` batch ids for `worker` to train (`AsyncLeases.lease`)."""
        return self.commits.lease(worker, generation, count, renew)

    # -- snapshots -------------------------------------------------------------------------------

    def want_snapshot(self, progressed: bool) -> int | None:
        """The one version to ask every shard to snapshot, or None (`SyncCommits.want_snapshot`)."""
        return self.commits.want_snapshot(progressed)

    def snapshot_plan(self, progressed: bool) -> SnapshotAt | SnapshotWhereFenced | None:
        """The snapshot a survival check that left the membership unchanged takes, if any."""
        return self.commits.snapshot_plan(progressed)

    def snapshot_when_stopped(self) -> SnapshotCommitted | SnapshotWhereFenced:
        return self.commits.snapshot_when_stopped()

    def pause(self, generation: int) -> None:
        """Every shard was fenced into `generation` for a snapshot where each stands, with the same
        members, who get their roles of the new generation at once."""
        self.commits.paused()
        self.generation = generation

    def snapshot_async(self, versions: tuple[int, ...], now: float, seconds: float) -> MembershipEvent:
        """Every shard, fenced, took a snapshot at its own version (`AsyncLeases.snapshot_where_fenced`)."""
        return self.commits.snapshot_where_fenced(versions, now, seconds)

    def snapshot_version_of(self, index: int) -> int:
        """The version of shard `index` in the last snapshot every shard holds (async mode: its own)."""
        return self.commits.snapshot_version_of(index)

    # -- what the shards report ------------------------------------------------------------------

    def absorb(self, status: ShardStatus) -> list[MembershipEvent]:
        """Take in a shard's status: commit what every shard has applied, confirm a snapshot every shard
        holds. Returns the events recorded."""
        if status.generation < self.generation:
            return []  # an answer that crossed a fence; the fence's own answer is newer
        self.note(status)
        return self.commit(self.commits.absorb(status)) + self._confirm_snapshot()

    def _confirm_snapshot(self) -> list[MembershipEvent]:
        wanted = self.snapshot_wanted
        if wanted is None or wanted > self.ledger.committed_steps:
            return []
        taken = [self.snapshots_held.get(i, {}).get(wanted) for i in range(self.shards)]
        if any(t is None for t in taken):
            return []
        times = [t for t in taken if t is not None]
        self.ledger.mark_snapshot(wanted)
        self.commits.snapshot_confirmed(wanted)
        self.snapshot_wanted = None
        self.counters["snapshots"] += 1
        # The window in which the snapshot could slow a step: from the first copy's start to the last end,
        # its copy to the peer (sent in the background, as steps go on) included.
        began = min(t - s for t, s, _ in times)
        end = max(max(t, replicated) for t, _, replicated in times)
        # The event's step is the snapshot's own: the ledger may have committed further while the last
        # shard was copying, and a rollback goes back to `wanted`, not to where the ledger stands.
        return [
            self.record(
                EventKind.SNAPSHOT,
                reason="membership unchanged",
                now=end,
                seconds=end - began,
                step=wanted,
            )
        ]

    def _forget_open_records(self) -> None:
        # After a fence, what shards applied of the open step and any snapshot asked for are void.
        self.commits.forget_open()
        self.snapshot_wanted = None

    # -- membership changes ----------------------------------------------------------------------

    def reconcile(self, decision: Decision, fenced: list[ShardStatus]) -> Reconciliation:
        """After every shard was fenced into the decision's generation (their answers absorbed): the
        version they all go back to, if any."""
        for status in fenced:
            self.absorb(status)
        versions = tuple(s.version for s in sorted(fenced, key=lambda s: s.index))
        return self.commits.reconcile(decision, fenced, versions)

    def change_membership(
        self,
        decision: Decision,
        plan: Reconciliation,
        fenced: list[ShardStatus],
        trigger: str,
        now: float,
        began: float,
    ) -> MembershipEvent:
        """Carry out a membership change once the shards were fenced and, if asked, restored."""
        was_running = bool(self.members) and not self.suspended
        open_step = self.ledger.committed_steps
        steps_lost = self.back_to_snapshot() if plan.restore_to is not None else 0
        self._forget_open_records()
        decision, dropped = self.commits.membership_changing(decision, was_running, open_step)
        if decision.action is Action.START:
            kind = EventKind.START
        elif decision.action is Action.ROLLBACK or not plan.consistent:
            kind = EventKind.ROLLBACK if decision.action is Action.ROLLBACK else EventKind.REASSIGN
        else:
            kind = EventKind.REASSIGN
        if decision.action is Action.ROLLBACK:
            self.counters["rollbacks"] += 1
        elif decision.action is Action.REASSIGN:
            self.counters["reassigns"] += 1
        reason = f"{decision.reason} ({trigger})"
        if not plan.consistent and plan.step_back_to is not None:
            self.counters["inconsistent_fences"] += 1
            self.counters["steps_back"] += 1
            self.versions = dict.fromkeys(range(self.shards), plan.step_back_to)
            reason += (
                f"; shards were at versions {list(plan.versions)} (a worker died between its seals), "
                f"the ones ahead stepped back to step {plan.step_back_to}"
            )
        elif not plan.consistent:
            self.counters["inconsistent_fences"] += 1
            reason += (
                f"; shards were at versions {list(plan.versions)} (a worker died between its pushes), "
                f"all back to the snapshot of step {self.ledger.committed_steps}"
            )
        self.generation = decision.generation
        self.members = tuple(sorted(decision.workers))
        return self.record(
            kind,
            joined=decision.joined,
            left=decision.left,
            steps_lost=steps_lost,
            batches_dropped=dropped,
            reason=reason,
            now=now,
            seconds=now - began,
        )

    # -- a data server lost, and its role taken by a standby ---------------------------------------

    def lose_shard(self, index: int, generation: int, reason: str, now: float) -> list[MembershipEvent]:
        """Shard `index` is gone with its static worker; every other shard was fenced into `generation`.
        No role is handed out until a standby took its place; the open step's micro-batches are dropped
        (the fence dropped their gradients). Returns the event (none if it was known lost already)."""
        if index in self.lost:
            return []
        dropped = self.commits.shard_lost()
        self.lost.add(index)
        self.generation = generation
        self._forget_open_records()
        return [self.record(EventKind.SHARD_LOST, batches_dropped=dropped, reason=reason, now=now)]

    def promotion(self) -> PromotionPlan:
        """How a standby takes a lost shard's role (`CommitBook.promotion`)."""
        return self.commits.promotion()

    def promote_shard(
        self,
        index: int,
        worker: str,
        generation: int,
        channel: ChannelAddress,
        now: float,
        began: float,
        applied: frozenset[int] = frozenset(),
        version: int = 0,
        kept: bool = False,
    ) -> MembershipEvent:
        """A standby (`worker`) holds shard `index` again, taken from its peer's replica of the last
        snapshot, and every other shard was fenced into `generation` (and, with sync commits, brought back
        to that snapshot: the ledger drops the steps after it). `kept`: the data server itself, taken for
        lost while silent, answered and keeps its role on `worker` (event `kept`, not counted as a
        promotion). With async leases the promoted shard stands at `version` with the batch ids `applied`
        of its snapshot, and what it lacks is trained again (`AsyncLeases.shard_promoted`)."""
        if index not in self.lost:
            raise FatalError(f"shard {index} was promoted but was not lost")
        self.lost.discard(index)
        channels = list(self.channels)
        channels[index] = channel
        self.channels = tuple(channels)
        promoted = self.commits.shard_promoted(index, applied, version)
        self.commit(promoted.commits)  # (what the promoted shard's snapshot made whole again)
        steps_lost, where = promoted.steps_lost, promoted.where
        self._forget_open_records()
        self.generation = generation
        self.counters["promotions"] += not kept
        return self.record(
            EventKind.KEPT if kept else EventKind.PROMOTED,
            steps_lost=steps_lost,
            reason=(
                f"data server {index} on {worker} answered after its silence and keeps its role, at {where}"
                if kept
                else f"data server {index} on standby {worker}, from its peer's replica of {where}"
            ),
            now=now,
            seconds=now - began,
        )

    # -- a coordinator rebuilt from the controller's copy --------------------------------------------

    def rebuild_applied_from(self, journal: Journal) -> int | None:
        """What a rebuilt coordinator's fence asks every shard about (`CommitBook.rebuild_applied_from`)."""
        return self.commits.rebuild_applied_from(journal)

    def rebuild(
        self,
        journal: Journal,
        fenced: list[ShardStatus],
        lost: Iterable[int],
        generation: int,
        where: str,
        reason: str,
        now: float,
        began: float,
        kind: EventKind = EventKind.COORDINATOR_REBUILT,
    ) -> MembershipEvent:
        """Take over from a coordinator whose static worker died, in a state that holds nothing yet: from
        the controller's copy of its record (`journal`), and from the live shards, fenced into
        `generation` (their versions, snapshots, replicas and the records of what they applied). Shards in
        `lost` died with it (a coordinator shares its static worker with data server 0). Nothing is handed
        out until the next survival check admits the live workers (`rebuild.rebuild_at_one_version`,
        `AsyncLeases.rebuild`).

        The same rebuild (`kind` RESTORED) takes every shard back to a persistent checkpoint when data
        servers were lost with the replicas of their shards: the shards are then new, all at its step."""
        lost = set(lost)
        check_shards(self, fenced, lost)
        return self.commits.rebuild(journal, fenced, lost, generation, where, reason, now, began, kind)

    # -- the end ---------------------------------------------------------------------------------

    def model_failed(
        self, worker: str, step: int, batch_id: int | None, message: str, now: float
    ) -> list[MembershipEvent]:
        """A member's model raised (or its loss was not finite) on `batch_id`: the worker is excluded (the
        next survival check takes its share away), or the job fails (`exclusion.Exclusions`)."""
        if self.failure is not None:
            return []
        failure = self.exclusions.model_failed(worker, step, batch_id, message)
        if failure is not None:
            return self.fail(failure, now)
        event = self.record(
            EventKind.EXCLUDED,
            left=frozenset({worker}),
            reason=f"{worker} excluded: {message}",
            now=now,
        )
        self.counters["excluded"] += 1
        failure = self.exclusions.none_left(self.members, step, batch_id)
        return [event] if failure is None else [event, *self.fail(failure, now)]
