"""How the coordinator commits work, as one interface with two implementations chosen once per job:
`SyncCommits` (`sync_commits.py`: a step commits when every shard applied all its micro-batches; the shards
stand at one version, which a membership change may roll back) and `AsyncLeases` (`async_leases.py`: work
goes out in leases of batch ids, a batch id commits when every shard applied it, in whatever order; each
shard stands at its own version, and nothing is rolled back).

A `CommitBook` reads the shared record (`record.CoordinatorRecord`) and returns what it finds whole
(`record.Commit`, `Promoted`), which the record writes in its ledger; it says what the actor does where the
two differ, as plans (`SnapshotAt`, `SnapshotWhereFenced`, `SnapshotCommitted`, `PromotionPlan`) that the
actor carries out. Nothing outside `prefect_elastic.modes` asks which one a job has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..messages import EventKind, Journal, MembershipEvent, Resume, ShardStatus
from .record import Commit, CoordinatorRecord
from .survival import Decision


@dataclass(frozen=True)
class Reconciliation:
    """How the shards come back to one version after a fence: restore the snapshot of `restore_to` on
    every shard (None: they already agree), or the shards a step ahead step back to `step_back_to` (their
    other copy still holds it: `data_server/other_copy.py`); and what that undoes."""

    restore_to: int | None
    versions: tuple[int, ...]
    consistent: bool  # the shards were at one version
    step_back_to: int | None = None


@dataclass(frozen=True)
class SnapshotAt:
    """Every shard snapshots `version` as it passes it, between two steps, without stopping; it keeps the
    snapshot of `keep` besides (the one a rollback goes back to until this one is confirmed)."""

    version: int
    keep: int


@dataclass(frozen=True)
class SnapshotWhereFenced:
    """Every shard, fenced into a new generation (nothing is applied meanwhile), snapshots the version it
    stands at; the versions differ, and the snapshot is all of them together."""


@dataclass(frozen=True)
class SnapshotCommitted:
    """Training stopped at a step every shard applied: every shard snapshots the committed step."""


@dataclass(frozen=True)
class Promoted:
    """A standby took a lost shard's role: the steps (batch ids) that left the ledger, where the shard
    stands, in words, and what its snapshot made whole again (for the record to commit)."""

    steps_lost: int
    where: str
    commits: tuple[Commit, ...] = ()


@dataclass(frozen=True)
class PromotionPlan:
    """How a standby takes a lost shard's role: the version every other shard goes back to (None: they
    stay where they stand), and whether the promoted shard is asked which batch ids its snapshot holds."""

    restore_to: int | None
    asks_applied: bool


class CommitBook(Protocol):
    """The commit bookkeeping of one coordinator, over the record `state` it was made with."""

    # Named in `Progress`, for the record; never compared.
    mode: str

    def __init__(self, state: CoordinatorRecord, resume: Resume | None, snapshot_every: int) -> None: ...

    # -- where the job is ----------------------------------------------------------------------------

    def holding(self) -> tuple[tuple[str, int], ...]:
        """Each member with the micro-batches it holds now (the record hands work out)."""
        ...

    def since(self) -> int:
        """The first record a shard's status must carry."""
        ...

    def records_kept_from(self) -> int:
        """The first record a shard must keep."""
        ...

    def read_interval(self, quick: float, steady: float) -> float:
        """How long to wait before the shards' status is read again."""
        ...

    def lease(self, worker: str, generation: int, count: int, renew: bool) -> list[int] | None:
        """Up to `count` batch ids for `worker` to train."""
        ...

    # -- what the shards report ----------------------------------------------------------------------

    def absorb(self, status: ShardStatus) -> tuple[Commit, ...]:
        """Take in the records of a shard's status (of the current generation); return what is whole, in
        the order the record commits it."""
        ...

    def forget_open(self) -> None:
        """After a fence: what the shards applied of work not committed and voided by it is forgotten."""
        ...

    # -- snapshots -----------------------------------------------------------------------------------

    @property
    def snapshot_versions(self) -> tuple[int, ...]:
        """Each shard's version in the last snapshot, for a checkpoint; () where it is the ledger's."""
        ...

    def want_snapshot(self, progressed: bool) -> int | None:
        """The one version to ask every shard to snapshot, or None."""
        ...

    def snapshot_plan(self, progressed: bool) -> SnapshotAt | SnapshotWhereFenced | None:
        """The snapshot a survival check that left the membership unchanged takes, if any."""
        ...

    def snapshot_when_stopped(self) -> SnapshotCommitted | SnapshotWhereFenced:
        """The snapshot taken where training stops (the controller's stop, a static worker's hand-over)."""
        ...

    def snapshot_confirmed(self, version: int) -> None:
        """Every shard holds the snapshot of `version`."""
        ...

    def paused(self) -> None:
        """Every shard was fenced, with the members unchanged, for a snapshot where each stands."""
        ...

    def snapshot_where_fenced(self, versions: tuple[int, ...], now: float, seconds: float) -> MembershipEvent:
        """Every shard, fenced, took a snapshot at its own version, `versions`."""
        ...

    def snapshot_version_of(self, index: int) -> int:
        """The version of shard `index` in the last snapshot every shard holds."""
        ...

    # -- membership changes --------------------------------------------------------------------------

    def reconcile(
        self, decision: Decision, fenced: list[ShardStatus], versions: tuple[int, ...]
    ) -> Reconciliation:
        """The version every fenced shard goes back to, if any."""
        ...

    def membership_changing(
        self, decision: Decision, was_running: bool, open_step: int
    ) -> tuple[Decision, int]:
        """The decision as carried out, and how many batch ids go back to be trained again."""
        ...

    def shard_lost(self) -> int:
        """A shard was lost and the others fenced: how many batch ids the fence dropped."""
        ...

    def promotion(self) -> PromotionPlan:
        """How a standby takes a lost shard's role."""
        ...

    def shard_promoted(self, index: int, applied: frozenset[int], version: int) -> Promoted:
        """Shard `index` is back at `version` holding `applied`."""
        ...

    # -- a coordinator rebuilt from the controller's copy ---------------------------------------------

    def rebuild_applied_from(self, journal: Journal) -> int | None:
        """The lowest batch id a rebuilt coordinator's fence asks every shard about; None: not asked."""
        ...

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
        """Take over from the controller's copy and the fenced live shards (`CoordinatorState.rebuild`)."""
        ...
