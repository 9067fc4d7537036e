"""Connecting a job to a Dask cluster the way prefect-dask users give one, and keeping static workers.

A cluster is given as an address, as a `cluster_class` (an import path or a class, such as
`distributed.LocalCluster` or `dask_jobqueue.SLURMCluster`) with `cluster_kwargs` and optional adaptive
bounds (`adapt_kwargs`), or not at all, which starts a `LocalElasticCluster` of real local processes
(`prefect_elastic.local`, imported only then).

`is_static_worker` is the one definition of a static worker (one that carries the static resource), for
every role that tells static from elastic workers. Adaptive scale-down retires workers that hold actors
anyway; `KeepStaticWorkers`, a scheduler plugin, takes static workers out of every scale-down, so the data
servers and the coordinator are never retired by it.

`static_workers=N` with a `cluster_class` that is a `SpecCluster` (every dask-jobqueue cluster, such as
`SLURMCluster`, and `LocalCluster`) adds N static workers to the cluster made here: N more entries of its
`worker_spec`, each a copy of its worker template that carries the static resource and no `--lifetime`
(a static worker that ends its lifetime would close even while it holds a role). `StaticAwareAdaptive`
then reads `adapt_kwargs`' `minimum` and `maximum` as counts of elastic workers and never closes a static
one. `Resubmit` keeps the cluster at its plan: a job whose worker registered and then left (its
`--lifetime`, its walltime, `scancel`, pre-emption, a node failure) while the cluster still wants it is
replaced by a new job of the same kind, which Dask's adaptive scaling does not do by itself (a worker that
is gone still counts in the plan it compares its target with).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import dask.config
from distributed import Client
from distributed.comm import parse_address, registry
from distributed.deploy import Adaptive
from distributed.diagnostics.plugin import NannyPlugin, SchedulerPlugin, WorkerPlugin
from distributed.security import Security

from .errors import FatalError, JobConfigError

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


# How a worker that left gracefully is told apart from one that was lost: the stimulus of its removal.
# `Scheduler.retire_workers` (a client's retire, adaptive scale-down) and `Worker.close_gracefully` (a
# lifetime that ended) name theirs so.
GRACEFUL_STIMULI = ("retire-workers", "worker-close-gracefully")
GRACEFUL_MEMORY_SECONDS = 600.0


def scheduler_view_of_workers(dask_scheduler: Any, silent_heartbeats: float) -> dict[str, Any]:
    """Runs on the scheduler: each worker's address, name, resources, status, and how long it has been
    silent (seconds since its last heartbeat, by the scheduler's clock) against the longest silence
    allowed at the heartbeat interval the scheduler asks of workers now; and the workers that left
    gracefully lately (`GracefulLeaves`)."""
    from distributed.scheduler import heartbeat_interval
    from distributed.utils import time as now

    limit = silent_heartbeats * heartbeat_interval(len(dask_scheduler.workers))
    t = now()
    rows = [
        {
            "address": ws.address,
            "name": ws.name,
            "resources": dict(ws.resources),
            "status": ws.status.name,
            "silent": t - ws.last_seen,
            "silent_limit": limit,
        }
        for ws in dask_scheduler.workers.values()
    ]
    return {"workers": rows, "graceful": sorted(graceful_leaves(dask_scheduler))}


# What a worker imports before it takes a role (`load_engine`): torch and the step path.
ENGINE_MODULES = ("prefect_elastic.compute", "prefect_elastic.data_server")


def load_engine(modules: tuple[str, ...] = ENGINE_MODULES) -> None:
    """Runs as a task on a worker before it takes a role: imports the engine (torch and the step path) in
    the worker's task thread.

    A task's arguments are unpickled on the worker's event loop, so the first compute loop or data server
    sent to a worker that has not imported torch yet imports it there, and the worker sends no heartbeat
    for as long (3 to 4 s on this machine): a plain `dask worker` (no preload) was taken for lost at the
    start of every run. Here the import runs in a thread, while the loop keeps answering; this function and
    its argument are plain names, so unpickling them imports nothing heavy (this module is torch-free)."""
    for name in modules:
        importlib.import_module(name)


def has_plugin(dask_scheduler: Any, name: str) -> bool:
    return name in dask_scheduler.plugins


class GracefulLeaves(SchedulerPlugin):
    """Scheduler plugin: remembers for a while the workers that left gracefully, as opposed to lost
    (killed, crashed, cut off, frozen), so that the controller hands their share back without a rollback.
    Graceful: retired (`retire_workers`, adaptive scale-down, a lifetime that ended), or closed by its own
    process (SIGTERM: a SLURM `scancel` or pre-emption, `docker stop`), which tells the scheduler it is
    "closing" before it goes; a killed worker never does."""

    name = "prefect-elastic-graceful-leaves"

    def __init__(self) -> None:
        self.left: dict[str, float] = {}
        self._closing: dict[str, float] = {}  # workers that said they are closing, not removed yet

    def log_event(self, topic: Any, msg: Any) -> None:
        if not isinstance(msg, dict) or msg.get("action") != "worker-status-change":
            return
        if msg.get("status") in ("closing", "closing_gracefully"):
            for worker in [topic] if isinstance(topic, str) else list(topic):
                self._closing[str(worker)] = time.time()

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "", **kwargs: Any) -> None:
        now = time.time()
        for table in (self.left, self._closing):
            for old in [w for w, at in table.items() if now - at > GRACEFUL_MEMORY_SECONDS]:
                del table[old]
        said_closing = self._closing.pop(worker, None) is not None
        if said_closing or stimulus_id.startswith(GRACEFUL_STIMULI):
            self.left[worker] = now


# The topic on which `AnnounceRunning` tells the job's controller that a worker can take work.
WORKER_EVENTS_TOPIC = "prefect-elastic-workers"


class AnnounceRunning(SchedulerPlugin):
    """Scheduler plugin: announces on `WORKER_EVENTS_TOPIC` a worker that turned "running" from "init".

    A worker registers while still "init" and turns "running" once the scheduler's answer reaches it, a
    message later, so the add-worker event the controller hears comes before the worker can take work;
    the scheduler logs the change to "running" only under the worker's own topic. Without this the
    controller learned of it at its next look at the membership: the join's membership event came 0.10 to
    0.12 s after the registration, 0.04 to 0.07 s with this (docs/benchmarks.md)."""

    name = "prefect-elastic-announce-running"

    def __init__(self) -> None:
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def log_event(self, topic: Any, msg: Any) -> None:
        if self.scheduler is None or not isinstance(topic, str) or not isinstance(msg, dict):
            return
        if msg.get("action") == "worker-status-change" and (msg.get("prev-status"), msg.get("status")) == (
            "init",
            "running",
        ):
            self.scheduler.log_event(WORKER_EVENTS_TOPIC, {"action": "worker-running", "worker": topic})


# A static worker that got SIGTERM while it holds roles asks to be retired, so that the job's controller
# hands its roles over first; if nothing has retired it this long after (no job is running to do it), it
# closes by itself. Below `docker stop`'s 10 s and SLURM's default KillWait of 30 s: a hand-over takes well
# under a second (docs/benchmarks.md).
SIGTERM_HAND_OVER_SECONDS = 8.0


class CloseOnSigterm(WorkerPlugin):
    """Worker plugin: SIGTERM (a SLURM `scancel` or pre-emption, `docker stop`, a node draining) makes the
    worker leave gracefully instead of its process dying at once. SLURM and docker signal every process of
    the job, and a worker process under a nanny has no handler of its own: it would be gone before it told
    the scheduler, and its leave would look like a crash (rolled back under `rollback`).

    A compute worker closes gracefully at once. A static worker that holds actors (a job's data server or
    coordinator) asks the scheduler to retire it instead; the scheduler refuses while it holds them, and
    the job's controller, seeing the refusal, hands its roles to a standby from where they stand and then
    retires it (`TrainingRun._hand_over`): no committed step is lost."""

    name = "prefect-elastic-close-on-sigterm"

    def __init__(self) -> None:
        self._closing: set[asyncio.Future[Any]] = set()
        self._signalled = False

    def setup(self, worker: Any) -> None:
        import signal

        def on_sigterm() -> None:
            if self._signalled:  # (the group's signal and the nanny's forward of it)
                return
            self._signalled = True
            task = asyncio.ensure_future(self._leave(worker))
            self._closing.add(task)  # (held until done: the loop keeps only a weak reference)
            task.add_done_callback(self._closing.discard)

        # Not a worker process's main thread (an in-process cluster): its signals are not its own.
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)

    @staticmethod
    async def _leave(worker: Any) -> None:
        if worker.state.actors:
            log.warning(
                "SIGTERM: %s holds %d actors; asking to be retired", worker.address, len(worker.state.actors)
            )
            with contextlib.suppress(Exception):
                await worker.scheduler.retire_workers(
                    workers=[worker.address],
                    close_workers=True,
                    stimulus_id=f"retire-workers-sigterm-{time.time()}",
                )
            await asyncio.sleep(
                SIGTERM_HAND_OVER_SECONDS
            )  # retired meanwhile: this task ends with the worker
        await worker.close_gracefully(reason="SIGTERM")


class NannyKeepsWorkerOnSigterm(NannyPlugin):
    """Nanny plugin: SIGTERM no longer makes the nanny close its worker process at once (the `dask worker`
    command's own handler does), which would leave a static worker no time to hand its roles over. The
    signal goes on to the worker process, whose `CloseOnSigterm` makes it leave gracefully; the nanny then
    closes with it. If the worker process is still there well after the hand-over time, the nanny closes
    it as the command would have."""

    name = "prefect-elastic-nanny-keeps-worker-on-sigterm"

    def __init__(self) -> None:
        self._closing: set[asyncio.Future[Any]] = set()

    def setup(self, nanny: Any) -> None:
        import signal

        def on_sigterm() -> None:
            pid = nanny.pid
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # (a signal sent to the nanny alone reaches it too)
            loop = asyncio.get_running_loop()
            loop.call_later(SIGTERM_HAND_OVER_SECONDS + 5.0, self._close_late, nanny)

        # Installed after the command's own handler (plugins are set up once the nanny runs), it replaces it.
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)

    def _close_late(self, nanny: Any) -> None:
        if nanny.status.name not in ("closing", "closed"):
            task = asyncio.ensure_future(nanny.close(reason="SIGTERM"))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def graceful_leaves(scheduler: Any) -> set[str]:
    """On the scheduler: the workers `GracefulLeaves` saw leave gracefully lately."""
    plugin = scheduler.plugins.get(GracefulLeaves.name)
    return set(plugin.left) if isinstance(plugin, GracefulLeaves) else set()


async def answering(addresses: Iterable[str], timeout: float, **connection_args: Any) -> frozenset[str]:
    """The workers among `addresses` whose process answers a connection (Dask's handshake, which needs
    its event loop) within `timeout` seconds, all asked at once. A process killed with SIGKILL answers
    nothing, although its kernel may accept the connection for tens of milliseconds more: the sockets of a
    process that dies close only once its memory is torn down, which is also when the scheduler notices.
    So survival detection asks the members still listed whether they answer, to tell a worker lost with
    the others from one still there (`survival.wait_for_losses`). A frozen (SIGSTOPped) worker, one whose
    host lost power or is cut off, does not answer either: the caller then waits as if it were dying.
    One try each (Dask's `connect` retries a refused connection until its timeout), its connection closed
    whatever happens; nothing is sent after the handshake, and a live worker logs nothing for it. A live
    worker on the same machine answered in 0.7 to 2 ms (2026-11-28)."""

    async def one(address: str) -> str | None:
        comm = None
        try:
            scheme, location = parse_address(address)
            connector = registry.get_backend(scheme).get_connector()
            comm = await asyncio.wait_for(connector.connect(location, **connection_args), timeout)
            await asyncio.wait_for(comm.write(comm.handshake_info()), timeout)
            await asyncio.wait_for(comm.read(), timeout)
            return address
        except (TimeoutError, OSError, ValueError, TypeError):
            return None
        finally:
            if comm is not None:
                comm.abort()

    if timeout <= 0:
        return frozenset()
    got = await asyncio.gather(*(one(a) for a in addresses))
    return frozenset(a for a in got if a is not None)


@dataclass
class Connection:
    """Where the job runs: the scheduler address, and the cluster object when this process made it."""

    address: str
    cluster: Any = None
    made_here: bool = False
    static: StaticWorkers | None = None  # the static workers added to a cluster made here
    resubmit: Resubmit | None = None  # replaces the jobs of a cluster made here that ended


# One cluster class import at a time: each swaps `signal.signal` while it runs (`import_keeping_signals`).
_SIGNALS_SWAPPED = threading.Lock()


def import_keeping_signals(module: str) -> ModuleType:
    """Import `module` (a cluster class's) without letting the import install signal handlers.

    `dask_jobqueue.SLURMCluster` imports `dask_jobqueue.runner`, which calls `signal.signal(SIGINT,
    lambda *_: sys.exit())` as it is imported: from any thread but the main one that raises ValueError
    ("signal only works in main thread of the main interpreter"), and a flow called from a thread could not
    import its cluster class; on the main thread it silently replaced the caller's Ctrl-C handler (a
    flow's, Prefect's, the user's) with `sys.exit`. While the module imports, `signal.signal` called from
    the importing thread changes nothing (it answers with the handler in place); from any other thread it
    goes through as always. (That handler serves dask-jobqueue's runners, which run as the batch script
    itself; a cluster class made here never uses it.)"""
    original = signal.signal
    importing = threading.get_ident()

    def keep(signalnum: int, handler: Callable[..., Any] | int | None) -> Any:
        if threading.get_ident() != importing:
            return original(signalnum, handler)
        log.debug("importing %s: left the handler of signal %s as it was", module, signalnum)
        return signal.getsignal(signalnum)

    with _SIGNALS_SWAPPED:
        signal.signal = keep
        try:
            return importlib.import_module(module)
        finally:
            signal.signal = original


def resolve_cluster_class(spec: str | type) -> type:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.replace(":", ".").rpartition(".")
    try:
        found: type = getattr(import_keeping_signals(module), name)
        return found
    except (ImportError, AttributeError, ValueError) as exc:
        raise JobConfigError(
            "cluster_class",
            spec,
            f"cannot be imported ({exc}); give an import path such as distributed.LocalCluster",
        ) from exc


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

    `static_workers`: static workers to add to the `cluster_class` made here (see the module's docstring),
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
        from .local.cluster import LocalElasticCluster

        cluster = LocalElasticCluster(
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
            _mark_ended_jobs_closed(connection.cluster)
            connection.cluster.close()


def _mark_ended_jobs_closed(cluster: Any) -> None:
    """dask-jobqueue 0.9's `Job.close` cancels the job but leaves its status "running", and
    `SpecCluster.close` asserts that every job it ever made that is still referenced (one Dask closed
    after its worker left, held by a finished future) is closed. Those jobs are over: say so."""
    from distributed.core import Status

    current = {id(w) for w in getattr(cluster, "workers", {}).values()}
    for job in list(getattr(cluster, "_created", ())):
        if id(job) not in current and getattr(job, "job_id", None) and job.status == Status.running:
            job.status = Status.closed
