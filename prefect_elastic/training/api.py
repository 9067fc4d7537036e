"""`train(job, address=... | cluster=...)`: the controller's entry point for users, and its client."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from distributed import Client
from distributed.security import Security

from ..errors import (
    FatalError,
    JobConfigError,
)
from ..job import ElasticJob
from ..messages import (
    MembershipEvent,
    Progress,
)
from .prepare import prepare
from .result import FaultInjector, TrainResult
from .run import TrainingRun

log = logging.getLogger(__name__)


def train(
    job: ElasticJob | str | os.PathLike[str],
    address: str | None = None,
    cluster: Any = None,
    *,
    on_progress: Callable[[Progress], None] | None = None,
    on_event: Callable[[MembershipEvent], None] | None = None,
    faults: FaultInjector | None = None,
    stop: threading.Event | None = None,
    security: Security | None = None,
) -> TrainResult:
    """Train `job` on the Dask cluster at `address` (or the `cluster` object) and return the result.

    Raises `JobConfigError` before any cluster work for an impossible job, `TrainingFailedError` when the
    model raises or the loss is not finite, `NotEnoughWorkersError` when fewer than `min_workers` compute
    workers stay alive for longer than `min_workers_timeout`, `DataServerLostError` when a static worker
    holding a data server or the coordinator dies, `TrainingStopped` when `stop` is set (after a final
    checkpoint), `CheckpointMismatchError` when `job.checkpoint` holds a checkpoint of another job or model.
    With `job.checkpoint` set, a run resumes from the latest checkpoint there. `security`: Dask's
    `Security` for a cluster with TLS (by default the `security` of the `cluster` object, if it has one);
    the step path's own connections then use TLS too, with the workers' certificates.
    """
    prepared = prepare(job)
    if (address is None) == (cluster is None):
        raise JobConfigError("address", address, "give exactly one of address= or cluster=")
    if isinstance(cluster, str):
        # As distributed.Client does: a scheduler address given where a cluster object was expected.
        address, cluster = cluster, None
    if address is not None:
        target = address
    elif isinstance(getattr(cluster, "scheduler_address", None), str):
        target = cluster.scheduler_address
    else:
        raise JobConfigError(
            "cluster",
            cluster,
            "not a Dask cluster object (it has no scheduler_address); give a cluster such as "
            "LocalCluster or SLURMCluster, or a scheduler address as address='tcp://host:8786'",
        )
    if faults is not None and cluster is not None:
        faults.bind(cluster)
    if security is None:
        # A cluster object with TLS (LocalElasticCluster(security=True), any distributed cluster made with
        # a Security) carries the client's certificates.
        security = getattr(cluster, "security", None)
    with connect_client(target, prepared.job.call_timeout, security) as client:
        run = TrainingRun(
            client, prepared, on_progress=on_progress, on_event=on_event, faults=faults, stop=stop,
            cluster=cluster,
        )  # fmt: skip
        # Actor handles bind to the current client on first use; make it ours, not a global default.
        with client.as_current():
            try:
                # (Each phase raises only public errors: `TrainingRun.public_error`.)
                run.start()
                return run.finish(run.supervise())
            finally:
                run.release()


def connect_client(address: str, timeout: float, security: Security | None = None) -> Client:
    """A client of the scheduler at `address`; a refused connection fails at once, naming the address,
    instead of being retried for the whole timeout."""
    from distributed.comm import parse_address

    try:
        scheme, location = parse_address(address)
    except Exception as exc:
        raise JobConfigError("address", address, f"not a scheduler address ({exc})") from exc
    if scheme in ("tcp", "tls") and ":" in location:
        import socket

        host, _, port = location.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 5.0)):
                pass
        except (OSError, ValueError) as exc:
            raise FatalError(
                f"no Dask scheduler answers at {address} ({exc}); start one (`dask scheduler`) or give "
                "the address it listens on"
            ) from exc
    return Client(address, set_as_default=False, timeout=timeout, security=security)
