"""The job registry's lease (`registry.py`): a job whose controller died is not left "running" in the
scheduler's metadata. The decision without a cluster; then a controller process SIGKILLed mid-run on a
real cluster, after which `read_progress` says its controller is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import Client

from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import Progress
from prefect_elastic.registry import (
    CONTROLLER_LOST,
    LEASE_SECONDS,
    ControllerSeen,
    controller_gone,
    read_progress,
)

from .conftest import held_training, make_job, top_up, wait_for

# -- the decision, without a cluster ------------------------------------------------------------------


def test_a_connected_controller_that_renews_its_lease_holds_its_job() -> None:
    for state in ("running", "waiting"):
        assert controller_gone(state, ControllerSeen(connected=True, renewed_ago=0.2)) is None
        assert controller_gone(state, ControllerSeen(True, LEASE_SECONDS)) is None, "at the limit, held"


def test_a_controller_whose_client_left_the_scheduler_is_gone_at_once() -> None:
    why = controller_gone("running", ControllerSeen(connected=False, renewed_ago=0.1))
    assert why is not None and "no longer connected" in why


def test_a_connected_controller_whose_lease_ran_out_is_gone() -> None:
    """Frozen (SIGSTOP) or cut off behind a network that keeps its connection open."""
    why = controller_gone("waiting", ControllerSeen(connected=True, renewed_ago=LEASE_SECONDS + 0.5))
    assert why is not None and "lease" in why and f"{LEASE_SECONDS + 0.5:.1f} s ago" in why
    assert controller_gone("running", ControllerSeen(True, 9.0), lease_seconds=10.0) is None


def test_a_job_that_ended_or_was_marked_lost_keeps_its_state() -> None:
    gone = ControllerSeen(connected=False, renewed_ago=3600.0)
    for state in ("done", "failed", CONTROLLER_LOST):
        assert controller_gone(state, gone) is None


# -- a real controller, SIGKILLed ---------------------------------------------------------------------

CONTROLLER = textwrap.dedent(
    """
    import sys
    from prefect_elastic import ElasticJob, train
    train(ElasticJob.from_yaml(sys.argv[1]), address=sys.argv[2])
    """
)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_sigkilled_controllers_job_reads_as_controller_lost_not_running(
    cluster: LocalElasticCluster, digits_url: str, tmp_path: Path
) -> None:
    """`train()` in a process of its own, as a flow run's would be; training stands at a step while the
    test reads the job's progress ("running"), SIGKILLs the process, and reads it again: the controller's
    client left the scheduler, so the job reads "controller-lost", saying why and what to do."""
    top_up(cluster, 2)
    job = make_job(digits_url, model="tests.models:held_mlp", epochs=1, job_id="registry-killed")
    spec = tmp_path / "job.yaml"
    spec.write_text(job.to_yaml())
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with held_training(), Client(cluster.scheduler_address, timeout=30) as client:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(spec), cluster.scheduler_address],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=os.getcwd(),
        )  # fmt: skip
        try:

            def running() -> Progress | None:
                p = read_progress(client, job.job_id)
                return p if p is not None and p.state == "running" and p.committed_steps >= 1 else None

            wait_for("the controller to publish a running job", running, 120)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

            def lost() -> Progress | None:
                p = read_progress(client, job.job_id)
                return p if p is not None and p.state != "running" else None

            p = wait_for("the job to read as not running", lost, 30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert p.state == CONTROLLER_LOST and p.failure_kind == CONTROLLER_LOST, p
        assert p.failure is not None and "registry-killed" in p.failure
        assert "no longer connected" in p.failure and "run it again" in p.failure, p.failure
        # Marked in the registry itself: the next reader is told the same.
        again = read_progress(client, job.job_id)
        assert again is not None and again.state == CONTROLLER_LOST
