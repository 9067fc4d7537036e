"""Slowness on purpose, to rehearse against: a straggler compute worker and slowed shards.

- `Straggler(worker, factor)`: a Dask worker plugin registered under `compute.SLOWDOWN`; on the worker it
  names (a name or an address), every micro-batch's compute takes `factor` times as long (the loop sleeps
  for the difference after computing it), in sync and async mode alike. `FaultSchedule.slow_worker` and
  `LocalElasticCluster.slow_worker` register it.
The data servers' four are their hooks (`data_server.ServerHooks`: a data server calls those of every
plugin of its worker that has them, registered before it started or since):
- `SlowShards(seconds)`: every data server on a worker that has it waits `seconds` before each async
  apply (`before_apply`: the test hook for candidate steps, answers that come later than the workers'
  compute).
- `SlowHandOver(worker, seconds)`: the data server on the worker it names waits `seconds` when a hand-over
  asks it to hold (`on_hold`: the test hook for a static worker that dies in the middle of handing its
  roles over).
- `SlowStart(worker, seconds)`: a data server started on the worker it names waits `seconds` before it
  loads anything (`on_start`: the test hook for a standby that dies while it takes a role).
- `DeathAtFence(worker)`: the worker it names SIGKILLs its own process group (worker and nanny) when a
  data server there is fenced (`on_fence`): a standby's first fence is its promotion's (the test hook for
  a standby that dies in the middle of its promotion). For `LocalElasticCluster` workers, each in a
  process group of its own.

Registering a plugin under a name that is taken replaces the one there; `clear` removes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import distributed
from distributed.diagnostics.plugin import WorkerPlugin

from ..compute import SLOWDOWN
from ..data_server import NoHooks

# The names the data servers' hooks are registered under: one of each at a time.
SHARD_DELAY = "prefect-elastic-shard-delay"
HAND_OVER_DELAY = "prefect-elastic-hand-over-delay"
START_DELAY = "prefect-elastic-start-delay"
FENCE_DEATH = "prefect-elastic-fence-death"


class Straggler(WorkerPlugin):
    """Makes the compute of one worker `factor` times slower (1 everywhere else)."""

    name = SLOWDOWN

    def __init__(self, worker: str, factor: float) -> None:
        if not factor >= 1.0:
            raise ValueError(f"factor={factor!r}: a straggler is slower, so give a factor of 1 or more")
        self.worker = worker
        self.wanted = float(factor)
        self.factor = 1.0

    def setup(self, worker: Any) -> None:
        if self.worker in (str(worker.address), str(worker.name)):
            self.factor = self.wanted


class SlowShards(WorkerPlugin, NoHooks):
    """Makes every data server on the workers it is registered on wait before each async apply."""

    name = SHARD_DELAY

    def __init__(self, seconds: float) -> None:
        if not seconds >= 0.0:
            raise ValueError(f"seconds={seconds!r}: give a delay of 0 or more seconds")
        self.seconds = float(seconds)

    async def before_apply(self) -> None:
        if self.seconds:
            await asyncio.sleep(self.seconds)


class _OnOneWorker(WorkerPlugin, NoHooks):
    """A delay of `seconds` on one worker (a name or an address); 0 everywhere else."""

    def __init__(self, worker: str, seconds: float) -> None:
        if not seconds >= 0.0:
            raise ValueError(f"seconds={seconds!r}: give a delay of 0 or more seconds")
        self.worker = worker
        self.wanted = float(seconds)
        self.seconds = 0.0

    def setup(self, worker: Any) -> None:
        if self.worker in (str(worker.address), str(worker.name)):
            self.seconds = self.wanted


class SlowHandOver(_OnOneWorker):
    """Makes the data server on one worker wait `seconds` when a hand-over asks it to hold at a step."""

    name = HAND_OVER_DELAY

    async def on_hold(self) -> None:
        if self.seconds:
            await asyncio.sleep(self.seconds)


class SlowStart(_OnOneWorker):
    """Makes a data server started on one worker wait `seconds` before it loads anything."""

    name = START_DELAY

    def on_start(self) -> None:
        if self.seconds:
            time.sleep(self.seconds)  # (a data server starts in a task's thread, not on the event loop)


class DeathAtFence(_OnOneWorker):
    """Makes the worker it names die (its process group SIGKILLed) when a data server there is fenced."""

    name = FENCE_DEATH

    def __init__(self, worker: str) -> None:
        super().__init__(worker, 1.0)  # (non-zero `seconds` arms it)

    def on_fence(self) -> None:
        if self.seconds:
            # The worker's process group, its nanny with it, as `LocalElasticCluster.kill_worker` does.
            os.killpg(os.getpgrp(), signal.SIGKILL)


def register(
    client: distributed.Client, plugin: Straggler | SlowShards | SlowHandOver | SlowStart | DeathAtFence
) -> None:
    """Register `plugin` on every worker, present and future (one with its name is replaced)."""
    client.register_plugin(plugin, name=plugin.name)


def clear(client: distributed.Client) -> None:
    """Remove every plugin of this module from every worker (where registered)."""
    for name in (SLOWDOWN, SHARD_DELAY, HAND_OVER_DELAY, START_DELAY, FENCE_DEATH):
        with contextlib.suppress(ValueError):  # not registered
            client.unregister_worker_plugin(name)
