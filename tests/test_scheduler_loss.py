"""The Dask scheduler SIGKILLed mid-run: the controller stops the job at once with a `SchedulerLostError`
that names the scheduler and the checkpoint to resume from, and a new run of the job, once a scheduler and
workers are back, resumes there: every batch id exactly once, bitwise equal to the no-fault run."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from distributed.comm.core import CommClosedError

from prefect_elastic import SchedulerLostError, train
from prefect_elastic.checkpoint import CheckpointStore
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import Progress
from prefect_elastic.training import TrainingRun
from prefect_elastic.training.scheduler import SchedulerWatch
from prefect_elastic.training.signals import CoordinatorLost

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job

pytestmark = [pytest.mark.timeout(300)]


@pytest.mark.cluster
@pytest.mark.heavy  # (a long fault run: in .ci/run's second stage, to keep the main suite under 20 minutes)
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


def test_a_rebuild_broken_by_the_schedulers_loss_ends_in_scheduler_lost_error() -> None:
    """The scheduler's SIGKILL breaks the controller's calls before its client sees the connection close:
    the coordinator's calls fail (CoordinatorLost) with the client still "running", and the rebuild's first
    call to the scheduler fails with a raw CommClosedError (seen in CI). That error is the scheduler's
    loss, said as such. No cluster: the controller's decision alone, on a client whose connection closes
    0.1 s after the error."""
    client = SimpleNamespace(status="running", scheduler=None)
    run = object.__new__(TrainingRun)
    run.client = client  # type: ignore[assignment]
    run.job = make_job("file:///nowhere", job_id="rebuild-scheduler-lost")
    run.committed_seen = 7
    run.schedule = SimpleNamespace(total_steps=56)  # type: ignore[assignment]
    run.persistence = SimpleNamespace(last_written=None)  # type: ignore[assignment]
    run.scheduler = SchedulerWatch(run.client, run.job)

    def lose_the_coordinator() -> None:
        raise CoordinatorLost("its static worker was lost")

    def rebuild_while_the_scheduler_dies(why: str) -> None:
        threading.Timer(0.1, lambda: setattr(client, "status", "connecting")).start()
        raise CommClosedError("in <TCP (closed) ConnectionPool.run_function>: Connection reset by peer")

    run._supervise = lose_the_coordinator  # type: ignore[method-assign]
    run.roles = SimpleNamespace(rebuild_coordinator=rebuild_while_the_scheduler_dies)  # type: ignore[assignment]
    with pytest.raises(SchedulerLostError, match="lost the Dask scheduler") as lost:
        run.supervise()
    assert "stopped at step 7 of 56" in str(lost.value)
