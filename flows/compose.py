"""The training flow of the compose stack (docker-compose.yml): `flows/compose.py:compose_training`.

It is `elastic_training` on the stack's running Dask cluster (the deployment's `address`), with two
additions a stack run by hand and by its test needs: `overrides`, fields that replace those of the job file
for one run (``prefect deployment run elastic-training/compose -p overrides='{"epochs": 2}'``), and a
table artifact `<job>-result` with what the flow returned (steps, generation, workers lost and joined,
whether every batch id was committed exactly once), so the outcome can be read back from the server:
a flow's return value is not kept there unless results are persisted.

The flow has the name of the one it wraps, so its deployment reads `elastic-training/compose`. Registered
by the stack's Prefect worker from `flows/compose.prefect.yaml` (see docs/compose.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.states import State

from prefect_elastic.flow_reports import _artifact_key
from prefect_elastic.flows import elastic_training
from prefect_elastic.job import ElasticJob

__all__ = ["compose_training"]

JOB = Path(__file__).resolve().parent / "jobs" / "digits-compose.yaml"


@flow(name="elastic-training", log_prints=True)
def compose_training(
    job: str = str(JOB),
    address: str = "tcp://scheduler:8786",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any] | State:
    """Train the job in the YAML file `job`, with `overrides` applied, on the scheduler at `address`."""
    data = yaml.safe_load(Path(job).read_text())
    spec = ElasticJob.model_validate({**data, **(overrides or {})})
    # The wrapped flow's body runs in this flow run (not as a subflow), so its tasks, progress, membership
    # and summary artifacts, and the result below, all belong to one run.
    outcome = elastic_training.fn(spec, address=address)
    if not isinstance(outcome, dict):  # a Cancelled state: nothing was trained to the end
        return outcome
    lost = sum(len(e.get("left", [])) for e in outcome["events"])
    joined = sum(len(e.get("joined", [])) for e in outcome["events"])
    row = {k: v for k, v in outcome.items() if k != "events"} | {
        "workers_lost": lost,
        "workers_joined": joined,
    }
    create_table_artifact(
        [row],
        key=f"{_artifact_key(spec.job_id)}-result",
        description=f"what the run of job {spec.job_id} returned",
    )
    return outcome
