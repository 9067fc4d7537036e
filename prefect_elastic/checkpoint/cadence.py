"""How a mode's snapshots become checkpoints, and which checkpoints a mode resumes from.

Sync and async runs differ here in two decisions, each a method of `CheckpointCadence`: how many
snapshots pass between two checkpoints (async mode's coordinator snapshots only every `checkpoint_every`
survival checks, so each of its snapshots is written), and which checkpoint a run may go on from (a sync
run needs every shard at the committed step; an async run resumes each shard at its own version).
`Persistence` is handed one of them and asks nothing else about the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointMismatchError
from .record import Checkpoint


class CheckpointCadence(Protocol):
    def snapshots_per_checkpoint(self, checkpoint_every: int) -> int:
        """Snapshots counted for each checkpoint written (`ElasticJob.checkpoint_every` given)."""
        ...

    def check_resumable(self, checkpoint: Checkpoint, where: str) -> None:
        """Raise `CheckpointMismatchError` for a checkpoint a run of this mode cannot go on from."""
        ...


@dataclass(frozen=True)
class SyncCheckpoints:
    """Sync mode: every `checkpoint_every`-th snapshot is written; every shard resumes at one step."""

    def snapshots_per_checkpoint(self, checkpoint_every: int) -> int:
        return checkpoint_every

    def check_resumable(self, checkpoint: Checkpoint, where: str) -> None:
        if any(v != checkpoint.committed_steps for v in checkpoint.versions):
            raise CheckpointMismatchError(
                f"checkpoint {where} was written mid-run by an async run (its shards stand at "
                f"versions {list(checkpoint.versions)}, which a sync run cannot go on from); resume "
                "it with mode='async', or point `checkpoint` at another folder"
            )


@dataclass(frozen=True)
class AsyncCheckpoints:
    """Async mode: every snapshot is written (the coordinator takes one only every `checkpoint_every`
    survival checks); each shard resumes at its own version, so any checkpoint of the job will do."""

    def snapshots_per_checkpoint(self, checkpoint_every: int) -> int:
        return 1

    def check_resumable(self, checkpoint: Checkpoint, where: str) -> None:
        return None
