"""Async leases: the schedule has one batch id per step; work goes out in leases of batch ids (`lease`), each
shard applies a gradient as it arrives, and a batch id commits in the ledger once every shard applied it, in
whatever order. The shards stand at different versions, each having applied its own set of batch ids: there
is no one version to snapshot mid-run, so a snapshot fences every shard and takes each where it stands
(docs/design/async.md), and nothing is ever rolled back: a batch id applied by some shards only goes back to
the queue, and the others apply it when it is trained again (a shard applies a batch id once).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from ..errors import DataServerLostError
from ..ledger import Ledger
from ..messages import EventKind, Journal, MembershipEvent, Resume, ShardStatus, StepRecord
from .commit_book import (
    Promoted,
    PromotionPlan,
    Reconciliation,
    SnapshotAt,
    SnapshotCommitted,
    SnapshotWhereFenced,
)
from .rebuild import rebuild_applied_from, rebuild_at_one_version
from .record import Commit, CoordinatorRecord
from .survival import Action, Decision


class AsyncLeases:
    """The `CommitBook` of an async job."""

    mode = "async"

    def __init__(self, state: CoordinatorRecord, resume: Resume | None, snapshot_every: int) -> None:
        self.state = state
        # Snapshot (a brief pause of every shard) every this many survival checks that saw progress; 0:
        # only when the run stops or ends. (Set where the job writes checkpoints.)
        self.snapshot_every = snapshot_every
        self._checks_since_snapshot = 0
        # Batch ids nobody holds (lowest first), the ones each member holds, what each shard applied of
        # batch ids not yet committed, and the next record of each shard not yet read.
        self.queue = [b for b in range(state.schedule.total_batches) if b not in state.ledger]
        self._leases: dict[str, list[int]] = {}
        self._applied: dict[int, dict[int, StepRecord]] = {}
        self._seen: dict[int, int] = dict.fromkeys(range(state.shards), 0)
        # Each shard's version in the last snapshot (`snapshot_where_fenced`), for a checkpoint.
        self._snapshot_versions: tuple[int, ...] = ()
        for i, ids in enumerate(resume.applied if resume is not None else ()):
            for b in ids:
                if b not in state.ledger:
                    # Applied by this shard before the checkpoint, not by every shard: it commits once
                    # the others apply it (this shard answers "duplicate" then).
                    self._applied.setdefault(b, {})[i] = StepRecord(
                        -1, state.generation, (b,), {b: ""}, {b: math.nan}, math.nan
                    )
        if resume is not None:
            self._snapshot_versions = resume.versions

    # -- where the job is ----------------------------------------------------------------------------

    def holding(self) -> tuple[tuple[str, int], ...]:
        return tuple((w, len(ids)) for w in self.state.members if (ids := self._leases.get(w)))

    def since(self) -> int:
        """Every apply not read yet (the shards' versions differ)."""
        return min(self._seen.values(), default=0)

    def records_kept_from(self) -> int:
        return 0  # records of batch ids, every one kept (not bounded yet)

    def read_interval(self, quick: float, steady: float) -> float:
        return quick  # re-queued batch ids wait on the read

    def lease(self, worker: str, generation: int, count: int, renew: bool) -> list[int] | None:
        """Up to `count` batch ids for `worker` to train, lowest first; `[]` when none is free (the last
        ones are held by workers); None when the worker has no role in `generation` or the job is over (it
        asks for its role again, which says so). A member's lease goes back to the queue when the
        membership changes; `renew`: the worker's loop started over within the generation (after an
        error), so what it held before goes back now."""
        state = self.state
        if state.finished or state.suspended or state.lost or worker not in state.members:
            return None
        if generation != state.generation:
            return None
        if renew:
            back = [b for b in self._leases.pop(worker, []) if b not in state.ledger]
            self.queue = sorted({*self.queue, *back})
        # (A batch id returned by a membership change may have been committed since: its last shard's
        # apply was already under way when the fence came.)
        self.queue = [b for b in self.queue if b not in state.ledger]
        given, self.queue = self.queue[:count], self.queue[count:]
        self._leases.setdefault(worker, []).extend(given)
        return given

    def _return_leases(self) -> int:
        """Every lease back to the queue (a new generation); returns how many batch ids that is."""
        back = [b for ids in self._leases.values() for b in ids if b not in self.state.ledger]
        self._leases.clear()
        self.queue = sorted({*self.queue, *back})
        return len(back)

    # -- what the shards report ----------------------------------------------------------------------

    def absorb(self, status: ShardStatus) -> tuple[Commit, ...]:
        i = status.index
        for record in status.records:
            if record.step < self._seen[i]:
                continue
            self._seen[i] = record.step + 1
            for b in record.batch_ids:
                if b not in self.state.ledger:
                    self._applied.setdefault(b, {})[i] = record
        return self._whole()

    def _whole(self) -> tuple[Commit, ...]:
        """Every batch id that every shard has applied, lowest first, each as the next step."""
        state = self.state
        whole: list[Commit] = []
        ready = sorted(b for b, by_shard in self._applied.items() if len(by_shard) == state.shards)
        for step, b in enumerate(ready, start=state.ledger.committed_steps):
            records = list(self._applied.pop(b).values())
            # (The records of this run first: a record of a checkpoint's apply has no loss or worker.)
            records.sort(key=lambda r: r.step < 0)
            whole.append(
                Commit(
                    (b,), step, max(r.generation for r in records), {b: records[0].workers.get(b, "")},
                    records[0].losses[b], max((r.time for r in records if r.step >= 0), default=math.nan),
                    staleness=max(r.staleness for r in records),
                )
            )  # fmt: skip
            for ids in self._leases.values():
                if b in ids:
                    ids.remove(b)
        return tuple(whole)

    def _applied_unrecorded(self, index: int, ids: Iterable[int]) -> None:
        """Shard `index` holds the applies of `ids`, with no record of them where it has none (they came
        with a snapshot's replica): kept as a checkpoint's apply (no loss, no worker)."""
        for b in ids:
            if b not in self.state.ledger:
                self._applied.setdefault(b, {}).setdefault(
                    index, StepRecord(-1, self.state.generation, (b,), {b: ""}, {b: math.nan}, math.nan)
                )

    def forget_open(self) -> None:
        pass  # an apply is whole or not made: a fence voids none, and it commits once every shard has it

    # -- snapshots -----------------------------------------------------------------------------------

    @property
    def snapshot_versions(self) -> tuple[int, ...]:
        return self._snapshot_versions

    def want_snapshot(self, progressed: bool) -> int | None:
        # No one version to snapshot mid-run; a membership change needs no snapshot, since nothing is
        # rolled back.
        return None

    def snapshot_plan(self, progressed: bool) -> SnapshotAt | SnapshotWhereFenced | None:
        """A snapshot every `snapshot_every` survival checks that saw progress."""
        if not progressed or not self.snapshot_every:
            return None
        self._checks_since_snapshot += 1
        if self._checks_since_snapshot < self.snapshot_every:
            return None
        self._checks_since_snapshot = 0
        return SnapshotWhereFenced()

    def snapshot_when_stopped(self) -> SnapshotCommitted | SnapshotWhereFenced:
        # Each shard snapshotted where it stands (its copy on the peer): a standby taking it takes exactly
        # what the shard had applied, so nothing is redone.
        return SnapshotWhereFenced()

    def snapshot_confirmed(self, version: int) -> None:
        # (The end of an async run: every shard applied every batch id, one version everywhere.)
        self._snapshot_versions = (version,) * self.state.shards

    def paused(self) -> None:
        """Every shard was fenced into a new generation for a snapshot, with the same members: the leases go
        back to the queue and the members get their roles of the new generation at once."""
        self._return_leases()

    def snapshot_where_fenced(self, versions: tuple[int, ...], now: float, seconds: float) -> MembershipEvent:
        """Every shard was fenced (nothing is applied any more) and took a snapshot at its own version,
        `versions`; every batch id in the ledger is in them (it was applied by every shard before the
        fence). That is the snapshot a checkpoint writes, with each shard's applied batch ids."""
        state = self.state
        state.ledger.mark_snapshot(state.ledger.committed_steps)
        self._snapshot_versions = versions
        state.counters["snapshots"] += 1
        return state.record(
            EventKind.SNAPSHOT,
            reason=f"async: every shard fenced, at versions {list(versions)}",
            now=now,
            seconds=seconds,
        )

    def snapshot_version_of(self, index: int) -> int:
        """The shard's own version in the last snapshot."""
        return self._snapshot_versions[index] if self._snapshot_versions else 0

    # -- membership changes --------------------------------------------------------------------------

    def reconcile(
        self, decision: Decision, fenced: list[ShardStatus], versions: tuple[int, ...]
    ) -> Reconciliation:
        return Reconciliation(None, versions, True)  # nothing is undone

    def membership_changing(
        self, decision: Decision, was_running: bool, open_step: int
    ) -> tuple[Decision, int]:
        dropped = self._return_leases()
        if decision.action is Action.ROLLBACK:
            return replace(decision, action=Action.REASSIGN), dropped  # async mode never rolls back
        return decision, dropped

    def shard_lost(self) -> int:
        self._return_leases()
        return 0  # the fence dropped nothing: applies are whole or not made

    def promotion(self) -> PromotionPlan:
        return PromotionPlan(restore_to=None, asks_applied=True)  # the other shards stay where they stand

    def shard_promoted(self, index: int, applied: frozenset[int], version: int) -> Promoted:
        """Shard `index` came back on a standby from its peer's replica of its last snapshot, at `version`,
        holding the applies `applied`; whatever it applied after that is gone. Nothing is rolled back on
        the other shards. A committed batch id it lacks leaves the ledger again (the ledger drops every
        commit after the last snapshot as one; those the shard holds commit again at once) and goes back
        to the queue, to be trained again and applied there alone: the other shards answer "duplicate".
        Returns how many batch ids left the ledger, and what it made whole again for the record to commit."""
        state = self.state
        first = state.ledger.snapshot_step
        retracted = state.ledger.entries_from(first)
        losses, times = state.history[first:], state.commit_times[first:]
        state.back_to_snapshot()
        for entry, loss, when in zip(retracted, losses, times, strict=True):
            b = entry.batch_id
            record = StepRecord(
                entry.step, entry.generation, (b,), {b: entry.worker}, {b: loss}, when, -1, entry.staleness
            )
            for j in range(state.shards):
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
        whole = self._whole()
        again = {b for commit in whole for b in commit.batch_ids}
        back = [e.batch_id for e in retracted if e.batch_id not in state.ledger and e.batch_id not in again]
        self.queue = sorted({*self.queue, *back})
        return Promoted(len(back), f"version {version}", whole)

    # -- a coordinator rebuilt from the controller's copy ---------------------------------------------

    def rebuild_applied_from(self, journal: Journal) -> int | None:
        # With the ids each applied, recorded or not (a shard promoted since the copy has no record of
        # what its snapshot holds), from those the copy has not committed or committed after its snapshot
        # (a promotion may have retracted those).
        return rebuild_applied_from(journal)

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
        """Take over from a coordinator whose static worker died, from the controller's copy of its record
        and from the live shards, fenced into `generation` with every record of what each applied. Nothing
        goes back on the live shards (async mode never rolls back):

        - the ledger is the copy's up to its snapshot (every shard holds those applies), then, in the
          copy's order, each of its later commits that every live shard holds. A shard promoted after the
          copy was taken holds its snapshot alone, and the promotion retracted the commits it lacks, a
          change the copy never saw: kept, such an id would stay committed while that shard never applies
          its gradient. It is retracted again here, as `shard_promoted` does: it waits for the shards that
          lack it, trained again (the shards that have it answer "duplicate");
        - what each live shard applied beyond that waits there for the others (`_applied`), and commits
          once every shard has it. What a shard applied is its records and the ids its fence names
          (`ShardStatus.applied`, from `rebuild_applied_from`): a shard promoted since the copy holds its
          snapshot's applies unrecorded;
        - a shard lost with the coordinator counts as holding the copy's commits; it waits for a standby,
          which takes its peer's replica of its last snapshot (`snapshot_versions`), and `shard_promoted`
          retracts what it lacks.

        A restore from a persistent checkpoint (`kind` RESTORED) starts every shard afresh at one version."""
        if kind is not EventKind.COORDINATOR_REBUILT:
            return rebuild_at_one_version(
                self.state, journal, fenced, lost, generation, where, reason, now, began, kind
            )
        state = self.state
        live = {s.index: s for s in fenced}
        versions: list[int] = []
        for i in range(state.shards):
            if i in live:
                held = [s.version for s in live[i].snapshots]
            else:
                peer = live.get((i + 1) % state.shards)
                held = list(peer.replicas) if peer is not None else []
                if not held:
                    raise DataServerLostError(
                        f"the coordinator of job {state.job_id} died with data server {i}, and no live shard "
                        "holds a replica of its snapshot"
                    )
            versions.append(max(held, default=0))
        first = min(journal.snapshot_step, journal.committed_steps)
        state.ledger = Ledger()
        state.ledger.restore([e for e in journal.entries if e.step < first], first)
        state.history = journal.history[:first]
        state.commit_times = journal.commit_times[:first]
        self._snapshot_versions = tuple(versions)
        state.take_over(journal, fenced, lost, generation)
        self._leases.clear()
        self._applied.clear()
        self._seen = dict.fromkeys(range(state.shards), 0)
        # What each live shard holds of the copy's commits after its snapshot (every such id is at or
        # above the fence's `rebuild_applied_from`, so `applied` names each one it holds).
        holds = {s.index: {*s.applied, *(b for r in s.records for b in r.batch_ids)} for s in fenced}
        lacked = 0
        after = sorted((e for e in journal.entries if e.step >= first), key=lambda e: e.step)
        for entry in after:
            b, at = entry.batch_id, entry.step
            loss, when = journal.history[at], journal.commit_times[at]
            holders = [j for j in range(state.shards) if j in lost or b in holds[j]]
            if len(holders) == state.shards:
                state.ledger.commit([b], state.ledger.committed_steps, entry.generation, {b: entry.worker},
                                    staleness=entry.staleness)  # fmt: skip
                state.history.append(loss)
                state.commit_times.append(when)
                continue
            lacked += 1
            record = StepRecord(
                at, entry.generation, (b,), {b: entry.worker}, {b: loss}, when, -1, entry.staleness
            )
            for j in holders:
                self._applied.setdefault(b, {})[j] = record
        # (A rebuild takes the record over whole: what is whole commits in it at once.)
        for status in fenced:
            state.commit(self.absorb(status))
        for status in fenced:
            # A shard promoted since the copy holds applies its records do not show (its snapshot's): one
            # the copy has not committed would wait for its record for ever, and the loop that trains it
            # again is answered "duplicate" there.
            self._applied_unrecorded(status.index, status.applied)
        state.commit(self._whole())  # what every shard applied (none lost)
        self.queue = [b for b in range(state.schedule.total_batches) if b not in state.ledger]
        state.counters["coordinator_rebuilds"] += 1
        kept = journal.committed_steps - lacked
        return state.record(
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
                + f") and what every live shard applied since ({state.ledger.committed_steps - kept} more)"
                + (f"; data servers {sorted(lost)} lost with it" if lost else "")
            ),
            now=now,
            seconds=now - began,
        )
