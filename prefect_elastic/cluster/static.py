"""What a static worker is: one that carries the static resource (``--resources static=1``).

`is_static_worker` is the one definition, for every role that tells static workers (which hold the data
servers and the coordinator) from elastic ones (which run compute loops and come and go). Adaptive
scale-down retires workers that hold actors anyway; `KeepStaticWorkers`, a scheduler plugin, takes static
workers out of every scale-down, so the data servers and the coordinator are never retired by it.

Runs on the scheduler too (the plugin is unpickled there): imports nothing but Dask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin


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
