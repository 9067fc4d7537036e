"""Connecting a job to a Dask cluster the way prefect-dask users give one.

A cluster is given as an address, as a `cluster_class` (an import path or a class, such as
`distributed.LocalCluster` or `dask_jobqueue.SLURMCluster`) with `cluster_kwargs` and optional adaptive
bounds (`adapt_kwargs`), or not at all, which starts the local harness's cluster of real processes
(`LOCAL_CLUSTER_CLASS`, imported by its path only then: the engine imports nothing of
`prefect_elastic.local`). Every way registers `KeepStaticWorkers`; on a `SpecCluster` made here it adds the
static workers asked for and keeps the cluster at its plan (`jobqueue.py`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from distributed import Client
from distributed.security import Security

from ..errors import JobConfigError
from .cluster_class import resolve_cluster_class
from .jobqueue import (
    Resubmit,
    StaticAwareAdaptive,
    StaticWorkers,
    mark_ended_jobs_closed,
    with_lifetime_before_walltime,
)
from .static import KeepStaticWorkers

# The cluster started when none is given: the local harness's, named by its import path so that this
# package (the engine) never imports the harness; a job given a cluster never loads it.
LOCAL_CLUSTER_CLASS = "prefect_elastic.local.cluster:LocalElasticCluster"


def local_cluster_class() -> type:
    """The class of the cluster `connect` starts when none is given (`LOCAL_CLUSTER_CLASS`)."""
    module, _, name = LOCAL_CLUSTER_CLASS.partition(":")
    found: type = getattr(importlib.import_module(module), name)
    return found


@dataclass
class Connection:
    """Where the job runs: the scheduler address, and the cluster object when this process made it."""

    address: str
    cluster: Any = None
    made_here: bool = False
    static: StaticWorkers | None = None  # the static workers added to a cluster made here
    resubmit: Resubmit | None = None  # replaces the jobs of a cluster made here that ended


def check_static_workers(static_workers: Any, address: str | None, cluster: Any) -> int:
    """The number of static workers to add, checked before any cluster is made."""
    if static_workers is None:
        return 0
    if isinstance(static_workers, bool) or not isinstance(static_workers, int) or static_workers < 0:
        raise JobConfigError(
            "static_workers", static_workers, "give a whole number of static workers, 0 or more (2 is usual)"
        )
    if static_workers and address is not None:
        raise JobConfigError(
            "static_workers",
            static_workers,
            "a running scheduler (address=) has the workers it has: start static workers there with "
            "`dask worker ADDRESS --resources static=1`, or give a cluster_class instead of the address",
        )
    if static_workers and cluster is not None:
        raise JobConfigError(
            "static_workers",
            static_workers,
            "a cluster object made by the caller is not changed here: add static workers to it yourself "
            "(workers with the static resource), or give its cluster_class and cluster_kwargs instead",
        )
    return static_workers


TLS_FILES = {"ca_file": "tls_ca_file", "cert": "tls_client_cert", "key": "tls_client_key"}


def tls_security(tls: Mapping[str, str] | None) -> Security | None:
    """Dask's `Security` for a cluster with TLS, from the paths of a flow parameter (a deployment cannot
    pass a `Security` object): `{"ca_file": ..., "cert": ..., "key": ...}`, the authority that signed the
    cluster's certificates and this client's certificate and key (`key` may be left out when the
    certificate file holds it too). `None` gives `None`: Dask's `distributed.comm.tls` config applies."""
    if tls is None:
        return None
    if not isinstance(tls, Mapping):
        raise JobConfigError("tls", tls, 'give a mapping like {"ca_file": ..., "cert": ..., "key": ...}')
    unknown = sorted(set(tls) - set(TLS_FILES))
    if unknown:
        raise JobConfigError("tls", dict(tls), f"unknown keys {unknown}; the keys are {sorted(TLS_FILES)}")
    missing = [k for k in ("ca_file", "cert") if not tls.get(k)]
    if missing:
        raise JobConfigError("tls", dict(tls), f"{' and '.join(missing)} missing: a TLS client needs both")
    for key, path in tls.items():
        if not os.path.isfile(path):
            raise JobConfigError(f"tls.{key}", path, "no such file here (where the flow runs)")
    return Security(**{TLS_FILES[k]: v for k, v in tls.items()}, require_encryption=True)


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
    static_workers: int | None = None,
    static_start_timeout: float = 600.0,
    security: Security | None = None,
) -> Iterator[Connection]:
    """Yield a `Connection`; a cluster made here is closed on exit (a `cluster` object given is not).

    `static_workers`: static workers to add to the `cluster_class` made here (`jobqueue.StaticWorkers`),
    or the number of static worker processes of the local cluster started when nothing is given. Added
    ones must register within `static_start_timeout` seconds (their jobs may queue), or `FatalError`.
    `security`: Dask's `Security` for a cluster with TLS reached by `address` (a cluster object with TLS
    carries its own).
    """
    choices = {"address": address, "cluster_class": cluster_class, "cluster": cluster}
    given = [name for name, value in choices.items() if value is not None]
    if len(given) > 1:
        raise JobConfigError(given[1], choices[given[1]], f"give only one of {' and '.join(given)}")
    n_static = check_static_workers(static_workers, address, cluster)
    if cluster is not None:
        connection = Connection(cluster.scheduler_address, cluster)
    elif address is not None:
        connection = Connection(address)
    elif cluster_class is not None:
        kwargs = with_lifetime_before_walltime(dict(cluster_kwargs or {}))
        cluster = resolve_cluster_class(cluster_class)(**kwargs)
        connection = Connection(cluster.scheduler_address, cluster, made_here=True)
    else:
        cluster = local_cluster_class()(
            static_workers=local_static_workers if static_workers is None else n_static,
            elastic_workers=local_elastic_workers,
            static_resource=static_resource,
        ).start()
        connection = Connection(cluster.scheduler_address, cluster, made_here=True)
    try:
        # (A cluster object with TLS carries its own `Security`.)
        security = security or getattr(connection.cluster, "security", None)
        with Client(connection.address, set_as_default=False, security=security) as client:
            client.register_plugin(KeepStaticWorkers(static_resource), name=KeepStaticWorkers.name)
        if cluster_class is not None and hasattr(cluster, "worker_spec"):
            if n_static:
                connection.static = StaticWorkers(cluster, static_resource)
                connection.static.add(n_static)
            connection.resubmit = Resubmit(cluster, connection.static).start()
        if connection.static is not None:
            connection.static.wait(static_start_timeout)
        if adapt_kwargs:
            if cluster is None or not hasattr(cluster, "adapt"):
                raise JobConfigError(
                    "adapt_kwargs", adapt_kwargs, "adaptive scaling needs a cluster_class with adapt()"
                )
            if connection.static is not None:
                cluster.adapt(Adaptive=StaticAwareAdaptive, static=connection.static, **adapt_kwargs)
            else:
                cluster.adapt(**adapt_kwargs)
        yield connection
    finally:
        if connection.resubmit is not None:
            connection.resubmit.stop()
        if connection.made_here:
            mark_ended_jobs_closed(connection.cluster)
            connection.cluster.close()
