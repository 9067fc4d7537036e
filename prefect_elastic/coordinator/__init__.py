"""The coordinator: membership and the generation, the roles, the batch ledger and the snapshot
bookkeeping of one job, kept by an async Dask actor on a static worker (`actor.Coordinator`).

- `actor.py`: the actor; compute workers and the controller call it; it makes the calls to the shards
  (`shard_calls.py`) and, for the static roles, `role_moves.py`.
- `state.py`: the bookkeeping as a pure state machine (`CoordinatorState`), over the shared record
  (`record.py`), the workers excluded after their model failed (`exclusion.py`) and the job's commit
  bookkeeping, one `CommitBook` (`commit_book.py`) of two: `SyncCommits` (`sync_commits.py`) or
  `AsyncLeases` (`async_leases.py`).
- `spec.py`: what the coordinator is made with (`CoordinatorSpec`), built once by the controller.
- `rebuild.py`: a coordinator rebuilt from the controller's copy of the record; `pacing.py`: how often the
  shards are read.

Which `CommitBook` a job gets is decided once, with the job's mode (`prefect_elastic.modes`).
"""

from __future__ import annotations

from .actor import ROLE_POLL_SECONDS, Coordinator
from .async_leases import AsyncLeases
from .commit_book import (
    CommitBook,
    PromotionPlan,
    Reconciliation,
    SnapshotAt,
    SnapshotCommitted,
    SnapshotWhereFenced,
)
from .exclusion import Exclusions
from .pacing import PACE_STEPS, STEADY_SYNC_SECONDS, SYNC_SECONDS, read_interval
from .rebuild import rebuild_applied_from
from .record import CoordinatorRecord, Failure
from .role_moves import HOLD_WAIT_SECONDS
from .shard_calls import ShardUnreachable, actor_key
from .spec import CoordinatorSpec
from .state import CoordinatorState
from .sync_commits import SyncCommits

__all__ = [
    "HOLD_WAIT_SECONDS",
    "PACE_STEPS",
    "ROLE_POLL_SECONDS",
    "STEADY_SYNC_SECONDS",
    "SYNC_SECONDS",
    "AsyncLeases",
    "CommitBook",
    "Coordinator",
    "CoordinatorRecord",
    "CoordinatorSpec",
    "CoordinatorState",
    "Exclusions",
    "Failure",
    "PromotionPlan",
    "Reconciliation",
    "ShardUnreachable",
    "SnapshotAt",
    "SnapshotCommitted",
    "SnapshotWhereFenced",
    "SyncCommits",
    "actor_key",
    "read_interval",
    "rebuild_applied_from",
]
