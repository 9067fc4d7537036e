"""How a run ends: the last checkpoint written and the result collected (`finish`), or the public error
that says why it did not end well (`failure_error`, `unexpected`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..coordinator import ShardUnreachable
from ..errors import (
    DataServerLostError,
    FatalError,
    NotEnoughWorkersError,
    TrainingFailedError,
    TrainingStopped,
)
from ..messages import Outcome, Progress
from ..sharding import join
from .result import TrainResult

if TYPE_CHECKING:
    from .run import TrainingRun


def finish(run: TrainingRun, progress: Progress) -> TrainResult:
    """Write the last checkpoint and collect the result; raise what ended a failed or stopped run."""
    table = run.role_table
    coordinator, shards = table.coordinator, table.shards
    timeout = run.job.call_timeout
    if run.stopping and progress.state in ("running", "waiting"):
        # Every shard fenced and brought to one version, which is snapshotted: the last checkpoint
        # holds every step committed before the stop.
        run.calls.call(coordinator.stop("stopped by the controller"), timeout=3 * timeout)
        run.persistence.write(coordinator, shards, timeout)
    elif progress.state == "done":
        try:
            run.calls.call(coordinator.snapshot_now(), timeout=3 * timeout)
        except ShardUnreachable as exc:
            # Every step was applied, but a data server's worker died before the last snapshot (and
            # the result) could be read from it: its state since its last copy is gone with it.
            raise DataServerLostError(
                f"job {run.job.job_id} trained every step, but {exc} before its final state could be "
                "read; run the job again"
                + (
                    f": it resumes from the last checkpoint, {run.persistence.last_written}"
                    if run.persistence.last_written
                    else " (no checkpoint was written: set `checkpoint` to resume, not start over)"
                )
            ) from exc
        run.persistence.write(coordinator, shards, timeout)
    if run.stopping:
        run.compute.stop()
        raise TrainingStopped(
            f"job {run.job.job_id} stopped at step {progress.committed_steps} of {progress.total_steps}"
            + (f"; checkpoint {run.persistence.last_written}" if run.persistence.last_written else ""),
            checkpoint=run.persistence.last_written,
        )
    outcome: Outcome = coordinator.outcome().result(timeout=timeout)
    if progress.state == "failed":
        raise failure_error(progress)
    parts = [f.result(timeout=run.job.call_timeout) for f in [s.state() for s in shards]]
    # (Whole tensors: the parts of one split across data servers joined.)
    state = join(parts, table.plan, {n: t.shape for n, t in run.persistence.initial.items()})
    shard_phases = [f.result(timeout=timeout) for f in [s.phases() for s in shards]]
    run.compute.stop()
    return TrainResult(
        job=run.job,
        state_dict=run.persistence.layout.export(state),
        ledger=outcome.ledger,
        events=sorted([*outcome.events, *run.persistence.events], key=lambda e: e.time),
        history=outcome.history,
        generation=outcome.generation,
        counters={
            **outcome.counters,
            "loop_failures": run.compute.failures,
            "candidate_steps": sum(loop.candidate_steps for loop in run.compute.stats),
            "stale_refusals": sum(loop.refused for loop in run.compute.stats),
            # Sync mode: micro-batches trained for a member that had not pushed them (`stragglers.py`).
            "backups": sum(loop.backups for loop in run.compute.stats),
        },
        elapsed=time.monotonic() - run.started,
        total_steps=run.schedule.total_steps,
        total_batches=run.schedule.total_batches,
        loops=run.compute.stats,
        commit_times=outcome.commit_times,
        checkpoint=run.persistence.last_written,
        resumed_from=run.persistence.resumed_from,
        shard_phases=shard_phases,
        promotions=list(table.promotions),
        shard_plan=[[p.name for p in pieces] for pieces in table.plan],
    )


def failure_error(progress: Progress) -> FatalError:
    message = progress.failure or "training failed"
    if progress.failure_kind == "model":
        return TrainingFailedError(message, progress.failure_step, progress.failure_batch)
    if progress.failure_kind == "not-enough-workers":
        return NotEnoughWorkersError(message)
    if progress.failure_kind == "data-server-lost":
        return DataServerLostError(message)
    return FatalError(message)


def unexpected(run: TrainingRun, exc: BaseException) -> FatalError:
    """The public error for a failure no other error names (one of Dask's, a bug): what `train()`
    raises is always one of `errors.py`'s, and says where the job can go on from."""
    written = run.persistence.last_written
    then = (
        f"run the job again: it resumes from the last checkpoint, {written}"
        if written
        else "run the job again (it has no checkpoint to resume from, so it starts over)"
    )
    return FatalError(
        f"job {run.job.job_id} stopped at step {run.committed_seen} of {run.schedule.total_steps} "
        f"on an unexpected {type(exc).__name__}: {exc}; {then}, and if it happens again, report it "
        "with this message"
    )
