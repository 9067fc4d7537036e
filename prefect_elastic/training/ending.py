"""How a run ends (`Ending`, made by `TrainingRun` with the owners it reads): the last checkpoint written
and the result collected (`finish`), or the public error that says why it did not end well
(`failure_error`, `unexpected`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..checkpoint import Persistence
from ..coordinator import ShardUnreachable
from ..errors import (
    DataServerLostError,
    FatalError,
    NotEnoughWorkersError,
    TrainingFailedError,
    TrainingStopped,
)
from ..job import ElasticJob
from ..messages import Outcome, Progress
from ..schedule import Schedule
from ..sharding import join
from .calls import Calls
from .loops import ComputeLoops
from .result import TrainResult
from .role_table import RoleTable


@dataclass(frozen=True)
class Ending:
    """How a run ends, from the owners it reads: the job and its schedule, the role table (the coordinator
    and the shards, read when the run ends), the calls, the checkpoint store and the compute loops."""

    job: ElasticJob
    schedule: Schedule
    role_table: RoleTable
    calls: Calls
    persistence: Persistence
    compute: ComputeLoops

    def finish(self, progress: Progress, *, stopping: bool, started: float) -> TrainResult:
        """Write the last checkpoint and collect the result; raise what ended a failed or stopped run.
        `stopping`: the controller was asked to stop; `started`: when the run started (monotonic)."""
        job, table, persistence, compute = self.job, self.role_table, self.persistence, self.compute
        coordinator, shards = table.coordinator, table.shards
        timeout = job.call_timeout
        if stopping and progress.state in ("running", "waiting"):
            # Every shard fenced and brought to one version, which is snapshotted: the last checkpoint
            # holds every step committed before the stop.
            self.calls.call(coordinator.stop("stopped by the controller"), timeout=3 * timeout)
            persistence.write(coordinator, shards, timeout)
        elif progress.state == "done":
            try:
                self.calls.call(coordinator.snapshot_now(), timeout=3 * timeout)
            except ShardUnreachable as exc:
                # Every step was applied, but a data server's worker died before the last snapshot (and
                # the result) could be read from it: its state since its last copy is gone with it.
                raise DataServerLostError(
                    f"job {job.job_id} trained every step, but {exc} before its final state could be "
                    "read; run the job again"
                    + (
                        f": it resumes from the last checkpoint, {persistence.last_written}"
                        if persistence.last_written
                        else " (no checkpoint was written: set `checkpoint` to resume, not start over)"
                    )
                ) from exc
            persistence.write(coordinator, shards, timeout)
        if stopping:
            compute.stop()
            raise TrainingStopped(
                f"job {job.job_id} stopped at step {progress.committed_steps} of {progress.total_steps}"
                + (f"; checkpoint {persistence.last_written}" if persistence.last_written else ""),
                checkpoint=persistence.last_written,
            )
        outcome: Outcome = coordinator.outcome().result(timeout=timeout)
        if progress.state == "failed":
            raise failure_error(progress)
        parts = [f.result(timeout=job.call_timeout) for f in [s.state() for s in shards]]
        # (Whole tensors: the parts of one split across data servers joined.)
        state = join(parts, table.plan, {n: t.shape for n, t in persistence.initial.items()})
        shard_phases = [f.result(timeout=timeout) for f in [s.phases() for s in shards]]
        compute.stop()
        return TrainResult(
            job=job,
            state_dict=persistence.layout.export(state),
            ledger=outcome.ledger,
            events=sorted([*outcome.events, *persistence.events], key=lambda e: e.time),
            history=outcome.history,
            generation=outcome.generation,
            counters={
                **outcome.counters,
                "loop_failures": compute.failures,
                "candidate_steps": sum(loop.candidate_steps for loop in compute.stats),
                "stale_refusals": sum(loop.refused for loop in compute.stats),
                # Sync mode: micro-batches trained for a member that had not pushed them (`stragglers.py`).
                "backups": sum(loop.backups for loop in compute.stats),
            },
            elapsed=time.monotonic() - started,
            total_steps=self.schedule.total_steps,
            total_batches=self.schedule.total_batches,
            loops=compute.stats,
            commit_times=outcome.commit_times,
            checkpoint=persistence.last_written,
            resumed_from=persistence.resumed_from,
            shard_phases=shard_phases,
            promotions=list(table.promotions),
            shard_plan=[[p.name for p in pieces] for pieces in table.plan],
        )

    def unexpected(self, exc: BaseException, committed: int) -> FatalError:
        """The public error for a failure no other error names (one of Dask's, a bug), at step `committed`:
        what `train()` raises is always one of `errors.py`'s, and says where the job can go on from."""
        written = self.persistence.last_written
        then = (
            f"run the job again: it resumes from the last checkpoint, {written}"
            if written
            else "run the job again (it has no checkpoint to resume from, so it starts over)"
        )
        return FatalError(
            f"job {self.job.job_id} stopped at step {committed} of {self.schedule.total_steps} "
            f"on an unexpected {type(exc).__name__}: {exc}; {then}, and if it happens again, report it "
            "with this message"
        )


def failure_error(progress: Progress) -> FatalError:
    message = progress.failure or "training failed"
    if progress.failure_kind in ("model", "data"):
        return TrainingFailedError(message, progress.failure_step, progress.failure_batch)
    if progress.failure_kind == "not-enough-workers":
        return NotEnoughWorkersError(message)
    if progress.failure_kind == "data-server-lost":
        return DataServerLostError(message)
    return FatalError(message)
