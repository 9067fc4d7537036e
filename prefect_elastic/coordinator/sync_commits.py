"""Sync commits: a step commits in the ledger once every shard has applied it, all its micro-batches
together; the shards stand at one version between steps (at most one step apart mid-step), so one version
is snapshotted for all, and a membership change may roll every shard back to it.

Bringing the shards back to one version when the membership changes (`reconcile`): a worker can die between
its push to one shard and to the next, so one shard may have applied a step that another never will.
Shards are at most one version apart (a gradient of step s+1 needs the parameters of step s+1 from every
shard), and when they disagree every shard goes back to the last snapshot; see
docs/design/commit-point.md.
"""

from __future__ import annotations

from ..errors import FatalError
from ..messages import EventKind, Journal, MembershipEvent, Resume, ShardStatus, StepRecord
from .commit_book import (
    Promoted,
    PromotionPlan,
    Reconciliation,
    SnapshotAt,
    SnapshotCommitted,
    SnapshotWhereFenced,
)
from .pacing import read_interval
from .rebuild import rebuild_at_one_version
from .record import Commit, CoordinatorRecord
from .survival import Action, Decision


class SyncCommits:
    """The `CommitBook` of a sync job."""

    mode = "sync"

    def __init__(self, state: CoordinatorRecord, resume: Resume | None, snapshot_every: int) -> None:
        # (`resume` and `snapshot_every` are the record's and the checkpoints' here: a sync snapshot is
        # taken at every survival check that saw progress.)
        self.state = state
        # shard -> step -> its record of a step applied and not committed yet
        self._records: dict[int, dict[int, StepRecord]] = {i: {} for i in range(state.shards)}

    # -- where the job is ----------------------------------------------------------------------------

    def holding(self) -> tuple[tuple[str, int], ...]:
        state = self.state
        step, size = state.committed_steps, len(state.members)
        return tuple(
            (w, n)
            for rank, w in enumerate(state.members)
            if (n := len(state.schedule.share(step, rank, size)))
        )

    def since(self) -> int:
        """Every step not committed yet."""
        return self.state.committed_steps

    def records_kept_from(self) -> int:
        """A shard holds one record per step it applied, which over a long run would grow without bound (a
        million steps: on the order of a gigabyte per data server): the records of the steps the
        controller's copy holds (`copied`) go."""
        return self.state.copied

    def read_interval(self, quick: float, steady: float) -> float:
        state = self.state
        if state.finished:
            return quick
        remaining = state.schedule.total_steps - state.committed_steps
        return read_interval(state.commit_times, remaining, quick, steady)

    def lease(self, worker: str, generation: int, count: int, renew: bool) -> list[int] | None:
        raise FatalError("lease: work is leased in async mode only")

    # -- what the shards report ----------------------------------------------------------------------

    def absorb(self, status: ShardStatus) -> tuple[Commit, ...]:
        for record in status.records:
            if record.step >= self.state.committed_steps:
                self._records[status.index][record.step] = record
        return self._whole()

    def _whole(self) -> tuple[Commit, ...]:
        """Every step, from the first not committed, that every shard has applied."""
        state = self.state
        whole: list[Commit] = []
        step = state.committed_steps
        while state.failure is None and step < state.schedule.total_steps:
            records = [self._records[i].get(step) for i in range(state.shards)]
            if any(r is None for r in records):
                break
            applied = [r for r in records if r is not None]
            first = applied[0]
            if any(r.batch_ids != first.batch_ids for r in applied):
                raise FatalError(f"shards applied step {step} from different batch ids: a bug")
            loss = sum(first.losses[b] for b in first.batch_ids) / len(first.batch_ids)
            whole.append(
                Commit(
                    first.batch_ids, step, first.generation, first.workers, loss, max(r.time for r in applied)
                )
            )
            for i in range(state.shards):
                del self._records[i][step]
            step += 1
        return tuple(whole)

    def forget_open(self) -> None:
        # After a fence, what shards applied of the open step is void.
        for records in self._records.values():
            records.clear()

    # -- snapshots -----------------------------------------------------------------------------------

    @property
    def snapshot_versions(self) -> tuple[int, ...]:
        return ()

    def want_snapshot(self, progressed: bool) -> int | None:
        """The version to ask every shard to snapshot, or None when there is nothing new.

        A running job is asked one version ahead of the newest shard (the shards get there within a step,
        and none can have passed it); a job that stands still (waiting, gated, at its end) is asked the
        version it stands at. A shard already past the version does not take it: the next check asks again.
        """
        state = self.state
        newest = max(state.versions.values(), default=state.committed_steps)
        version = min(newest + 1, state.schedule.total_steps) if progressed else newest
        if version <= state.ledger.snapshot_step:
            return None
        state.snapshot_wanted = version
        return version

    def snapshot_plan(self, progressed: bool) -> SnapshotAt | SnapshotWhereFenced | None:
        version = self.want_snapshot(progressed)
        return None if version is None else SnapshotAt(version, self.state.ledger.snapshot_step)

    def snapshot_when_stopped(self) -> SnapshotCommitted | SnapshotWhereFenced:
        return SnapshotCommitted()

    def snapshot_confirmed(self, version: int) -> None:
        pass  # the ledger's snapshot step says it all

    def paused(self) -> None:
        pass  # no lease is out: the open step's micro-batches follow from the schedule

    def snapshot_where_fenced(self, versions: tuple[int, ...], now: float, seconds: float) -> MembershipEvent:
        raise FatalError("sync commits snapshot one version for every shard, never one per shard")

    def snapshot_version_of(self, index: int) -> int:
        return self.state.ledger.snapshot_step

    # -- membership changes --------------------------------------------------------------------------

    def reconcile(
        self, decision: Decision, fenced: list[ShardStatus], versions: tuple[int, ...]
    ) -> Reconciliation:
        consistent = len(set(versions)) == 1
        # (Among the shards that hold state. A stateless one may lag further: a loop reads its answer to a
        # push only before its next push, and a loop with no share of the next step pushes nothing then. Every
        # shard still holds the snapshot, which is never newer than the ledger, so a restore mends it.)
        held = [s.version for s in fenced if not s.stateless]
        if held and max(held) - min(held) > 1:
            raise FatalError(f"shards at versions {versions}: more than one step apart, which cannot happen")
        restore_to: int | None = None
        if decision.action is not Action.ROLLBACK and not consistent and held:
            # A member died between its seals to two shards (gradients in parts): where every shard
            # ahead still holds the version before whole, it steps back; nothing committed is lost. (A
            # shard that holds no state steps back by counting: it has nothing to keep.)
            low = min(held)
            if any(s.kept == low for s in fenced) and all(
                s.version == low or (s.version == low + 1 and (s.kept == low or s.stateless)) for s in fenced
            ):
                return Reconciliation(None, versions, consistent, step_back_to=low)
        if decision.action is Action.ROLLBACK or not consistent:
            restore_to = self.state.ledger.snapshot_step
            if set(versions) == {restore_to}:
                restore_to = None  # nothing to undo
        return Reconciliation(restore_to, versions, consistent)

    def membership_changing(
        self, decision: Decision, was_running: bool, open_step: int
    ) -> tuple[Decision, int]:
        # The open step's micro-batches are trained again by the new members, from the start: every
        # member held a share of it, and whatever gradients reached the shards were dropped by the fence.
        if was_running and open_step < self.state.schedule.total_steps:
            return decision, len(self.state.schedule.step_batches(open_step))
        return decision, 0

    def shard_lost(self) -> int:
        state = self.state
        if not state.suspended and state.members and state.committed_steps < state.schedule.total_steps:
            return len(state.schedule.step_batches(state.committed_steps))
        return 0

    def promotion(self) -> PromotionPlan:
        return PromotionPlan(restore_to=self.state.ledger.snapshot_step, asks_applied=False)

    def shard_promoted(self, index: int, applied: frozenset[int], version: int) -> Promoted:
        steps_lost = self.state.back_to_snapshot()
        return Promoted(steps_lost, f"step {self.state.committed_steps}")

    # -- a coordinator rebuilt from the controller's copy ---------------------------------------------

    def rebuild_applied_from(self, journal: Journal) -> int | None:
        return None  # the schedule says which batch ids a step holds

    def rebuild(
        self,
        journal: Journal,
        fenced: list[ShardStatus],
        lost: set[int],
        generation: int,
        where: str,
        reason: str,
        now: float,
        began: float,
        kind: EventKind,
    ) -> MembershipEvent:
        self.forget_open()
        return rebuild_at_one_version(
            self.state, journal, fenced, lost, generation, where, reason, now, began, kind
        )
