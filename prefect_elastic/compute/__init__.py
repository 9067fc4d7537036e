"""The compute worker: a long-running loop, one per elastic worker per job (`run_loop`), in the mode's
implementation of one interface (`Loop`): `SyncLoop` (every member trains its share of every step) or
`AsyncLoop` (leases of batch ids, candidate models), chosen with the job's mode in `prefect_elastic.modes`
(the one place that asks it).

- `loop.py`: the Dask task (`run_loop`), the `Loop` interface and what a loop works with (`LoopContext`),
  the role asked for each generation, the connections to where the shards listen
- `sync_loop.py`: `SyncLoop`; `async_loop.py`: `AsyncLoop`, one generation of it in `async_session.py`
- `trainer.py`: `MicroBatchTrainer`, a micro-batch's gradient on the meta model and a sync step's frames
- `frames.py`: what goes on the wire per step (parameters and batches asked ahead, gradient runs)
- `pushes.py`: how a sync step's frames reach the shards (`Pipelined`; `ShardByShard` for a `PushObserver`)
- `device.py`: the training device, a micro-batch's seed, the straggler's slowdown (`SLOWDOWN`)
- `links.py`: the loops' connections by job, broken by `leave_links` when shards move
- `profiler.py`: Dask's profiler paused while a loop runs; `stats.py`: `LoopStats`
"""

from __future__ import annotations

from .async_loop import AsyncLoop
from .async_session import IDLE_SECONDS, MIN_LEASE, AsyncSession
from .device import SLOWDOWN, micro_batch_seed, straggle, training_device
from .frames import (
    PACK_BYTES,
    Ahead,
    exchange,
    gradient_entries,
    moved_as_one,
    packs,
    push_order,
    receive_all,
    send_all,
    unflatten,
)
from .links import leave_links
from .loop import MAX_CONSECUTIVE_CALL_ERRORS, Loop, LoopContext, ask_role, reconnect, run_loop
from .profiler import PROFILER_ENV, dask_profiler_paused
from .pushes import PUSH_HOOK, Pipelined, PushObserver, ShardByShard, StepPush, pushes_for
from .stats import WARMUP_STEPS, LoopStats
from .sync_loop import SyncLoop
from .trainer import PULL_WAIT_SECONDS, MicroBatchTrainer

__all__ = [
    "IDLE_SECONDS",
    "MAX_CONSECUTIVE_CALL_ERRORS",
    "MIN_LEASE",
    "PACK_BYTES",
    "PROFILER_ENV",
    "PULL_WAIT_SECONDS",
    "PUSH_HOOK",
    "SLOWDOWN",
    "WARMUP_STEPS",
    "Ahead",
    "AsyncLoop",
    "AsyncSession",
    "Loop",
    "LoopContext",
    "LoopStats",
    "MicroBatchTrainer",
    "Pipelined",
    "PushObserver",
    "ShardByShard",
    "StepPush",
    "SyncLoop",
    "ask_role",
    "dask_profiler_paused",
    "exchange",
    "gradient_entries",
    "leave_links",
    "micro_batch_seed",
    "moved_as_one",
    "packs",
    "push_order",
    "pushes_for",
    "receive_all",
    "reconnect",
    "run_loop",
    "send_all",
    "straggle",
    "training_device",
    "unflatten",
]
