"""What one job's coordinator is made with (`CoordinatorSpec`): the controller builds it once from the job,
its schedule and its mode, when the run is made (`Actors`, training/actors.py), and submits that one at the
start and at each rebuild; the actor, its state and its record each take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import Schedule
from .commit_book import CommitBook
from .survival import Policy
from .sync_commits import SyncCommits


@dataclass(frozen=True)
class CoordinatorSpec:
    """The job's coordinator: its id, schedule and data servers (`shards`), the policy of a membership
    change, how few workers it waits for and for how long, its commit bookkeeping (the mode's), and how
    many survival checks that saw progress go between two snapshots of async leases (0: at the end only)."""

    job_id: str
    schedule: Schedule
    shards: int
    policy: Policy
    min_workers: int
    min_workers_timeout: float
    commits: type[CommitBook] = SyncCommits
    snapshot_every: int = 0
