"""Preparing a job: everything checked and decided before any cluster work (the inputs, the schedule)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import Persistence
from ..dataset import DatasetInfo, partition_bounds
from ..errors import (
    JobConfigError,
)
from ..job import ElasticJob
from ..schedule import Schedule

log = logging.getLogger(__name__)


def build_schedule(job: ElasticJob, dataset: DatasetInfo) -> Schedule:
    sizes = tuple(
        stop - start
        for start, stop in (
            partition_bounds(dataset.total, job.data_servers, i) for i in range(job.data_servers)
        )
    )
    try:
        # Async mode applies every micro-batch on its own: a step is one batch id.
        per_step = 1 if job.mode == "async" else job.micro_batches
        return Schedule(sizes, job.batch_size, per_step, job.epochs, job.seed)
    except ValueError as exc:
        raise JobConfigError("batch_size", job.batch_size, str(exc)) from exc


@dataclass(frozen=True)
class Prepared:
    """A job checked and ready: everything decided before any cluster work."""

    job: ElasticJob
    dataset: DatasetInfo
    schedule: Schedule
    persistence: Persistence


def prepare(job: ElasticJob | str | os.PathLike[str]) -> Prepared:
    """Validate the job's inputs (model, loss, dataset, checkpoint folder) before touching a cluster."""
    if not isinstance(job, ElasticJob):
        job = ElasticJob.from_yaml(Path(job))
    dataset = job.check_inputs()
    schedule = build_schedule(job, dataset)
    layout, initial = job.initial_tensors()
    return Prepared(job, dataset, schedule, Persistence(job, layout, initial))


def _async_snapshot_every(job: ElasticJob) -> int:
    """Survival checks between two snapshots in async mode (0: none), each a brief pause of every shard: a
    checkpoint's (`checkpoint_every`), or, with peer replicas, what a standby goes back to when a data
    server's worker dies (else it would go back to the start)."""
    if job.mode != "async":
        return 0
    if job.checkpoint or (job.peer_replicas and job.data_servers > 1):
        return job.checkpoint_every
    return 0
