"""Connecting a job to a Dask cluster the way prefect-dask users give one, and keeping static workers.

A cluster is given as an address, as a `cluster_class` (an import path or a class, such as
`distributed.LocalCluster` or `dask_jobqueue.SLURMCluster`) with `cluster_kwargs` and optional adaptive
bounds (`adapt_kwargs`), or not at all, which starts a `LocalElasticCluster` of real local processes
(`prefect_elastic.local`, imported only then).

`is_static_worker` is the one definition of a static worker (one that carries the static resource), for
every role that tells static from elastic workers. Adaptive scale-down retires workers that hold actors
anyway; `KeepStaticWorkers`, a scheduler plugin, takes static workers out of every scale-down, so the data
servers and the coordinator are never retired by it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from .errors import JobConfigError

log = logging.getLogger(__name__)


def is_static_worker(info: Mapping[str, Any], resource: str = "static") -> bool:
    """Whether a worker is static: it carries a positive amount of `resource` (``--resources static=1``).

    `info` is the scheduler's view of one worker (an entry of `Client.scheduler_info()["workers"]`, or
    anything with its ``resources``); a worker with ``static=0`` could run no task that needs the resource,
    so it is elastic.
    """
    resources = info.get("resources") or {}
    return float(resources.get(resource, 0)) > 0


class KeepStaticWorkers(SchedulerPlugin):
    """Scheduler plugin: adaptive scale-down may only pick workers without the static resource."""

    name = "prefect-elastic-keep-static-workers"

    def __init__(self, resource: str = "static") -> None:
        self.resource = resource

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        # The scheduler hands over its WorkerState objects, whose resources are an attribute.
        return [ws for ws in workers if not is_static_worker({"resources": ws.resources}, self.resource)]


@dataclass
class Connection:
    """Where the job runs: the scheduler address, and the cluster object when this process made it."""

    address: str
    cluster: Any = None
    made_here: bool = False


def resolve_cluster_class(spec: str | type) -> type:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.replace(":", ".").rpartition(".")
    try:
        found: type = getattr(importlib.import_module(module), name)
        return found
    except (ImportError, AttributeError, ValueError) as exc:
        raise JobConfigError(
            "cluster_class",
            spec,
            f"cannot be imported ({exc}); give an import path such as distributed.LocalCluster",
        ) from exc


@contextlib.contextmanager
def connect(
    address: str | None = None,
    cluster_class: str | type | None = None,
    cluster_kwargs: dict[str, Any] | None = None,
    adapt_kwargs: dict[str, Any] | None = None,
    *,
    cluster: Any = None,
    static_resource: str = "static",
    local_static_workers: int = 2,
    local_elastic_workers: int = 2,
) -> Iterator[Connection]:
    """Yield a `Connection`; a cluster made here is closed on exit (a `cluster` object given is not)."""
    choices = {"address": address, "cluster_class": cluster_class, "cluster": cluster}
    given = [name for name, value in choices.items() if value is not None]
    if len(given) > 1:
        raise JobConfigError(given[1], choices[given[1]], f"give only one of {' and '.join(given)}")
    if cluster is not None:
        connection = Connection(cluster.scheduler_address, cluster)
    elif address is not None:
        connection = Connection(address)
    elif cluster_class is not None:
        cluster = resolve_cluster_class(cluster_class)(**(cluster_kwargs or {}))
        connection = Connection(cluster.scheduler_address, cluster, made_here=True)
    else:
        from .local.cluster import LocalElasticCluster

        cluster = LocalElasticCluster(
            static_workers=local_static_workers,
            elastic_workers=local_elastic_workers,
            static_resource=static_resource,
        ).start()
        connection = Connection(cluster.scheduler_address, cluster, made_here=True)
    try:
        with Client(connection.address, set_as_default=False) as client:
            client.register_plugin(KeepStaticWorkers(static_resource), name=KeepStaticWorkers.name)
        if adapt_kwargs:
            if cluster is None or not hasattr(cluster, "adapt"):
                raise JobConfigError(
                    "adapt_kwargs", adapt_kwargs, "adaptive scaling needs a cluster_class with adapt()"
                )
            cluster.adapt(**adapt_kwargs)
        yield connection
    finally:
        if connection.made_here:
            connection.cluster.close()
