"""The Dask scheduler SIGKILLed mid-run: the controller stops the job at once with a `SchedulerLostError`
that names the scheduler and the checkpoint to resume from, and a new run of the job, once a scheduler and
workers are back, resumes there: every batch id exactly once, bitwise equal to the no-fault run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from prefect_elastic import SchedulerLostError, train
from prefect_elastic.checkpoint import CheckpointStore
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import Progress

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_the_scheduler_killed_mid_run_stops_the_job_and_a_new_run_resumes(
    reference: References, digits_url: str, tmp_path: Path
) -> None:
    folder = f"file://{tmp_path}/checkpoints"
    job = make_job(
        digits_url, "reassign", job_id="scheduler-lost", epochs=6, checkpoint=folder, checkpoint_every=1
    )
    store = CheckpointStore(folder)
    killed: list[str] = []
    with LocalElasticCluster(static_workers=2, elastic_workers=2) as first:

        def kill_the_scheduler(p: Progress) -> None:
            # Past a checkpoint and well before the end: the next run has something to resume from.
            if not killed and p.committed_steps >= 20 and store.names():
                killed.append(first.scheduler_address)
                pid = first.scheduler_pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)

        with pytest.raises(SchedulerLostError) as lost:
            train(job, cluster=first, on_progress=kill_the_scheduler)
    message = str(lost.value)
    assert killed and killed[0] in message, message
    assert lost.value.checkpoint is not None and lost.value.checkpoint in message
    assert "run the job again" in message

    with LocalElasticCluster(static_workers=2, elastic_workers=2) as second:  # a scheduler is back
        resumed = train(job, cluster=second)
    assert resumed.resumed_from == lost.value.checkpoint
    assert_same_parameters(resumed, reference(job))
    assert_ledger_exactly_once(resumed)
