"""The data server with its parameter shard: a Dask actor on a static worker, one per data partition.

- `actor.py`: `DataServer`, the actor: receives the calls of the coordinator, the controller and the
  peers, and hands them on;
- `frames.py`: the step path's frames of compute loops, decoded and answered;
- `apply.py`: the step's apply, `StepApplies`, as `SyncApplies` or `AsyncApplies` (chosen in
  `prefect_elastic.modes`);
- `records.py`: the open step, the records of applied steps, and the apply's decisions (pure);
- `state.py`: the shard's tensors, version, generation and snapshots;
- `replicas.py`: copies of snapshots on the peer, and a standby's adoption of one;
- `plan.py`: which tensors, or ranges of them, each shard holds (`plan_shards`, `plan_pieces`; pure);
- `hooks.py`: the points a rehearsal can slow a data server down or kill it at (`ServerHooks`).
"""

from __future__ import annotations

from ..sharding import Piece, plan_pieces, plan_shards
from .actor import DataServer
from .apply import AsyncApplies, SyncApplies
from .hooks import NoHooks, ServerHooks
from .replicas import join_tensors, split_tensors, warm_standby
from .state import INLINE_APPLY_ELEMENTS
from .step_applies import ApplyMode, StepApplies

__all__ = [
    "INLINE_APPLY_ELEMENTS",
    "ApplyMode",
    "AsyncApplies",
    "DataServer",
    "NoHooks",
    "Piece",
    "ServerHooks",
    "StepApplies",
    "SyncApplies",
    "join_tensors",
    "plan_pieces",
    "plan_shards",
    "split_tensors",
    "warm_standby",
]
