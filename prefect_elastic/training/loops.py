"""The compute loops: one on every live elastic worker, started again when it ends, its statistics
collected; a loop that keeps failing ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from distributed import Future

from ..compute import run_loop
from ..errors import (
    FatalError,
)
from ..messages import (
    CoordinatorHandle,
)
from ..sharding import Piece
from .calls import settled_result
from .workers import WorkersView

if TYPE_CHECKING:
    from .run import TrainingRun

log = logging.getLogger(__name__)

# A compute loop that keeps failing on a live worker is restarted at most this many times.
MAX_LOOP_RESTARTS = 5


class ComputeLoops:
    """(of a `TrainingRun`)"""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.job = run.job
        self.client = run.client

    def to_restart(self, live: list[str]) -> bool:
        return any(self.run.loops[a].done() for a in live if a in self.run.loops)

    def ensure(self, view: WorkersView, coordinator: CoordinatorHandle, plan: list[list[Piece]]) -> bool:
        """A compute loop on every live worker. Returns whether a live member's loop was started over
        (it needs a fence). The loop of a worker that is listed but silent (frozen) is kept: if it wakes,
        its old messages are refused and it asks for a new role."""
        restarted = False
        for addr in list(self.run.loops):
            if addr not in view.listed:
                self.run.loops.pop(addr).cancel()
        for addr in view.live:
            loop = self.run.loops.get(addr)
            if loop is not None and loop.done():
                self.collect(addr, loop)
                loop = None
                restarted = True
            if loop is None:
                self.run.loop_restarts[addr] = self.run.loop_restarts.get(addr, 0) + 1
                self.run._loop_serial += 1
                self.run.loops[addr] = self.client.submit(
                    run_loop, self.run.mode.loop, self.run.specs.loop, coordinator, plan, self.run.layout,
                    self.run.schedule,
                    key=f"prefect-elastic-{self.job.job_id}-{self.run.run_id}-compute-{addr}-{self.run._loop_serial}",
                    workers=[addr], allow_other_workers=False, pure=False,
                )  # fmt: skip
        return restarted

    def collect(self, addr: str, loop: Future) -> None:
        if loop.status == "finished":
            self.run.loop_stats.append(loop.result())
        elif loop.status == "error":
            error = loop.exception()
            if isinstance(error, FatalError):
                raise error  # a shard said the job cannot go on: no restart would help
            self.run.loop_failures += 1
            # With its traceback: which call failed is what tells a restart that helps from one that cannot.
            log.warning(
                "job %s: compute loop on %s ended with %r", self.job.job_id, addr, error, exc_info=error
            )
            if self.run.loop_restarts.get(addr, 0) > MAX_LOOP_RESTARTS:
                # An error that survives restarts (the model does not import there, a version mismatch)
                # would otherwise keep the worker a member that never trains.
                raise FatalError(
                    f"the compute loop on {addr} failed {self.run.loop_restarts[addr]} times; last error: "
                    f"{type(error).__name__}: {error}"
                )

    def stop(self) -> None:
        # Loops see `stop` within one work poll; wait for their stats briefly, then cancel what is left.
        deadline = time.monotonic() + 2.0
        for addr, loop in list(self.run.loops.items()):
            with contextlib.suppress(Exception):
                settled_result(loop, max(0.01, deadline - time.monotonic()))
            self.collect(addr, loop) if loop.done() else loop.cancel()
        self.run.loops.clear()
