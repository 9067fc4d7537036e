"""Static workers on a Dask `SpecCluster` (every dask-jobqueue cluster, such as `SLURMCluster`).

`static_workers=N` with a `cluster_class` that is a `SpecCluster` (and `LocalCluster`) adds N static
workers to the cluster made by `connect`: N more entries of its `worker_spec`, each a copy of its worker
template that carries the static resource and no `--lifetime` (a static worker that ends its lifetime
would close even while it holds a role): `StaticWorkers`. `StaticAwareAdaptive` then reads `adapt_kwargs`'
`minimum` and `maximum` as counts of elastic workers and never closes a static one. `Resubmit` keeps the
cluster at its plan: a job whose worker registered and then left (its `--lifetime`, its walltime,
`scancel`, pre-emption, a node failure) while the cluster still wants it is replaced by a new job of the
same kind, which Dask's adaptive scaling does not do by itself (a worker that is gone still counts in the
plan it compares its target with). `with_lifetime_before_walltime` gives a job's workers a lifetime that
ends before SLURM's walltime would kill them.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dask.config
from distributed.deploy import Adaptive

from ..errors import FatalError, JobConfigError
from .cluster_class import resolve_cluster_class

log = logging.getLogger(__name__)


# A worker_spec entry that holds a static worker carries this key (SpecCluster reads only cls, options and
# group, and keeps other keys as they are).
STATIC_MARK = "prefect-elastic-static"
# dask worker's lifetime options, and whether each takes a value: a static worker gets none of them.
_LIFETIME_FLAGS = {"--lifetime": True, "--lifetime-stagger": True, "--lifetime-restart": False}
_LIFETIME_FLAGS["--no-lifetime-restart"] = False
_LIFETIME_OPTIONS = ("lifetime", "lifetime_stagger", "lifetime_restart")
# How long a worker whose job registered must be gone before `Resubmit` replaces its job: a nanny brings a
# killed worker process back under the same name within seconds, and that job is not over.
RESUBMIT_GRACE_SECONDS = 5.0
RESUBMIT_POLL_SECONDS = 1.0
STATIC_POLL_SECONDS = 0.2


def _without_lifetime(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _LIFETIME_FLAGS:
            skip = _LIFETIME_FLAGS[flag] and "=" not in arg
            continue
        out.append(arg)
    return out


def _with_resource(args: list[str], resource: str) -> list[str]:
    """dask worker's arguments with `resource=1` added to its `--resources` (one option holds them all)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--resources" and i + 1 < len(out):
            out[i + 1] = f"{out[i + 1]} {resource}=1"
            return out
        if arg.startswith("--resources="):
            out[i] = f"{arg} {resource}=1"
            return out
    return [*out, "--resources", f"{resource}=1"]


def walltime_seconds(walltime: str) -> float | None:
    """SLURM's time formats ("minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
    "days-hours:minutes", "days-hours:minutes:seconds") in seconds; None for anything else."""
    days, _, rest = walltime.strip().rpartition("-") if "-" in walltime else ("0", "", walltime.strip())
    try:
        parts = [int(p) for p in rest.split(":")]
        whole_days = int(days or 0)
    except ValueError:
        return None
    if not parts or any(p < 0 for p in parts) or len(parts) > 3:
        return None
    if "-" in walltime:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # minutes[:seconds]
        hours, minutes, seconds = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
    return float(((whole_days * 24 + hours) * 60 + minutes) * 60 + seconds)


