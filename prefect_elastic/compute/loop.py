"""Compute worker: a long-running loop, one per elastic worker per job, as a Dask task (`run_loop`).

Once per generation it asks the coordinator for its `Role` (its rank in the generation's member list);
from then on it trains its share of the work with no call to the coordinator but the mode's own (async
leases). On its own connection to every shard (`wire/channel.py`) it pulls parameters and batches, computes
one gradient per micro-batch with torch (`trainer.py`), and pushes the gradients with the losses, tagged
with the generation.

Stateless by construction: the model is built on torch's `meta` device, which holds shapes and no
values, and each micro-batch runs through `torch.func.functional_call` with the tensors just pulled;
those are dropped when the step ends. It holds handles to the coordinator and the shards only, so it never
talks to another compute worker. Every remote call is bounded by `LoopSpec.call_timeout`; the loop is
handed the job's settings it reads as a `LoopSpec`, never the whole job.

This module is the part both modes share: the `Loop` interface that the sync loop (`sync_loop.py`) and
the async loop (`async_loop.py`) implement, what a loop works with on its worker (`LoopContext`), asking
for the role (`ask_role`) and connecting to where the shards listen (`reconnect`). Which loop runs is
handed in by the caller (`prefect_elastic.modes`); nothing here asks which mode it is in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..allocator import tune_allocator
from ..data.batches import BatchSpec
from ..job import LoopSpec, StateLayout
from ..messages import CoordinatorHandle, Role, direct
from ..schedule import Schedule
from ..sharding import Piece
from ..wire import ChannelAddress, ShardLink, worker_tls
from .device import SLOWDOWN, training_device
from .links import registered
from .profiler import dask_profiler_paused
from .pushes import PUSH_HOOK, PushObserver, StepPush, pushes_for
from .stats import LoopStats
from .trainer import MicroBatchTrainer

log = logging.getLogger(__name__)

# Remote calls that fail this many times in a row (the coordinator unreachable) end the loop; the
# controller sees it and starts another loop if the worker is still a member.
MAX_CONSECUTIVE_CALL_ERRORS = 5


@dataclass
class LoopContext:
    """What a compute loop works with on its worker, made once by `run_loop`."""

    address: str  # the worker's, as the coordinator knows it
    coordinator: CoordinatorHandle
    trainer: MicroBatchTrainer
    schedule: Schedule
    stats: LoopStats
    timeout: float  # every remote call's bound (`LoopSpec.call_timeout`)
    # Whether the loop should go on: its task still runs on a worker that is not closing.
    wanted: Callable[[], bool]
    # One connection to every shard, opened on first use and again after any error; the lists are
    # changed in place as shards move (`reconnect`), and `leave_links` breaks the ones of a moved shard.
    shards: list[ShardLink]
    data: list[ShardLink]  # a second connection to every shard, for batches only (the async loop's)
    pushes: StepPush  # how a sync step's frames reach the shards (`pushes.py`)


class Loop(Protocol):
    """One mode's compute loop: trains from its first role until the job ends, the worker closes, or the
    controller cancels it (`wanted`), and returns what it measured."""

    def run(self, context: LoopContext) -> LoopStats: ...


def run_loop(
    loop: Loop,
    spec: LoopSpec,
    coordinator: CoordinatorHandle,
    plan: list[list[Piece]],
    layout: StateLayout,
    batches: BatchSpec,
) -> LoopStats:
    """Runs as a Dask task pinned to one elastic worker until the job ends, the worker closes, or the
    controller cancels it."""
    from distributed import get_worker, secede
    from distributed.worker import thread_state

    worker = get_worker()
    address = worker.address
    key = thread_state.key
    coordinator = direct(coordinator)
    # Leave the worker's thread slot free: this task runs for the whole job, beside other jobs' loops.
    secede()
    tune_allocator()
    torch.set_num_threads(spec.threads_per_worker)
    device = training_device(spec.deterministic)
    schedule = batches.schedule
    trainer = MicroBatchTrainer(spec, plan, layout, device, lambda: worker.plugins.get(SLOWDOWN), batches)
    observer: PushObserver | None = worker.plugins.get(PUSH_HOOK)  # type: ignore[assignment]

    def wanted() -> bool:
        # A loop the controller cancelled (its worker left the membership) keeps running in its thread;
        # once its task is no longer running on the worker, it ends instead of training beside a new one.
        ts = worker.state.tasks.get(key)
        running = ts is not None and ts.state in ("executing", "long-running")
        if running and worker.status.name in ("running", "paused"):
            return True
        # (Said, because the controller then starts another loop on a worker still a member, behind a
        # fence: the reason is the first thing to know when that happens mid-job.)
        log.info(
            "compute %s: the loop ends: its task is %s, the worker %s", address,
            "gone" if ts is None else ts.state, worker.status.name,
        )  # fmt: skip
        return False

    context = LoopContext(
        address=address,
        coordinator=coordinator,
        trainer=trainer,
        schedule=schedule,
        stats=LoopStats(worker=address, device=str(device)),
        timeout=spec.call_timeout,
        wanted=wanted,
        # (Where the shards listen comes with each role: a data server promoted onto a standby listens
        # elsewhere.)
        shards=[],
        data=[],
        pushes=pushes_for(observer),
    )
    try:
        with registered(spec.job_id, context.shards, context.data), dask_profiler_paused(worker):
            return loop.run(context)
    finally:
        trainer.close()
        for link in (*context.shards, *context.data):
            link.close()


def ask_role(
    coordinator: CoordinatorHandle, address: str, known: int, stats: LoopStats, spec: LoopSpec, errors: int
) -> tuple[Role | None, int]:
    """The loop's role in a generation newer than `known` (a long poll of the coordinator), or None, and
    how many asks in a row have failed (`errors` counts them: the loop ends after
    `MAX_CONSECUTIVE_CALL_ERRORS`, the controller then starts another if the worker is still a member)."""
    try:
        asked = time.perf_counter()
        got = coordinator.role(address, known).result(timeout=spec.call_timeout)
        stats.add("role", time.perf_counter() - asked)
        return got, errors
    except Exception as exc:
        stats.call_errors += 1
        log.warning("compute %s: role failed (%s: %s)", address, type(exc).__name__, exc)
        if errors + 1 >= MAX_CONSECUTIVE_CALL_ERRORS:
            raise
        time.sleep(min(1.0, spec.liveness_interval))
        return None, errors + 1


def reconnect(links: list[ShardLink], channels: Sequence[ChannelAddress], timeout: float) -> None:
    """Connections to where the shards listen now (a promoted data server listens elsewhere)."""
    wanted = [ChannelAddress(*channel) for channel in channels]
    if [link.address for link in links] != wanted:
        for link in links:
            link.close()
        tls = worker_tls("connect")  # (the cluster's TLS, if it has any, covers the step path too)
        links[:] = [ShardLink(channel, timeout, tls) for channel in wanted]
