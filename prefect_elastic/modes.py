"""Sync and async mode: the one place that asks which mode a job trains in.

A job's `mode` (`ElasticJob.mode`) is turned into a `Mode` once, when the job is prepared
(`training.prepare`), and every role is handed the parts of it that it uses: the coordinator its commit
bookkeeping (`SyncCommits` or `AsyncLeases`), each data server its apply (`SyncApplies` or
`AsyncApplies`), each compute loop its loop (`SyncLoop` or `AsyncLoop`), the checkpoint writer its cadence;
and the controller the few decisions of its own that differ (below). Outside this module no code asks
which mode it is in. Why async mode differs: docs/design/async.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint.cadence import AsyncCheckpoints, CheckpointCadence, SyncCheckpoints
from .compute.async_loop import AsyncLoop
from .compute.loop import Loop
from .compute.sync_loop import SyncLoop
from .coordinator.async_leases import AsyncLeases
from .coordinator.commit_book import CommitBook
from .coordinator.sync_commits import SyncCommits
from .data_server.apply import AsyncApplies, SyncApplies
from .data_server.step_applies import ApplyMode
from .errors import JobConfigError
from .job import ElasticJob
from .schedule import Schedule


@dataclass(frozen=True)
class Mode:
    """Everything that differs between the two modes, as parts for the roles and decisions for the
    controller."""

    name: str
    commits: type[CommitBook]  # the coordinator's bookkeeping of commits
    applies: ApplyMode  # how a data server applies gradients
    loop: Loop  # what a compute loop runs
    checkpoints: CheckpointCadence  # how snapshots become checkpoints, and which ones a run resumes from
    # A step is one batch id (each micro-batch applied on its own), or `micro_batches` of them.
    one_batch_a_step: bool
    # Each shard stands at a version of its own: a lost one is restored from its own snapshot, and the
    # shards cannot all go back to one checkpoint in the middle of a run.
    shards_apart: bool
    # The coordinator's worker keeps its role while silent: its loss ends the job (no rebuild from the
    # shards' records), so silence alone must not cost it.
    coordinator_kept_while_silent: bool
    # Gradients may be applied to newer parameters than they were computed on (the flow's summary shows
    # how stale, and how many candidate steps the workers took).
    stale_gradients: bool
    # A micro-batch's gradients may leave in buckets during backward (`ElasticJob.overlap_push`): a shard
    # sums them as they come and applies at the step's seals. Async mode applies each micro-batch whole.
    overlaps_push: bool

    def describe(self, job: ElasticJob, schedule: Schedule, lease: int) -> str:
        """What the run is, as its start logs it."""
        if self.one_batch_a_step:
            return (
                f"job {job.job_id}: async mode, {schedule.total_batches} batch ids of {job.batch_size} "
                f"applied one by one (max staleness {job.max_staleness}), {job.data_servers} data "
                f"servers, leases of {max(lease, job.micro_batches)}"
            )
        return (
            f"job {job.job_id}: {schedule.total_steps} steps of {job.micro_batches} micro-batches of "
            f"{job.batch_size}, {job.data_servers} data servers, policy {job.on_membership_change}"
        )

    def batch_ids_per_step(self, micro_batches: int) -> int:
        return 1 if self.one_batch_a_step else micro_batches

    def snapshot_every_checks(self, checkpoint_every: int, checkpointed: bool, replicas: bool) -> int:
        """Survival checks between two snapshots the coordinator asks for (0: none of its own; sync mode
        snapshots as the steps commit). In async mode each is a brief pause of every shard: for a
        checkpoint (`checkpoint_every`), or, with peer replicas, what a standby goes back to when a data
        server's worker dies (else it would go back to the start)."""
        if self.shards_apart and (checkpointed or replicas):
            return checkpoint_every
        return 0


SYNC = Mode(
    name="sync",
    commits=SyncCommits,
    applies=SyncApplies,
    loop=SyncLoop(),
    checkpoints=SyncCheckpoints(),
    one_batch_a_step=False,
    shards_apart=False,
    coordinator_kept_while_silent=False,
    stale_gradients=False,
    overlaps_push=True,
)
ASYNC = Mode(
    name="async",
    commits=AsyncLeases,
    applies=AsyncApplies,
    loop=AsyncLoop(),
    checkpoints=AsyncCheckpoints(),
    one_batch_a_step=True,
    shards_apart=True,
    coordinator_kept_while_silent=True,
    stale_gradients=True,
    overlaps_push=False,
)
MODES = {m.name: m for m in (SYNC, ASYNC)}


def mode_of(name: str) -> Mode:
    """The `Mode` named `name` (`ElasticJob.mode`)."""
    try:
        return MODES[name]
    except KeyError:
        raise JobConfigError("mode", name, f"give one of {sorted(MODES)}") from None


def mode_of_job(job: ElasticJob) -> Mode:
    """The job's `Mode`, once its settings that only one mode has are checked against it."""
    mode = mode_of(job.mode)
    if job.overlap_push and not mode.overlaps_push:
        raise JobConfigError(
            "overlap_push",
            True,
            f"gradients leave during backward in sync mode only ({mode.name} mode applies each "
            "micro-batch whole as it arrives): set mode='sync', or leave overlap_push off",
        )
    if job.overlap_pull and not mode.overlaps_push:
        raise JobConfigError(
            "overlap_pull",
            True,
            f"parameters arrive in buckets during forward in sync mode only ({mode.name} mode answers "
            "each micro-batch with the whole model): set mode='sync', or leave overlap_pull off",
        )
    if job.overlap_pull and job.overlap_push is False:
        raise JobConfigError(
            "overlap_pull",
            True,
            "the parameters come back in the buckets the gradients leave in: leave overlap_push on "
            "(True, or None for the engine to choose), or overlap_pull off",
        )
    return mode
