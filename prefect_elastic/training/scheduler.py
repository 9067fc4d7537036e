"""The scheduler's loss: a job waits a few liveness intervals for its client to reconnect, then stops
with `SchedulerLostError`, saying where a new run resumes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..errors import (
    SchedulerLostError,
)
from .signals import SchedulerGone

if TYPE_CHECKING:
    from .run import TrainingRun

log = logging.getLogger(__name__)

# Liveness intervals (at least a second each) without a scheduler connection before the job stops: Dask's
# client tries to reconnect for 30 s, and a scheduler that restarts on the same address is back sooner.
SCHEDULER_LOST_INTERVALS = 3

# An error the controller meets is put down to the scheduler's loss if the client loses it within this long.
SCHEDULER_GRACE_SECONDS = 1.0

SCHEDULER_POLL_SECONDS = 0.05  # how often the client's connection is looked at while it is down


class SchedulerWatch:
    """(of a `TrainingRun`)"""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.job = run.job
        self.client = run.client

    def up(self) -> bool:
        """Whether the client has its scheduler. When it lost it, Dask cancelled every future of the job
        (its compute loops, its actors' keys): nothing comes back with the scheduler, so the job stops
        (`SchedulerGone`) within `SCHEDULER_LOST_INTERVALS` liveness intervals of the first sign."""
        if self.client.status == "running":
            self.run._scheduler_gone_since = None
            return True
        now = time.monotonic()
        if self.run._scheduler_gone_since is None:
            self.run._scheduler_gone_since = now
            log.warning("job %s: the connection to the Dask scheduler is lost", self.job.job_id)
        gone = now - self.run._scheduler_gone_since
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

    def lost_error(self, seconds: float) -> SchedulerLostError:
        """The error that stops a job without its scheduler, saying where to resume from: the last periodic
        checkpoint (and, if the client is back already, a last one written now)."""
        job, step = self.job, self.run.committed_seen
        if self.client.status == "running":  # (reached again: the job's futures are gone all the same)
            timeout = min(job.call_timeout, 10.0)
            with contextlib.suppress(Exception):
                step = self.run.calls.call(
                    self.run.coordinator.stop("the Dask scheduler was lost"), timeout=timeout
                )
            with contextlib.suppress(Exception):
                self.run.persistence.write(self.run.coordinator, self.run.shards, timeout)
        # (While the client reconnects, a call to an actor waits for the reconnection, 30 s, and fails: the
        # last periodic checkpoint is where the next run resumes.)
        written = self.run.persistence.last_written
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
            + f"); training stopped at step {step} of {self.run.schedule.total_steps}; {then}",
            checkpoint=written,
        )
