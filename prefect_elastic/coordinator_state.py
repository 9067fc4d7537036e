"""The coordinator's bookkeeping as a pure state machine: what the shards report goes in, the ledger, the
roles, the snapshot requests and the events come out. No actor, no clock of its own (times are passed in),
no cluster: `tests/test_coordinator_state.py` drives it through event sequences.

What it keeps, for one job:
- the membership of the current generation, in a fixed order: a member's position is its rank (its
  `Role`), which decides its share of every step until the next generation;
- the ledger: a step is committed when every shard has applied it (`absorb` of the shards' records);
- the snapshot bookkeeping: the version it asked every shard to snapshot, and the last version every
  shard holds (the ledger's `snapshot_step`), which is what a rollback goes back to;
- how to bring the shards back to one version when the membership changes (`reconcile`): a worker can die
  between its push to one shard and to the next, so one shard may have applied a step that another never
  will. Shards are at most one version apart (a gradient of step s+1 needs the parameters of step s+1 from
  every shard), and when they disagree every shard goes back to the last snapshot; see
  docs/design/commit-point.md.

The actor (`coordinator.py`) makes the calls this class asks for and feeds their answers back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from .channel import ChannelAddress
from .errors import DataServerLostError, FatalError
from .ledger import Ledger
from .messages import (
    EventKind,
    Journal,
    MembershipEvent,
    Progress,
    Resume,
    Role,
    ShardStatus,
    StepRecord,
)
from .schedule import Schedule
from .survival import Action, Decision, Policy, SurvivalState

# The last steps whose pace `sync_interval` takes for the pace to come.
PACE_STEPS = 20


@dataclass(frozen=True)
class Failure:
    kind: str  # model | not-enough-workers | data-server-lost | stopped | internal
    message: str
    step: int | None = None
    batch_id: int | None = None


@dataclass(frozen=True)
class Reconciliation:
    """How the shards come back to one version after a fence: restore the snapshot of `restore_to` on
    every shard (None: they already agree), and what that undoes."""

    restore_to: int | None
    versions: tuple[int, ...]
    consistent: bool  # the shards were at one version


def rebuild_applied_from(journal: Journal) -> int:
    """Async mode: the lowest batch id a rebuilt coordinator's fence asks every shard about (the ids each
    applied from there on, recorded or not: `ShardStatus.applied`). The copy's lowest open id, or lower,
    the lowest id the copy committed after its snapshot: a shard promoted after the copy was taken holds
    its snapshot alone, and its promotion retracted those commits, a change the copy never saw
    (`CoordinatorState._rebuild_async` keeps only the ones every live shard holds)."""
    after = [e.batch_id for e in journal.entries if e.step >= journal.snapshot_step]
    return min([journal.first_open_batch(), *after])


class CoordinatorState:
    def __init__(
        self,
        job_id: str,
        schedule: Schedule,
        shards: int,
        policy: Policy,
        min_workers: int,
        min_workers_timeout: float,
        resume: Resume | None = None,
        mode: str = "sync",
        snapshot_every: int = 0,
    ) -> None:
        self.job_id = job_id
        # Async mode: snapshot (a brief pause of every shard) every this many survival checks that saw
        # progress; 0: only when the run stops or ends. (Set where the job writes checkpoints.)
        self.snapshot_every = snapshot_every
        self._checks_since_snapshot = 0
        # Async mode (seed 002): the schedule has one batch id per step; a step is committed in the ledger
        # when every shard applied its batch id, in whatever order; work goes out in leases (`lease`).
        self.mode = mode
        self.schedule = schedule
        self.shards = shards
        self.policy: Policy = policy
        self.min_workers = min_workers
        self.min_workers_timeout = min_workers_timeout
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
        self._records: dict[int, dict[int, StepRecord]] = {i: {} for i in range(shards)}
        # shard -> version -> (when taken, seconds its copy took, when whole on the peer or 0)
        self._snapshots: dict[int, dict[int, tuple[float, float, float]]] = {}
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
        # Async mode: batch ids nobody holds (lowest first), the ones each member holds, what each shard
        # applied of batch ids not yet committed, and the next record of each shard not yet read.
        # Workers excluded after their model failed on a batch (`model_failed`), with why, and the workers
        # each batch id failed on.
        self.excluded: dict[str, str] = {}
        self._model_failures: dict[int, dict[str, str]] = {}
        self._queue: list[int] = []
        self._leases: dict[str, list[int]] = {}
        self._applied: dict[int, dict[int, StepRecord]] = {}
        self._seen: dict[int, int] = dict.fromkeys(range(shards), 0)
        # Async mode: each shard's version in the last snapshot (`snapshot_async`), for a checkpoint.
        self.snapshot_versions: tuple[int, ...] = ()
        if mode == "async":
            self._queue = [b for b in range(schedule.total_batches) if b not in self.ledger]
            for i, ids in enumerate(resume.applied if resume is not None else ()):
                for b in ids:
                    if b not in self.ledger:
                        # Applied by this shard before the checkpoint, not by every shard: it commits
                        # once the others apply it (this shard answers "duplicate" then).
                        self._applied.setdefault(b, {})[i] = StepRecord(
                            -1, self.generation, (b,), {b: ""}, {b: math.nan}, math.nan
                        )
            if resume is not None:
                self.snapshot_versions = resume.versions

    # -- where the job is ------------------------------------------------------------------------

    @property
    def committed_steps(self) -> int:
        return self.ledger.committed_steps

    @property
    def finished(self) -> bool:
        return self.failure is not None or self.ledger.committed_steps >= self.schedule.total_steps

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

    def holding(self) -> tuple[tuple[str, int], ...]:
        """Each member with the micro-batches of the open step in its share (async mode: of its lease)."""
        if self.finished or self.suspended or self.lost or not self.members:
            return ()
        if self.mode == "async":
            return tuple((w, len(ids)) for w in self.members if (ids := self._leases.get(w)))
        step, size = self.ledger.committed_steps, len(self.members)
        return tuple(
            (w, n) for rank, w in enumerate(self.members) if (n := len(self.schedule.share(step, rank, size)))
        )

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
            mode=self.mode,
            events=len(self.events),
        )

    def snapshot_record(self) -> Resume:
        step = self.ledger.snapshot_step
        return Resume(
            generation=self.generation,
            committed_steps=step,
            ledger=[e for e in self.ledger.entries() if e.step < step],
            history=self.history[:step],
            versions=self.snapshot_versions,
        )

    def async_snapshot_due(self) -> bool:
        """Async mode: whether this survival check (which saw progress) takes a snapshot."""
        if not self.snapshot_every:
            return False
        self._checks_since_snapshot += 1
        if self._checks_since_snapshot < self.snapshot_every:
            return False
        self._checks_since_snapshot = 0
        return True

    def pause(self, generation: int) -> None:
        """Async mode: every shard was fenced into `generation` for a snapshot, with the same members; the
        leases go back to the queue and the members get their roles of the new generation at once."""
        self._return_leases()
        self.generation = generation

    def snapshot_async(self, versions: tuple[int, ...], now: float, seconds: float) -> MembershipEvent:
        """Async mode: every shard was fenced (nothing is applied any more) and took a snapshot at its own
        version, `versions`; every batch id in the ledger is in them (it was applied by every shard before
        the fence). That is the snapshot a checkpoint writes, with each shard's applied batch ids."""
        self.ledger.mark_snapshot(self.ledger.committed_steps)
        self.snapshot_versions = versions
        self.counters["snapshots"] += 1
        return self.record(
            EventKind.SNAPSHOT,
            reason=f"async: every shard fenced, at versions {list(versions)}",
            now=now,
            seconds=seconds,
        )

    @property
    def refused(self) -> int:
        return sum(self._refused.values())

    def since(self) -> int:
        """The first record a shard's status must carry: every step not committed yet (sync), every apply
        not read yet (async, where the shards' versions differ)."""
        if self.mode == "async":
            return min(self._seen.values(), default=0)
        return self.ledger.committed_steps

    def records_kept_from(self) -> int:
        """The first step whose record a shard must keep: a shard holds one per step it applied, which
        over a long run would grow without bound (a million steps: on the order of a gigabyte per data
        server). The records of steps the controller's copy holds (`copied`) go; so does nothing in async
        mode, whose records are of batch ids (not bounded yet)."""
        return 0 if self.mode == "async" else self.copied

    def sync_interval(self, quick: float, steady: float) -> float:
        """How long to wait before the shards' status is read again: `steady` while a sync job runs far
        from its end, else `quick`: in async mode (re-queued batch ids wait on the read), before the pace
        of steps is known, and where the job may end within two steady waits at the pace of its last
        steps (its end is then seen at once, not up to `steady` late)."""
        if self.mode == "async" or self.finished:
            return quick
        times = [t for t in self.commit_times[-PACE_STEPS:] if not math.isnan(t)]
        if len(times) < 2 or times[-1] <= times[0]:
            return quick
        step_seconds = (times[-1] - times[0]) / (len(times) - 1)
        remaining = self.schedule.total_steps - self.ledger.committed_steps
        return steady if remaining * step_seconds > 2 * steady else quick

    # -- async mode: leases --------------------------------------------------------------------------

    def lease(self, worker: str, generation: int, count: int, renew: bool = False) -> list[int] | None:
        """Up to `count` batch ids for `worker` to train (async mode), lowest first; `[]` when none is
        free (the last ones are held by workers); None when the worker has no role in `generation` or the
        job is over (it asks for its role again, which says so). A member's lease goes back to the queue
        when the membership changes; `renew`: the worker's loop started over within the generation (after
        an error), so what it held before goes back now."""
        if self.mode != "async":
            raise FatalError("lease: work is leased in async mode only")
        if self.finished or self.suspended or self.lost or worker not in self.members:
            return None
        if generation != self.generation:
            return None
        if renew:
            back = [b for b in self._leases.pop(worker, []) if b not in self.ledger]
            self._queue = sorted({*self._queue, *back})
        # (A batch id returned by a membership change may have been committed since: its last shard's
        # apply was already under way when the fence came.)
        self._queue = [b for b in self._queue if b not in self.ledger]
        given, self._queue = self._queue[:count], self._queue[count:]
        self._leases.setdefault(worker, []).extend(given)
        return given

    def _return_leases(self) -> int:
        """Every lease back to the queue (a new generation); returns how many batch ids that is."""
        back = [b for ids in self._leases.values() for b in ids if b not in self.ledger]
        self._leases.clear()
        self._queue = sorted({*self._queue, *back})
        return len(back)

    def _absorb_async(self, i: int, status: ShardStatus) -> list[MembershipEvent]:
        for record in status.records:
            if record.step < self._seen[i]:
                continue
            self._seen[i] = record.step + 1
            for b in record.batch_ids:
                if b not in self.ledger:
                    self._applied.setdefault(b, {})[i] = record
        return self._commit_applied()

    def _commit_applied(self) -> list[MembershipEvent]:
        """Async mode: commit every batch id that every shard has applied, lowest first."""
        events: list[MembershipEvent] = []
        ready = sorted(b for b, by_shard in self._applied.items() if len(by_shard) == self.shards)
        for b in ready:
            records = list(self._applied.pop(b).values())
            # (The records of this run first: a record of a checkpoint's apply has no loss or worker.)
            records.sort(key=lambda r: r.step < 0)
            worker = records[0].workers.get(b, "")
            self.ledger.commit(
                [b], self.ledger.committed_steps, max(r.generation for r in records), {b: worker},
                staleness=max(r.staleness for r in records),
            )  # fmt: skip
            self.history.append(records[0].losses[b])
            self.commit_times.append(max((r.time for r in records if r.step >= 0), default=math.nan))
            for ids in self._leases.values():
                if b in ids:
                    ids.remove(b)
            if self.finished:
                events.append(self.record(EventKind.DONE, now=self.commit_times[-1]))
        return events

    def _rejoin_async(self, index: int, applied: frozenset[int], version: int) -> int:
        """Async mode: shard `index` came back on a standby from its peer's replica of its last snapshot,
        at `version`, holding the applies `applied`; whatever it applied after that is gone. Nothing is
        rolled back on the other shards. A committed batch id it lacks leaves the ledger again (the ledger
        drops every commit after the last snapshot as one; those the shard holds commit again at once)
        and goes back to the queue, to be trained again and applied there alone: the other shards answer
        "duplicate". Returns how many batch ids left the ledger."""
        first = self.ledger.snapshot_step
        retracted = self.ledger.entries_from(first)
        losses, times = self.history[first:], self.commit_times[first:]
        self._back_to_snapshot()
        for entry, loss, when in zip(retracted, losses, times, strict=True):
            b = entry.batch_id
            record = StepRecord(
                entry.step, entry.generation, (b,), {b: entry.worker}, {b: loss}, when, -1, entry.staleness
            )
            for j in range(self.shards):
                if j != index or b in applied:
                    self._applied.setdefault(b, {})[j] = record
        for b, by_shard in list(self._applied.items()):
            if index in by_shard and b not in applied:
                del by_shard[index]  # applied there after the snapshot: lost with the worker
            if not by_shard:
                del self._applied[b]
        # (Known already, unless the shard's status was not read since: then as a checkpoint's.)
        self._applied_unrecorded(index, applied)
        self._seen[index] = version  # its records start again from there
        self._commit_applied()
        back = [e.batch_id for e in retracted if e.batch_id not in self.ledger]
        self._queue = sorted({*self._queue, *back})
        return len(back)

    def _applied_unrecorded(self, index: int, ids: Iterable[int]) -> None:
        """Async mode: shard `index` holds the applies of `ids`, with no record of them where it has
        none (they came with a snapshot's replica): kept as a checkpoint's apply (no loss, no worker)."""
        for b in ids:
            if b not in self.ledger:
                self._applied.setdefault(b, {}).setdefault(
                    index, StepRecord(-1, self.generation, (b,), {b: ""}, {b: math.nan}, math.nan)
                )

    # -- what the shards report ------------------------------------------------------------------

    def absorb(self, status: ShardStatus) -> list[MembershipEvent]:
        """Take in a shard's status: commit the steps every shard has applied, confirm a snapshot every
        shard holds. Returns the events recorded."""
        if status.generation < self.generation:
            return []  # an answer that crossed a fence; the fence's own answer is newer
        i = status.index
        self.versions[i] = status.version
        self._refused[i] = status.refused
        self._snapshots[i] = {s.version: (s.time, s.seconds, s.replicated) for s in status.snapshots}
        if self.mode == "async":
            # (The only snapshot in async mode is the last: every shard applied every batch id.)
            return self._absorb_async(i, status) + self._confirm_snapshot()
        for record in status.records:
            if record.step >= self.ledger.committed_steps:
                self._records[i][record.step] = record
        events = self._commit_ready()
        events += self._confirm_snapshot()
        return events

    def _commit_ready(self) -> list[MembershipEvent]:
        events: list[MembershipEvent] = []
        while not self.finished:
            step = self.ledger.committed_steps
            records = [self._records[i].get(step) for i in range(self.shards)]
            if any(r is None for r in records):
                break
            applied = [r for r in records if r is not None]
            first = applied[0]
            if any(r.batch_ids != first.batch_ids for r in applied):
                raise FatalError(f"shards applied step {step} from different batch ids: a bug")
            self.ledger.commit(first.batch_ids, step, first.generation, first.workers)
            self.history.append(sum(first.losses[b] for b in first.batch_ids) / len(first.batch_ids))
            self.commit_times.append(max(r.time for r in applied))
            for i in range(self.shards):
                del self._records[i][step]
            if self.finished:
                events.append(self.record(EventKind.DONE, now=self.commit_times[-1]))
        return events

    def _confirm_snapshot(self) -> list[MembershipEvent]:
        wanted = self.snapshot_wanted
        if wanted is None or wanted > self.ledger.committed_steps:
            return []
        taken = [self._snapshots.get(i, {}).get(wanted) for i in range(self.shards)]
        if any(t is None for t in taken):
            return []
        times = [t for t in taken if t is not None]
        self.ledger.mark_snapshot(wanted)
        if self.mode == "async":
            # (The end of an async run: every shard applied every batch id, one version everywhere.)
            self.snapshot_versions = (wanted,) * self.shards
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

    def want_snapshot(self, progressed: bool) -> int | None:
        """The version to ask every shard to snapshot, or None when there is nothing new.

        A running job is asked one version ahead of the newest shard (the shards get there within a step,
        and none can have passed it); a job that stands still (waiting, gated, at its end) is asked the
        version it stands at. A shard already past the version does not take it: the next check asks again.
        """
        if self.mode == "async":
            # The shards stand at different versions, each having applied its own set of batch ids: there
            # is no one version to snapshot mid-run (docs/design/async.md). A membership change needs no
            # snapshot in async mode, since nothing is rolled back.
            return None
        newest = max(self.versions.values(), default=self.ledger.committed_steps)
        version = min(newest + 1, self.schedule.total_steps) if progressed else newest
        if version <= self.ledger.snapshot_step:
            return None
        self.snapshot_wanted = version
        return version

    # -- membership changes ----------------------------------------------------------------------

    def reconcile(self, decision: Decision, fenced: list[ShardStatus]) -> Reconciliation:
        """After every shard was fenced into the decision's generation (their answers absorbed): the
        version they all go back to, if any."""
        for status in fenced:
            self.absorb(status)
        versions = tuple(s.version for s in sorted(fenced, key=lambda s: s.index))
        if self.mode == "async":
            # Shards apply gradients as they come, so their versions differ; a batch id applied by some
            # shards only goes back to the queue and the others apply it when it is trained again (a shard
            # applies a batch id once). Nothing is undone.
            return Reconciliation(None, versions, True)
        consistent = len(set(versions)) == 1
        # (Among the shards that hold state. A stateless one may lag further: a loop reads its answer to a
        # push only before its next push, and a loop with no share of the next step pushes nothing then. Every
        # shard still holds the snapshot, which is never newer than the ledger, so a restore mends it.)
        held = [s.version for s in fenced if not s.stateless]
        if held and max(held) - min(held) > 1:
            raise FatalError(f"shards at versions {versions}: more than one step apart, which cannot happen")
        restore_to: int | None = None
        if decision.action is Action.ROLLBACK or not consistent:
            restore_to = self.ledger.snapshot_step
            if set(versions) == {restore_to}:
                restore_to = None  # nothing to undo
        return Reconciliation(restore_to, versions, consistent)

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
        steps_lost = self._back_to_snapshot() if plan.restore_to is not None else 0
        self._forget_open_records()
        # The open step's micro-batches are trained again by the new members, from the start: every
        # member held a share of it, and whatever gradients reached the shards were dropped by the fence.
        dropped = 0
        if self.mode == "async":
            dropped = self._return_leases()
            if decision.action is Action.ROLLBACK:
                decision = replace(decision, action=Action.REASSIGN)  # async mode never rolls back
        elif was_running and open_step < self.schedule.total_steps:
            dropped = len(self.schedule.step_batches(open_step))
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
        if not plan.consistent:
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

    def _back_to_snapshot(self) -> int:
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

    def _forget_open_records(self) -> None:
        # After a fence, what shards applied of the open step and any snapshot asked for are void.
        for records in self._records.values():
            records.clear()
        self.snapshot_wanted = None

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

    # -- a data server lost, and its role taken by a standby (seed 001) -----------------------------

    def lose_shard(self, index: int, generation: int, reason: str, now: float) -> list[MembershipEvent]:
        """Shard `index` is gone with its static worker; every other shard was fenced into `generation`.
        No role is handed out until a standby took its place; the open step's micro-batches are dropped
        (the fence dropped their gradients). Returns the event (none if it was known lost already)."""
        if index in self.lost:
            return []
        dropped = 0
        if self.mode == "async":
            self._return_leases()  # (the fence dropped nothing: applies are whole or not made)
        elif not self.suspended and self.members and self.ledger.committed_steps < self.schedule.total_steps:
            dropped = len(self.schedule.step_batches(self.ledger.committed_steps))
        self.lost.add(index)
        self.generation = generation
        self._forget_open_records()
        return [self.record(EventKind.SHARD_LOST, batches_dropped=dropped, reason=reason, now=now)]

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
        snapshot every shard holds, and every other shard was fenced into `generation` and brought back to
        that snapshot: the ledger drops the steps after it, and training goes on from there. `kept`: the
        data server itself, taken for lost while silent, answered and keeps its role on `worker` (event
        `kept`, not counted as a promotion).

        Async mode: the other shards stay where they are; the promoted one stands at `version` with the
        batch ids `applied` of its snapshot, and what it lacks is trained again (`_rejoin_async`)."""
        if index not in self.lost:
            raise FatalError(f"shard {index} was promoted but was not lost")
        self.lost.discard(index)
        channels = list(self.channels)
        channels[index] = channel
        self.channels = tuple(channels)
        if self.mode == "async":
            steps_lost = self._rejoin_async(index, applied, version)
            where = f"version {version}"
        else:
            steps_lost = self._back_to_snapshot()
            where = f"step {self.ledger.committed_steps}"
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

    def snapshot_version_of(self, index: int) -> int:
        """The version of shard `index` in the last snapshot every shard holds (async mode: its own)."""
        if self.mode == "async":
            return self.snapshot_versions[index] if self.snapshot_versions else 0
        return self.ledger.snapshot_step

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
        `generation` (their versions, snapshots, replicas and the records of the steps they applied).
        Shards in `lost` died with it (a coordinator shares its static worker with data server 0).

        The ledger is what every shard applied, as the old coordinator would have had it: the copy's steps
        up to that version, then the shards' records of the steps after (in sync mode the batch ids of a
        step follow from the schedule, which fills in a record no live shard holds). The snapshot a
        rollback or a promotion goes back to is the newest that every live shard holds, and that each lost
        shard's peer holds a replica of; with a shard lost, the ledger stands there, for the promotion.
        Nothing is handed out until the next survival check admits the live workers (in a new generation,
        which brings the shards to one version if they are not).

        The same rebuild (`kind` RESTORED) takes every shard back to a persistent checkpoint when data
        servers were lost with the replicas of their shards: the shards are then new, all at its step."""
        lost = set(lost)
        live = {s.index: s for s in fenced}
        if set(live) | lost != set(range(self.shards)) or set(live) & lost:
            raise FatalError(f"rebuild: shards {sorted(live)} live and {sorted(lost)} lost: a bug")
        if self.mode == "async" and kind is EventKind.COORDINATOR_REBUILT:
            return self._rebuild_async(journal, fenced, lost, generation, where, reason, now, began)
        if not live:
            raise DataServerLostError(
                f"the coordinator of job {self.job_id} died with every data server ({sorted(lost)}), and "
                "with them every replica"
            )
        applied = min(s.version for s in fenced)  # every live shard applied the steps before it
        held = set.intersection(*({i.version for i in s.snapshots} for s in fenced))
        for i in lost:
            peer = live.get((i + 1) % self.shards)
            held &= set(peer.replicas) if peer is not None else set()
        held = {v for v in held if v <= applied}
        consistent = not lost and len({s.version for s in fenced}) == 1
        if not held and not consistent:
            raise DataServerLostError(
                f"the coordinator of job {self.job_id} cannot be rebuilt: no snapshot is held by every live "
                "shard" + (f" and by the peers of data servers {sorted(lost)}, lost with it" if lost else "")
            )
        committed = max(held) if lost else applied
        keep = min(journal.committed_steps, committed)
        self.ledger = Ledger()
        self.ledger.restore([e for e in journal.entries if e.step < keep], keep)
        self.history = journal.history[:keep]
        self.commit_times = journal.commit_times[:keep]
        records: dict[int, StepRecord] = {}
        for status in fenced:
            for one in status.records:
                records.setdefault(one.step, one)
        for step in range(keep, committed):
            batch_ids = self.schedule.step_batches(step)
            record = records.get(step)
            if record is None:
                self.ledger.commit(batch_ids, step, -1)
                self.history.append(math.nan)
                self.commit_times.append(math.nan)
                continue
            if tuple(record.batch_ids) != tuple(batch_ids):
                raise FatalError(f"a shard applied step {step} from batch ids {record.batch_ids}: a bug")
            self.ledger.commit(batch_ids, step, record.generation, record.workers)
            self.history.append(sum(record.losses[b] for b in batch_ids) / len(batch_ids))
            self.commit_times.append(record.time)
        self.ledger.snapshot_step = max(held, default=committed)
        self.generation = generation
        self.members = ()
        self.suspended = True
        self.lost = lost
        self.versions = {s.index: s.version for s in fenced}
        self._forget_open_records()
        self.events = list(journal.events)
        self.counters = {**self.counters, **journal.counters}
        self._journaled = 0
        self.copied = 0
        reached = max(journal.committed_steps, applied)
        if kind is EventKind.RESTORED:
            self.counters["checkpoint_restores"] += 1
            why = reason
        else:
            self.counters["coordinator_rebuilds"] += 1
            why = (
                f"the coordinator rebuilt on {where} ({reason}); the ledger rebuilt to step {committed} from "
                f"the controller's copy (to step {keep}) and the shards' records"
                + (f"; data servers {sorted(lost)} lost with it" if lost else "")
            )
        return self.record(
            kind,
            steps_lost=max(0, reached - committed),
            reason=why,
            now=now,
            seconds=now - began,
        )

    def _rebuild_async(
        self,
        journal: Journal,
        fenced: list[ShardStatus],
        lost: set[int],
        generation: int,
        where: str,
        reason: str,
        now: float,
        began: float,
    ) -> MembershipEvent:
        """`rebuild` in async mode: take over from a coordinator whose static worker died, from the
        controller's copy of its record and from the live shards, fenced into `generation` with every
        record of what each applied. Nothing goes back on the live shards (async mode never rolls back):

        - the ledger is the copy's up to its snapshot (every shard holds those applies), then, in the
          copy's order, each of its later commits that every live shard holds. A shard promoted after the
          copy was taken holds its snapshot alone, and the promotion retracted the commits it lacks, a
          change the copy never saw: kept, such an id would stay committed while that shard never applies
          its gradient. It is retracted again here, as `_rejoin_async` does: it waits for the shards that
          lack it, trained again (the shards that have it answer "duplicate");
        - what each live shard applied beyond that waits there for the others (`_applied`), and commits
          once every shard has it. What a shard applied is its records and the ids its fence names
          (`ShardStatus.applied`, from `rebuild_applied_from`): a shard promoted since the copy holds its
          snapshot's applies unrecorded;
        - a shard lost with the coordinator counts as holding the copy's commits; it waits for a standby,
          which takes its peer's replica of its last snapshot (`snapshot_versions`), and `_rejoin_async`
          retracts what it lacks."""
        live = {s.index: s for s in fenced}
        versions: list[int] = []
        for i in range(self.shards):
            if i in live:
                held = [s.version for s in live[i].snapshots]
            else:
                peer = live.get((i + 1) % self.shards)
                held = list(peer.replicas) if peer is not None else []
                if not held:
                    raise DataServerLostError(
                        f"the coordinator of job {self.job_id} died with data server {i}, and no live shard "
                        "holds a replica of its snapshot"
                    )
            versions.append(max(held, default=0))
        first = min(journal.snapshot_step, journal.committed_steps)
        self.ledger = Ledger()
        self.ledger.restore([e for e in journal.entries if e.step < first], first)
        self.history = journal.history[:first]
        self.commit_times = journal.commit_times[:first]
        self.snapshot_versions = tuple(versions)
        self.generation = generation
        self.members = ()
        self.suspended = True
        self.lost = lost
        self.versions = {s.index: s.version for s in fenced}
        self.events = list(journal.events)
        self._leases.clear()
        self._applied.clear()
        self._seen = dict.fromkeys(range(self.shards), 0)
        # What each live shard holds of the copy's commits after its snapshot (every such id is at or
        # above the fence's `rebuild_applied_from`, so `applied` names each one it holds).
        holds = {s.index: {*s.applied, *(b for r in s.records for b in r.batch_ids)} for s in fenced}
        lacked = 0
        after = sorted((e for e in journal.entries if e.step >= first), key=lambda e: e.step)
        for entry in after:
            b, at = entry.batch_id, entry.step
            loss, when = journal.history[at], journal.commit_times[at]
            holders = [j for j in range(self.shards) if j in lost or b in holds[j]]
            if len(holders) == self.shards:
                self.ledger.commit([b], self.ledger.committed_steps, entry.generation, {b: entry.worker},
                                   staleness=entry.staleness)  # fmt: skip
                self.history.append(loss)
                self.commit_times.append(when)
                continue
            lacked += 1
            record = StepRecord(
                at, entry.generation, (b,), {b: entry.worker}, {b: loss}, when, -1, entry.staleness
            )
            for j in holders:
                self._applied.setdefault(b, {})[j] = record
        for status in fenced:
            self._absorb_async(status.index, status)
        for status in fenced:
            # A shard promoted since the copy holds applies its records do not show (its snapshot's): one
            # the copy has not committed would wait for its record for ever, and the loop that trains it
            # again is answered "duplicate" there.
            self._applied_unrecorded(status.index, status.applied)
        self._commit_applied()  # what every shard applied (none lost)
        self._queue = [b for b in range(self.schedule.total_batches) if b not in self.ledger]
        self.counters = {**self.counters, **journal.counters}
        self.counters["coordinator_rebuilds"] += 1
        self._journaled = 0
        self.copied = 0
        kept = journal.committed_steps - lacked
        return self.record(
            EventKind.COORDINATOR_REBUILT,
            steps_lost=lacked,
            reason=(
                f"the coordinator rebuilt on {where} ({reason}); async: the ledger of the controller's copy "
                f"({journal.committed_steps} batch ids"
                + (
                    f", less {lacked} batch ids a live shard lacks, retracted by a promotion after the copy"
                    if lacked
                    else ""
                )
                + f") and what every live shard applied since ({self.ledger.committed_steps - kept} more)"
                + (f"; data servers {sorted(lost)} lost with it" if lost else "")
            ),
            now=now,
            seconds=now - began,
        )

    # -- the end ---------------------------------------------------------------------------------

    def model_failed(
        self, worker: str, step: int, batch_id: int | None, message: str, now: float
    ) -> list[MembershipEvent]:
        """A member's model raised (or its loss was not finite) on `batch_id`: like Horovod's host
        blacklist, the worker is excluded (it trains no more for this job; the next survival check takes
        its share away, and the batch trains again on another worker). The job fails only when the same
        batch failed on two workers (the model or the data is at fault, not a node), or when no member is
        left that was not excluded."""
        if self.failure is not None:
            return []
        key = -1 if batch_id is None else batch_id
        failed_on = self._model_failures.setdefault(key, {})
        failed_on[worker] = message
        if batch_id is None or len(failed_on) > 1:
            where = ", ".join(sorted(failed_on))
            why = "; ".join(f"on {w}: {m}" for w, m in sorted(failed_on.items()))
            what = f"batch {batch_id} of step {step}" if batch_id is not None else f"step {step}"
            return self.fail(
                Failure(
                    "model",
                    f"{what} failed on {len(failed_on)} workers ({where}), so the model or the data is at "
                    f"fault, not a node: {why}",
                    step,
                    batch_id,
                ),
                now,
            )
        self.excluded[worker] = message
        event = self.record(
            EventKind.EXCLUDED,
            left=frozenset({worker}),
            reason=f"{worker} excluded: {message}",
            now=now,
        )
        self.counters["excluded"] += 1
        if all(m in self.excluded for m in self.members):
            excluded = "; ".join(f"{w}: {m}" for w, m in sorted(self.excluded.items()))
            return [
                event,
                *self.fail(
                    Failure(
                        "model",
                        f"every compute worker was excluded after its model failed ({excluded}); the last "
                        f"failure was at step {step}, batch {batch_id}",
                        step,
                        batch_id,
                    ),
                    now,
                ),
            ]
        return [event]

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
