"""The compute loops: one on every live elastic worker, started again when it ends, its statistics
collected; a loop that keeps failing ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from distributed import Client, Future

from ..compute import LoopStats, run_loop
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
    from ..job import LoopSpec
    from .prepare import Prepared

log = logging.getLogger(__name__)

# A compute loop that keeps failing on a live worker is restarted at most this many times.
MAX_LOOP_RESTARTS = 5


class ComputeLoops:
    """The compute loops' table: the loop of each member, how often each was started, the statistics of
    those that ended, the failures."""

    def __init__(self, client: Client, prepared: Prepared, key_prefix: str) -> None:
        self.client = client
        self.prepared = prepared
        self.job = prepared.job
        self.key_prefix = key_prefix  # the job's and run's prefix of every task key
        self.loops: dict[str, Future] = {}
        self.restarts: dict[str, int] = {}
        self.stats: list[LoopStats] = []
        self.failures = 0  # compute loops that ended with an error (and were started again)
        self._serial = 0  # numbers the loops' task keys

    def to_restart(self, live: list[str]) -> bool:
        """Whether a member has no loop, or one that ended (the loops were dropped with a coordinator
        rebuilt, or one ended)."""
        return any(a not in self.loops or self.loops[a].done() for a in live)

    def ended(self, live: list[str]) -> bool:
        """Whether the loop of a member ended."""
        return any(self.loops[a].done() for a in live if a in self.loops)

    def members_with_loops(self, members: Iterable[str]) -> list[str]:
        return sorted(a for a in members if a in self.loops)

    def drop_all(self) -> None:
        """The coordinator was rebuilt: every loop holds the old one's handle, and starts over with the new
        one (a loop that was cancelled ends at its next step, and whatever it sends is of an old
        generation). Not counted as a restart."""
        for addr, loop in self.loops.items():
            loop.cancel()
            self.restarts[addr] = max(0, self.restarts.get(addr, 1) - 1)
        self.loops.clear()

    def cancel_all(self) -> None:
        for loop in self.loops.values():
            loop.cancel()
        self.loops.clear()

    def ensure(
        self, view: WorkersView, coordinator: CoordinatorHandle, plan: list[list[Piece]], spec: LoopSpec
    ) -> bool:
        """A compute loop on every live worker. Returns whether a live member's loop was started over
        (it needs a fence). The loop of a worker that is listed but silent (frozen) is kept: if it wakes,
        its old messages are refused and it asks for a new role."""
        restarted = False
        for addr in list(self.loops):
            if addr not in view.listed:
                self.loops.pop(addr).cancel()
        for addr in view.live:
            loop = self.loops.get(addr)
            if loop is not None and loop.done():
                self.collect(addr, loop)
                loop = None
                restarted = True
            if loop is None:
                self.restarts[addr] = self.restarts.get(addr, 0) + 1
                self._serial += 1
                self.loops[addr] = self.client.submit(
                    run_loop, self.prepared.mode.loop, spec, coordinator, plan,
                    self.prepared.persistence.layout, self.prepared.batches,
                    key=f"{self.key_prefix}-compute-{addr}-{self._serial}",
                    workers=[addr], allow_other_workers=False, pure=False,
                )  # fmt: skip
        return restarted

    def collect(self, addr: str, loop: Future) -> None:
        if loop.status == "finished":
            self.stats.append(loop.result())
        elif loop.status == "error":
            error = loop.exception()
            if isinstance(error, FatalError):
                raise error  # a shard said the job cannot go on: no restart would help
            self.failures += 1
            # With its traceback: which call failed is what tells a restart that helps from one that cannot.
            log.warning(
                "job %s: compute loop on %s ended with %r", self.job.job_id, addr, error, exc_info=error
            )
            if self.restarts.get(addr, 0) > MAX_LOOP_RESTARTS:
                # An error that survives restarts (the model does not import there, a version mismatch)
                # would otherwise keep the worker a member that never trains.
                raise FatalError(
                    f"the compute loop on {addr} failed {self.restarts[addr]} times; last error: "
                    f"{type(error).__name__}: {error}"
                )

    def stop(self) -> None:
        # Loops see `stop` within one work poll; wait for their stats briefly, then cancel what is left.
        deadline = time.monotonic() + 2.0
        for addr, loop in list(self.loops.items()):
            with contextlib.suppress(Exception):
                settled_result(loop, max(0.01, deadline - time.monotonic()))
            self.collect(addr, loop) if loop.done() else loop.cancel()
        self.loops.clear()
