"""A fault no signal from outside can place: a compute worker killed after its push to one shard and
before its push to the next, so that one shard applies a step that the other never will.

`KillBetweenPushes` is a `compute.PushObserver`, a Dask worker plugin registered under `compute.PUSH_HOOK`:
every compute loop that finds it pushes to the shards one by one and tells it after each push
(`compute.ShardByShard`). On the target worker, at the first step from `at_step` on, it waits until shard
0 has applied the step (the other members' pushes reach it), then SIGKILLs its own worker process (a
nanny, where there is one, starts it again under a new address).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from distributed.diagnostics.plugin import WorkerPlugin

from ..compute.pushes import PUSH_HOOK

log = logging.getLogger(__name__)


class KillBetweenPushes(WorkerPlugin):
    name = PUSH_HOOK

    def __init__(self, target: str, at_step: int) -> None:
        self.target = target
        self.at_step = at_step
        self.address = ""

    def setup(self, worker: object) -> None:
        self.address = str(getattr(worker, "address", ""))

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None:
        if self.address != self.target or shard != 0 or step < self.at_step:
            return
        wait_applied()
        log.warning("fault: %s killed after its push to shard 0 of step %d", self.address, step)
        os.kill(os.getpid(), signal.SIGKILL)
