"""`flows/prefect.yaml` deploys against a real `prefect server start`: the work pool is created and
`prefect deploy` runs as a user would (subprocesses, cwd = repository root); the deployment, its
parameters and its cron schedule are read back over the REST API, and the server schedules flow runs. The
deployment test runs on SQLite and on PostgreSQL (`prefect_server_db`, see tests/prefect_harness.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_elastic import ElasticJob

from . import prefect_harness
from .prefect_harness import PrefectServer

# The Prefect server on SQLite and on PostgreSQL (tests/prefect_harness.py says for which tests, and why).
prefect_server_db = prefect_harness.prefect_server_db

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
POOL = "elastic-local"
FLOW, DEPLOYMENT = "elastic-training", "nightly"


def prefect(server: PrefectServer, *args: str) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).with_name("prefect")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "prefect"]
    return subprocess.run(
        [*cmd, "--no-prompt", *args],
        cwd=ROOT,
        env=server.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_example_job_is_valid() -> None:
    job = ElasticJob.from_yaml(ROOT / "flows" / "jobs" / "digits.yaml")
    assert job.model == "prefect_elastic.local.demo:digits_cnn"
    assert job.dataset == "file:///tmp/prefect-elastic/digits"


def test_deploy_creates_scheduled_deployment(prefect_server_db: PrefectServer) -> None:
    server = prefect_server_db
    created = prefect(server, "work-pool", "create", POOL, "--type", "process", "--overwrite")
    assert created.returncode == 0, created.stdout + created.stderr

    deployed = prefect(server, "deploy", "--all", "--prefect-file", "flows/prefect.yaml")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    with prefect_harness.rest_client(server.api_url) as api:
        response = api.get(f"/deployments/name/{FLOW}/{DEPLOYMENT}")
        assert response.status_code == 200, response.text
        deployment = response.json()
        assert deployment["entrypoint"] == "flows/train.py:elastic_training"
        assert deployment["parameters"] == {"job": "flows/jobs/digits.yaml"}
        assert deployment["work_pool_name"] == POOL
        assert deployment["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
        ]
        assert "job" in deployment["parameter_openapi_schema"]["properties"]
        [schedule] = deployment["schedules"]
        assert schedule["active"] is True
        assert schedule["schedule"]["cron"] == "0 2 * * *"
        assert schedule["schedule"]["timezone"] == "UTC"

        body = {
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
            "sort": "EXPECTED_START_TIME_ASC",
        }
        deadline = time.monotonic() + 30
        while not (runs := api.post("/flow_runs/filter", json=body).json()):
            assert time.monotonic() < deadline, "no scheduled flow runs for the deployment within 30 s"
            time.sleep(0.5)
    assert all(run["parameters"] == {"job": "flows/jobs/digits.yaml"} for run in runs)
    first = runs[0]["expected_start_time"]
    assert "T02:00:00" in first and (first.endswith("Z") or first.endswith("+00:00")), first
