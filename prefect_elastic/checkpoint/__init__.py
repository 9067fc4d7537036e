"""Persistent checkpoints on any fsspec URL: what makes "loses nothing" true for the whole job.

- `record`: what one checkpoint holds (`Checkpoint`), its bytes, its `fingerprint` and `check_compatible`;
- `store`: `CheckpointStore`, the checkpoints of one job in one folder, each written whole or not at all;
- `cadence`: how a mode's snapshots become checkpoints (`SyncCheckpoints`, `AsyncCheckpoints`);
- `persistence`: `Persistence`, the controller's use of them in one run, and `WriteFailures`, the decision
  whether failed writes end the job.

Which `CheckpointCadence` a job gets is decided with its mode (`prefect_elastic.modes`).
"""

from __future__ import annotations

from .cadence import AsyncCheckpoints, CheckpointCadence, SyncCheckpoints
from .persistence import Persistence, ShardStart, WriteFailures
from .record import FORMAT, Checkpoint, check_compatible, fingerprint
from .store import CheckpointStore

__all__ = [
    "FORMAT",
    "AsyncCheckpoints",
    "Checkpoint",
    "CheckpointCadence",
    "CheckpointStore",
    "Persistence",
    "ShardStart",
    "SyncCheckpoints",
    "WriteFailures",
    "check_compatible",
    "fingerprint",
]
