"""Preparing a job: everything checked and decided before any cluster work (the inputs, the schedule, each
role's spec)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import Persistence
from ..data.batches import BatchMaker, BatchSpec
from ..data.fields import StepFields
from ..data.sources import SourceInfo
from ..dataset import partition_bounds
from ..errors import (
    JobConfigError,
)
from ..job import ElasticJob, RoleSpecs
from ..modes import Mode, mode_of_job
from ..schedule import Schedule
from ..wire.signals import DataFailure

log = logging.getLogger(__name__)


def build_schedule(job: ElasticJob, dataset: SourceInfo, mode: Mode) -> Schedule:
    sizes = tuple(
        stop - start
        for start, stop in (
            partition_bounds(dataset.length, job.data_servers, i) for i in range(job.data_servers)
        )
    )
    try:
        per_step = mode.batch_ids_per_step(job.micro_batches)
        return Schedule(
            sizes,
            job.batch_size,
            per_step,
            job.epochs,
            job.seed,
            block_rows(job, dataset),
            job.shuffle_window,
        )
    except ValueError as exc:
        raise JobConfigError("batch_size", job.batch_size, str(exc)) from exc


def block_rows(job: ElasticJob, dataset: SourceInfo) -> int:
    """The rows of a block of the shuffle (`Schedule.block_rows`; 0: every sample at random): the source's
    largest block, where the job asks for a shuffle by blocks or leaves it to the source, whose blocks on
    an object store cost a request each (Parquet's row groups, Arrow's record batches)."""
    shuffle = job.shuffle
    if shuffle is None:
        shuffle = "blocks" if dataset.object_store and dataset.kind in ("parquet", "datasets") else "samples"
    if shuffle == "samples" or not dataset.blocks:
        return 0
    return max(dataset.blocks)


def batch_spec(job: ElasticJob, dataset: SourceInfo, fields: StepFields, schedule: Schedule) -> BatchSpec:
    """What makes the job's batches, checked on the first samples of its first batch: a sample that does
    not read or samples that do not collate fail here, before any cluster work, naming the setting."""
    spec = BatchSpec(
        dataset,
        schedule,
        job.seed,
        fields,
        job.collate,
        job.data_cache_bytes,
        pipeline_on_compute(job, dataset),
        job.prefetch_batches,
    )
    maker = BatchMaker(spec)
    try:
        epoch, indices = schedule.samples(0)
        maker.of_samples(0, epoch, [int(i) for i in indices[:2]])
    except DataFailure as failure:
        setting = "collate" if "collate" in str(failure) and job.collate is not None else "dataset"
        value = job.collate if setting == "collate" else job.dataset
        raise JobConfigError(setting, value, f"its first samples do not make a batch: {failure}") from None
    finally:
        maker.close()
    return spec


def pipeline_on_compute(job: ElasticJob, dataset: SourceInfo) -> bool:
    """Whether the compute workers make the batches: where the job asks (`data_pipeline`); by default
    where a user's code runs on every sample (a Dataset factory's `__getitem__`, a `collate`), whose CPU
    must grow with the compute workers rather than stay on the few static workers; a columnar source read
    with torch's collate stays on the data servers, whose batches go out with the parameters
    (docs/design/data-pipeline.md)."""
    if job.data_pipeline is not None:
        return job.data_pipeline == "compute_workers"
    return dataset.kind == "factory" or job.collate is not None


@dataclass(frozen=True)
class Prepared:
    """A job checked and ready: everything decided before any cluster work."""

    job: ElasticJob
    dataset: SourceInfo
    batches: BatchSpec  # what makes its batches, in any process (`data/batches.py`)
    schedule: Schedule
    persistence: Persistence
    mode: Mode  # the parts of sync or async mode each role is handed (`modes.py`)
    specs: RoleSpecs  # the job's settings each role is handed (`job/specs.py`), not the whole job


def prepare(job: ElasticJob | str | os.PathLike[str]) -> Prepared:
    """Validate the job's inputs (model, loss, dataset, checkpoint folder) before touching a cluster."""
    if not isinstance(job, ElasticJob):
        job = ElasticJob.from_yaml(Path(job))
    dataset, fields = job.check_inputs()
    mode = mode_of_job(job)
    schedule = build_schedule(job, dataset, mode)
    batches = batch_spec(job, dataset, fields, schedule)
    layout, initial = job.initial_tensors()
    specs = job.role_specs
    persistence = Persistence(specs.checkpoint, layout, initial, mode.checkpoints)
    return Prepared(job, dataset, batches, schedule, persistence, mode, specs)
