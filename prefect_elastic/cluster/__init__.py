"""The cluster side: what the engine needs of a Dask cluster, and nothing of the local harness.

- `static`: what a static worker is (`is_static_worker`, the one definition) and `KeepStaticWorkers`;
- `plugins`: the Dask plugins the engine installs on the scheduler, the workers and the nannies, and
  `scheduler_view_of_workers`, the rows the controller's view of the workers is made from;
- `workers`: what the controller asks of a worker process itself (`load_engine`, `answering`);
- `jobqueue`: static workers on a `SpecCluster` (every dask-jobqueue cluster), `StaticAwareAdaptive`,
  `Resubmit`, lifetimes before the walltime;
- `cluster_class`: a `cluster_class` by import path, imported keeping the caller's signal handlers;
- `connection`: `connect`, from a job's cluster settings to a scheduler address;
- `cores`: what CPU a worker may use (`cpu_share`: its CPU set, its cgroups' quotas, its machine), and
  a machine's workers together (`machines`, `machine_cores`).

Nothing here imports torch (the scheduler and every nanny unpickle the plugins and the functions that run
there), nor `prefect_elastic.local` (the harness is started by its import path when no cluster is given).
"""

from __future__ import annotations

from .cluster_class import import_keeping_signals, resolve_cluster_class
from .connection import (
    LOCAL_CLUSTER_CLASS,
    TLS_FILES,
    Connection,
    check_static_workers,
    connect,
    local_cluster_class,
    tls_security,
)
from .cores import CpuShare, cpu_share, machine_cores, machines
from .jobqueue import (
    STATIC_MARK,
    Resubmit,
    StaticAwareAdaptive,
    StaticWorkers,
    walltime_seconds,
    with_lifetime_before_walltime,
)
from .plugins import (
    GRACEFUL_STIMULI,
    SIGTERM_HAND_OVER_SECONDS,
    WORKER_EVENTS_TOPIC,
    AnnounceRunning,
    CloseOnSigterm,
    GracefulLeaves,
    NannyKeepsWorkerOnSigterm,
    graceful_leaves,
    has_plugin,
    scheduler_view_of_workers,
)
from .static import KeepStaticWorkers, is_static_worker
from .workers import ENGINE_MODULES, answering, load_engine

__all__ = [
    "ENGINE_MODULES",
    "GRACEFUL_STIMULI",
    "LOCAL_CLUSTER_CLASS",
    "SIGTERM_HAND_OVER_SECONDS",
    "STATIC_MARK",
    "TLS_FILES",
    "WORKER_EVENTS_TOPIC",
    "AnnounceRunning",
    "CloseOnSigterm",
    "Connection",
    "CpuShare",
    "GracefulLeaves",
    "KeepStaticWorkers",
    "NannyKeepsWorkerOnSigterm",
    "Resubmit",
    "StaticAwareAdaptive",
    "StaticWorkers",
    "answering",
    "check_static_workers",
    "connect",
    "cpu_share",
    "graceful_leaves",
    "has_plugin",
    "import_keeping_signals",
    "is_static_worker",
    "load_engine",
    "local_cluster_class",
    "machine_cores",
    "machines",
    "resolve_cluster_class",
    "scheduler_view_of_workers",
    "tls_security",
    "walltime_seconds",
    "with_lifetime_before_walltime",
]
