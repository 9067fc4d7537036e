"""The job registry (seed 003): roles of a job register under its job id in the scheduler's metadata.

`["prefect-elastic", "jobs", <job_id>]` holds the controller that runs the job (its client id and run id)
and, under `"progress"`, the last progress it published. A second controller of a job id that a
connected controller holds is refused; an entry left by a controller that died is taken over. Check and
set run as one function on the scheduler, so two controllers started at once cannot both pass.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from distributed import Client

if TYPE_CHECKING:
    # (Imported where used: the scheduler imports this module for `_claim`, and messages.py imports torch.)
    from .messages import Progress


def _key(job_id: str) -> list[str]:
    return ["prefect-elastic", "jobs", job_id]


def claim_job(client: Client, job_id: str, run_id: str) -> dict[str, Any] | None:
    """Register this run under `job_id`; returns the live holder instead when there is one."""
    holder: dict[str, Any] | None = client.run_on_scheduler(
        _claim, key=_key(job_id), claim={"client": client.id, "run": run_id}
    )
    return holder


def release_job(client: Client, job_id: str, run_id: str) -> None:
    """Unregister, unless another run took the job id over meanwhile."""
    client.run_on_scheduler(_release, key=_key(job_id), run=run_id)


def publish_progress(client: Client, job_id: str, progress: Progress) -> None:
    client.set_metadata([*_key(job_id), "progress"], asdict(progress))


def read_progress(client: Client, job_id: str) -> Progress | None:
    """The latest progress the controller of `job_id` published on this cluster (None before it starts)."""
    try:
        found = client.get_metadata([*_key(job_id), "progress"], default=None)
    except (KeyError, TypeError):  # the job's entry is None between runs
        return None
    if not found:
        return None
    from .messages import Progress

    found["workers"] = tuple(found["workers"])
    found["holding"] = tuple(tuple(h) for h in found["holding"])
    return Progress(**found)


def _claim(dask_scheduler: Any, key: list[str], claim: dict[str, str]) -> dict[str, str] | None:
    """On the scheduler: register `claim` under `key` unless a connected controller holds it already."""
    holder = dask_scheduler.get_metadata(keys=key, default=None)
    if holder is not None and holder.get("client") in dask_scheduler.clients:
        return dict(holder)
    dask_scheduler.set_metadata(keys=key, value={**claim, "started": time.time()})
    return None


def _release(dask_scheduler: Any, key: list[str], run: str) -> None:
    holder = dask_scheduler.get_metadata(keys=key, default=None)
    if holder is not None and holder.get("run") == run:
        dask_scheduler.set_metadata(keys=key, value=None)