def with_lifetime_before_walltime(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A dask-jobqueue cluster's arguments with a worker lifetime that ends before the job's walltime, if
    none is given: a worker whose lifetime ends leaves gracefully (its share handed back, nothing rolled
    back) and is replaced, where SLURM would kill it at its walltime. The lifetime is the walltime less a
    tenth (at most 5 minutes), less its stagger (at most 2 minutes), which spreads the workers' ends."""
    args = list(kwargs.get("worker_extra_args") or [])
    walltime = kwargs.get("walltime")
    if not isinstance(walltime, str) or any(a.split("=")[0] == "--lifetime" for a in args):
        return kwargs
    total = walltime_seconds(walltime)
    if total is None or total < 120:
        return kwargs  # (too short to leave a margin that matters)
    margin = min(0.1 * total, 300.0)
    stagger = min(0.05 * total, 120.0)
    lifetime = total - margin - stagger
    args += ["--lifetime", f"{int(lifetime)}s", "--lifetime-stagger", f"{int(stagger)}s"]
    return {**kwargs, "worker_extra_args": args}


def _worker_class(cls: Any) -> Any:
    # A SpecCluster spec may name its class by import path (`"distributed.Nanny"`).
    return resolve_cluster_class(cls) if isinstance(cls, str) else cls


class StaticWorkers:
    """The static workers `connect` adds to a `SpecCluster`: their worker_spec entries and their names.

    Each entry is the cluster's worker template (`new_spec`) with the static resource added and any
    lifetime removed: dask-jobqueue jobs get ``--resources static=1`` in `worker_extra_args`; a
    `distributed.Worker` or `Nanny` template gets ``resources={"static": 1}``.
    """

    def __init__(self, cluster: Any, resource: str = "static") -> None:
        template = getattr(cluster, "new_spec", None)
        if not hasattr(cluster, "worker_spec") or not isinstance(template, Mapping) or "cls" not in template:
            raise JobConfigError(
                "static_workers",
                type(cluster).__name__,
                "adding static workers needs a cluster_class that is a Dask SpecCluster (every dask-jobqueue "
                "cluster, such as dask_jobqueue.SLURMCluster, or distributed.LocalCluster); with another "
                f"cluster leave static_workers out and start static workers with `--resources {resource}=1`",
            )
        self.cluster = cluster
        self.resource = resource
        self.template = self._static_template(template)
        self._serial = 0

    def _static_template(self, template: Mapping[str, Any]) -> dict[str, Any]:
        spec = dict(template)
        options = dict(spec.get("options") or {})
        job_cls = getattr(self.cluster, "job_cls", None)
        if job_cls is not None:
            # dask-jobqueue: the job runs `dask worker ...`; its own options go there through
            # worker_extra_args, which the job reads from dask's config when the cluster was given none.
            args = options.get("worker_extra_args")
            if args is None:
                config_name = options.get("config_name") or job_cls.default_config_name()
                args = dask.config.get(f"jobqueue.{config_name}.worker-extra-args", default=None) or []
            options["worker_extra_args"] = _with_resource(_without_lifetime(list(args)), self.resource)
            # Its own job name, so that `squeue` tells static jobs from elastic ones at a glance.
            config_name = options.get("config_name") or job_cls.default_config_name()
            base = options.get("job_name") or dask.config.get(f"jobqueue.{config_name}.name", default=None)
            options["job_name"] = f"{base or 'dask-worker'}-static"
        else:
            from distributed import Nanny, Worker

            cls = _worker_class(spec["cls"])
            if not (isinstance(cls, type) and issubclass(cls, (Worker, Nanny))):
                raise JobConfigError(
                    "static_workers",
                    getattr(cls, "__name__", cls),
                    "static workers can be added to a SpecCluster whose workers are dask-jobqueue jobs or "
                    "distributed.Worker/Nanny; leave static_workers out and start static workers with "
                    f"`--resources {self.resource}=1` yourself",
                )
            options["resources"] = {**(options.get("resources") or {}), self.resource: 1}
            for key in _LIFETIME_OPTIONS:
                options.pop(key, None)
        spec["options"] = options
        spec[STATIC_MARK] = True
        return spec

    def entry(self) -> dict[str, Any]:
        """One new static worker_spec entry, under a name no worker of the cluster had."""
        while True:
            name = f"static-{self._serial}"
            self._serial += 1
            if name not in self.cluster.worker_spec:
                return {name: copy.copy(self.template)}

    def add(self, n: int) -> None:
        """Add `n` static workers to the cluster's plan and start them (submit their jobs)."""
        for _ in range(n):
            self.cluster.worker_spec.update(self.entry())
        # What SpecCluster.scale() does after changing the plan, without its count (which would mix
        # static and elastic workers, and jobs and workers for dask-jobqueue).
        self.cluster.sync(self.cluster._correct_state)

    def wait(self, timeout: float) -> None:
        """Wait until every static worker of the plan has registered: the controller places its roles on
        the static workers there are when it starts. Raises `FatalError` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            workers = (self.cluster.scheduler_info or {}).get("workers", {})
            registered = {str(info.get("name")) for info in workers.values()}
            waiting = self.names() - registered
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise FatalError(
                    f"static workers {sorted(waiting)} did not start within {timeout:g} s "
                    "(static_start_timeout): their jobs may still wait in the queue (see squeue) or have "
                    "failed (see the jobs' output); give them more time or ask for fewer resources"
                )
            time.sleep(STATIC_POLL_SECONDS)

    def names(self) -> set[str]:
        """The worker names of the static entries (a dask-jobqueue job with processes > 1 is a group)."""
        return {
            name
            for key, spec in self.cluster.worker_spec.items()
            if spec.get(STATIC_MARK)
            for name in _member_names(key, spec)
        }


def _member_names(key: Any, spec: Mapping[str, Any]) -> set[str]:
    if "group" in spec:
        return {f"{key}{suffix}" for suffix in spec["group"]}
    return {str(key)}


class StaticAwareAdaptive(Adaptive):
    """Dask's adaptive scaling with `minimum` and `maximum` counted in elastic workers: the static workers
    are added on top of its target and never closed (a pending static job is no candidate either)."""

    def __init__(self, cluster: Any, *args: Any, static: StaticWorkers, **kwargs: Any) -> None:
        super().__init__(cluster, *args, **kwargs)
        self.static = static

    async def safe_target(self) -> int:
        static = len(self.static.names())
        # The scheduler's target counts every worker it has, static ones included.
        wanted = await self.target() - static
        elastic = min(max(wanted, self.minimum), self.maximum)
        return int(elastic) + static

    async def scale_down(self, workers: Any) -> None:
        keep = self.static.names()
        await super().scale_down([w for w in workers if str(w) not in keep])


@dataclass
class Resubmit:
    """Keeps a `SpecCluster` at its plan: a worker_spec entry whose worker registered and then stayed gone
    for `grace` seconds (its job ended: `--lifetime`, walltime, `scancel`, pre-emption) is replaced by a
    new entry of the same kind (static or elastic), whose job is submitted at once.

    Dask's adaptive scaling compares its target with the plan, in which such an entry still counts, so it
    would never submit a new job for it (dask-jobqueue users report exactly that). An entry taken out of
    the plan (a scale-down) is not replaced. Runs on the cluster's event loop, polling every `poll` s.
    """

    cluster: Any
    static: StaticWorkers | None = None
    grace: float = RESUBMIT_GRACE_SECONDS
    poll: float = RESUBMIT_POLL_SECONDS
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (old entry, new entry), for callers
    _seen: set[str] = field(default_factory=set)
    _gone_since: dict[str, float] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _stopped: bool = False

    def start(self) -> Resubmit:
        # Every worker that registers is noted as it registers (the cluster's own hook for the scheduler's
        # add and remove messages): one whose job ends within a poll would otherwise never be seen.
        update = self.cluster._update_worker_status

        def noting(op: str, msg: Any) -> Any:
            if op == "add" and isinstance(msg, dict):
                workers = msg.get("workers") or {}
                self._seen.update(str(info.get("name")) for info in workers.values())
            return update(op, msg)

        self.cluster._update_worker_status = noting
        self.cluster.loop.add_callback(self._begin)
        return self

    def stop(self) -> None:
        self._stopped = True
        task = self._task
        if task is not None:
            self.cluster.loop.add_callback(task.cancel)

    def _begin(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while not self._stopped and self.cluster.status.name not in ("closing", "closed"):
            await asyncio.sleep(self.poll)
            try:
                if self.check(time.monotonic()):
                    await self.cluster._correct_state()
            except Exception as exc:  # keep watching: one failed submission must not end replacement
                log.warning("resubmitting ended jobs: %r", exc)

    def _elastic_entry(self) -> dict[Any, Any]:
        # Under a name no worker had: SpecCluster would hand out the freed name again, and the old job
        # object under that name (closed by `_correct_state` only when its name left the plan) would then
        # stand for the new one, so nothing would be submitted.
        taken = {str(name) for name in self.cluster.workers} | self._seen | set(self._gone_since)
        taken |= {old for old, _ in self.replaced}
        while True:
            new: dict[Any, Any] = self.cluster.new_worker_spec()
            if not {str(name) for name in new} & taken:
                return new
            self.cluster._i += 1

    def check(self, now: float) -> bool:
        """Replace the entries whose workers are gone (in the plan only); whether any was replaced."""
        workers = (self.cluster.scheduler_info or {}).get("workers", {})
        observed = {str(info.get("name")) for info in workers.values()}
        changed = False
        for key, spec in list(self.cluster.worker_spec.items()):
            name = str(key)
            members = _member_names(key, spec)
            if members & observed:
                self._seen |= members
                self._gone_since.pop(name, None)
                continue
            if not members & self._seen:
                continue  # its job has not started yet (or is still queued)
            since = self._gone_since.setdefault(name, now)
            if now - since < self.grace:
                continue
            self._seen -= members
            self._gone_since.pop(name, None)
            del self.cluster.worker_spec[key]
            new = self.static.entry() if spec.get(STATIC_MARK) and self.static else self._elastic_entry()
            self.cluster.worker_spec.update(new)
            for new_name in new:
                self.replaced.append((name, str(new_name)))
            log.warning(
                "worker %s of the cluster's plan ended (its job is over: lifetime, walltime, scancel, "
                "pre-emption); submitted %s in its place",
                name, ", ".join(map(str, new)),
            )  # fmt: skip
            changed = True
        return changed


def mark_ended_jobs_closed(cluster: Any) -> None:
    """dask-jobqueue 0.9's `Job.close` cancels the job but leaves its status "running", and
    `SpecCluster.close` asserts that every job it ever made that is still referenced (one Dask closed
    after its worker left, held by a finished future) is closed. Those jobs are over: say so."""
    from distributed.core import Status

    current = {id(w) for w in getattr(cluster, "workers", {}).values()}
    for job in list(getattr(cluster, "_created", ())):
        if id(job) not in current and getattr(job, "job_id", None) and job.status == Status.running:
            job.status = Status.closed
