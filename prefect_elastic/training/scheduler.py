"""The scheduler's loss: a job waits a few liveness intervals for its client to reconnect, then stops
with `SchedulerLostError`, saying where a new run resumes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import (
    SchedulerLostError,
)
from .signals import SchedulerGone

if TYPE_CHECKING:
    from distributed import Client

    from ..job import ElasticJob

log = logging.getLogger(__name__)

# Liveness intervals (at least a second each) without a scheduler connection before the job stops: Dask's
# client tries to reconnect for 30 s, and a scheduler that restarts on the same address is back sooner.
SCHEDULER_LOST_INTERVALS = 3

# An error the controller meets is put down to the scheduler's loss if the client loses it within this long.
SCHEDULER_GRACE_SECONDS = 1.0

SCHEDULER_POLL_SECONDS = 0.05  # how often the client's connection is looked at while it is down


class SchedulerWatch:
    """The client's connection to the scheduler, and since when it has been lost."""

    def __init__(self, client: Client, job: ElasticJob) -> None:
        self.client = client
        self.job = job
        self.gone_since: float | None = None  # since when the client has had no scheduler

    def up(self) -> bool:
        """Whether the client has its scheduler. When it lost it, Dask cancelled every future of the job
        (its compute loops, its actors' keys): nothing comes back with the scheduler, so the job stops
        (`SchedulerGone`) within `SCHEDULER_LOST_INTERVALS` liveness intervals of the first sign."""
        if self.client.status == "running":
            self.gone_since = None
            return True
        now = time.monotonic()
        if self.gone_since is None:
            self.gone_since = now
            log.warning("job %s: the connection to the Dask scheduler is lost", self.job.job_id)
        gone = now - self.gone_since
        if self.client.status in ("closing", "closed") or gone >= SCHEDULER_LOST_INTERVALS * max(
            1.0, self.job.liveness_interval
        ):
            raise SchedulerGone(gone)
        return False

    def lost_within(self, grace: float) -> bool:
        """Whether the client lost its scheduler, or loses it within `grace` seconds: a call to the
        scheduler that broke because the scheduler died can fail before the client has seen its own
        connection close (CI: the coordinator's rebuild failed with a raw CommClosedError, the client still
        "running")."""
        deadline = time.monotonic() + grace
        while self.client.status == "running":
            if time.monotonic() >= deadline:
                return False
            time.sleep(SCHEDULER_POLL_SECONDS)
        return True

    def lost_error(
        self,
        seconds: float,
        step: int,
        total_steps: int,
        persistence: Any,
        last_words: Callable[[float], int],
    ) -> SchedulerLostError:
        """The error that stops a job without its scheduler at `step`, saying where to resume from: the
        last periodic checkpoint of `persistence` (and, if the client is back already, a last one written
        now by `last_words`, which stops the coordinator and returns its step)."""
        job = self.job
        if self.client.status == "running":  # (reached again: the job's futures are gone all the same)
            with contextlib.suppress(Exception):
                step = last_words(min(job.call_timeout, 10.0))
        # (While the client reconnects, a call to an actor waits for the reconnection, 30 s, and fails: the
        # last periodic checkpoint is where the next run resumes.)
        written = persistence.last_written
        where = self.client.scheduler.address if self.client.scheduler is not None else "?"
        if written:
            then = f"the last checkpoint is {written}: once a scheduler and workers are back, run the job "
            then += "again; it resumes there"
        elif job.checkpoint:
            then = "no checkpoint was written yet, so a new run starts over"
        else:
            then = "the job has no checkpoint, so a new run starts over (set `checkpoint` to resume instead)"
        return SchedulerLostError(
            f"job {job.job_id} lost the Dask scheduler at {where} (it died, or its host did"
            + (f"; no connection for {seconds:.1f} s" if seconds >= 0.1 else "")
            + f"); training stopped at step {step} of {total_steps}; {then}",
            checkpoint=written,
        )
