"""Slowness on purpose, to rehearse against: a straggler compute worker and slowed shards.

- `Straggler(worker, factor)`: a Dask worker plugin registered under `compute.SLOWDOWN`; on the worker it
  names (a name or an address), every micro-batch's compute takes `factor` times as long (the loop sleeps
  for the difference after computing it), in sync and async mode alike. `FaultSchedule.slow_worker` and
  `LocalElasticCluster.slow_worker` register it.
- `SlowShards(seconds)`: a plugin registered under `data_server.SHARD_DELAY`; every data server on a worker
  that has it waits `seconds` before each async apply (the test hook for candidate steps: answers that
  come later than the workers' compute).
- `SlowHandOver(worker, seconds)`: a plugin registered under `data_server.HAND_OVER_DELAY`; the data server
  on the worker it names waits `seconds` when a hand-over asks it to hold (the test hook for a static worker
  that dies in the middle of handing its roles over).
- `SlowStart(worker, seconds)`: a plugin registered under `data_server.START_DELAY`; a data server started
  on the worker it names waits `seconds` before it loads anything (the test hook for a standby that dies
  while it takes a role).
- `DeathAtFence(worker)`: a plugin registered under `data_server.FENCE_DEATH`; the worker it names
  SIGKILLs its own process group (worker and nanny) when a data server there is fenced: a standby's first
  fence is its promotion's (the test hook for a standby that dies in the middle of its promotion). For
  `LocalElasticCluster` workers, each in a process group of its own.

Registering a plugin under a name that is taken replaces the one there; `clear` removes them all.
"""

from __future__ import annotations

import contextlib
from typing import Any

import distributed
from distributed.diagnostics.plugin import WorkerPlugin

from ..compute import SLOWDOWN
from ..data_server import FENCE_DEATH, HAND_OVER_DELAY, SHARD_DELAY, START_DELAY


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


class SlowShards(WorkerPlugin):
    """Makes every data server on the workers it is registered on wait before each async apply."""

    name = SHARD_DELAY

    def __init__(self, seconds: float) -> None:
        if not seconds >= 0.0:
            raise ValueError(f"seconds={seconds!r}: give a delay of 0 or more seconds")
        self.seconds = float(seconds)


class _OnOneWorker(WorkerPlugin):
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


class SlowStart(_OnOneWorker):
    """Makes a data server started on one worker wait `seconds` before it loads anything."""

    name = START_DELAY


class DeathAtFence(_OnOneWorker):
    """Makes the worker it names die (its process group SIGKILLed) when a data server there is fenced."""

    name = FENCE_DEATH

    def __init__(self, worker: str) -> None:
        super().__init__(worker, 1.0)  # (non-zero `seconds` arms it)


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
