"""Preparing a job: everything checked and decided before any cluster work (the inputs, the schedule, each
role's spec)."""

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
from ..job import ElasticJob, RoleSpecs
from ..modes import Mode, mode_of_job
from ..schedule import Schedule

log = logging.getLogger(__name__)


def build_schedule(job: ElasticJob, dataset: DatasetInfo, mode: Mode) -> Schedule:
    sizes = tuple(
        stop - start
        for start, stop in (
            partition_bounds(dataset.total, job.data_servers, i) for i in range(job.data_servers)
        )
    )
    try:
        per_step = mode.batch_ids_per_step(job.micro_batches)
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
    mode: Mode  # the parts of sync or async mode each role is handed (`modes.py`)
    specs: RoleSpecs  # the job's settings each role is handed (`job/specs.py`), not the whole job


def prepare(job: ElasticJob | str | os.PathLike[str]) -> Prepared:
    """Validate the job's inputs (model, loss, dataset, checkpoint folder) before touching a cluster."""
    if not isinstance(job, ElasticJob):
        job = ElasticJob.from_yaml(Path(job))
    dataset = job.check_inputs()
    mode = mode_of_job(job)
    schedule = build_schedule(job, dataset, mode)
    layout, initial = job.initial_tensors()
    specs = job.role_specs
    persistence = Persistence(specs.checkpoint, layout, initial, mode.checkpoints)
    return Prepared(job, dataset, schedule, persistence, mode, specs)
