"""The deployable training flow: `flows/train.py:elastic_training` is the entrypoint in `prefect.yaml`.

Deploy it to a work pool (see docs/deploy.md), or serve it without one from the repository root:

    python flows/train.py

which registers the deployment `elastic-training/nightly-serve` (the digits job, nightly at 02:00 UTC) and
runs its flow runs in this process until interrupted.
"""

from __future__ import annotations

from pathlib import Path

from prefect_elastic.flows import elastic_training

__all__ = ["elastic_training"]

JOB = Path(__file__).resolve().parent / "jobs" / "digits.yaml"
CRON = "0 2 * * *"  # nightly at 02:00 (UTC when served, as in prefect.yaml)


def serve() -> None:
    from prefect.schedules import Cron

    elastic_training.serve(
        name="nightly-serve",
        schedule=Cron(CRON, timezone="UTC"),
        parameters={"job": str(JOB)},
        tags=["prefect-elastic"],
        description="Nightly elastic training of the digits CNN (served, no work pool).",
    )


if __name__ == "__main__":
    serve()
