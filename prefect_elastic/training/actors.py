"""Placing the job's actors: registering the job, loading the engine on a worker before it takes a role,
starting the data servers and the coordinator on the static workers (tried again on the ones left when a
static worker is lost during the start).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from distributed import Client, Future
from distributed.comm import get_address_host

from ..checkpoint import ShardStart
from ..cluster import (
    AnnounceRunning,
    CloseOnSigterm,
    CpuShare,
    GracefulLeaves,
    NannyKeepsWorkerOnSigterm,
    cpu_share,
    has_plugin,
    is_static_worker,
    machine_cores,
    machines,
    scheduler_view_of_workers,
)
from ..compute.bucket_push import OVERLAP_MIN_BYTES, cores_short, cores_wanted
from ..coordinator import STEADY_SYNC_SECONDS, SYNC_SECONDS, Coordinator, CoordinatorSpec
from ..coordinator.survival import Policy
from ..data_server import DataServer, Piece, plan_pieces
from ..errors import (
    DataServerLostError,
    FatalError,
)
from ..messages import (
    Resume,
)
from ..registry import claim_job
from .calls import LEAVING_GRACE_SECONDS, WATCH_WHILE_CALLING_SECONDS, controller_handle
from .pacing import PROGRESS_POLL_IDLE_SECONDS
from .signals import StaticWorkerLeft
from .workers import SILENT_HEARTBEATS

if TYPE_CHECKING:
    from ..job import RoleSpecs
    from .calls import Calls
    from .engine import EngineLoads
    from .prepare import Prepared
    from .role_table import RoleTable
    from .workers import Workers

log = logging.getLogger(__name__)

# How many cancelled starts of one role in a row the controller tries again before it gives up.
START_TRIES = 3


class Actors:
    """The job's actors placed: the job id registered, the engine loaded before a role, the data servers
    and the coordinator started (recorded in the `RoleTable`)."""

    def __init__(
        self,
        client: Client,
        prepared: Prepared,
        run_id: str,
        progress_poll: float,
        roles: RoleTable,
        workers: Workers,
        engine: EngineLoads,
        calls: Calls,
    ) -> None:
        self.client = client
        self.prepared = prepared
        self.job = prepared.job
        self.mode = prepared.mode
        self.persistence = prepared.persistence
        self.run_id = run_id
        self.progress_poll = progress_poll
        self.roles = roles
        self.workers = workers
        self.engine = engine
        self.calls = calls
        self.registered = False
        job = self.job
        # The coordinator's spec, made once (the job's policy named by its setting's string turned into a
        # `Policy` here): the start and every rebuild submit this one.
        self.coordinator_spec = CoordinatorSpec(
            job.job_id, prepared.schedule, job.data_servers, Policy(job.on_membership_change),
            job.min_workers, job.min_workers_timeout, self.mode.commits,
            self.mode.snapshot_every_checks(
                job.checkpoint_every, bool(job.checkpoint), job.peer_replicas and job.data_servers > 1
            ),
        )  # fmt: skip

    def register(self) -> None:
        # Roles register under the job id: a second live controller of the same job would
        # train the same batches twice, so it is refused; a key left by a controller that died is taken
        # over. Check and set run in one function on the scheduler, so two controllers cannot both pass.
        # Tells a retired worker from a lost one (a graceful leave is not rolled back); kept if registered.
        if not self.client.run_on_scheduler(has_plugin, name=GracefulLeaves.name):
            self.client.register_plugin(GracefulLeaves(), name=GracefulLeaves.name)
            self.client.register_plugin(CloseOnSigterm(), name=CloseOnSigterm.name)
            self.client.register_plugin(NannyKeepsWorkerOnSigterm(), name=NannyKeepsWorkerOnSigterm.name)
        if not self.client.run_on_scheduler(has_plugin, name=AnnounceRunning.name):
            self.client.register_plugin(AnnounceRunning(), name=AnnounceRunning.name)
        holder = claim_job(self.client, self.job.job_id, self.run_id)
        if holder is not None:
            raise FatalError(
                f"job_id={self.job.job_id!r} is already training on this cluster "
                f"(controller {holder['client']}); give this job another job_id or wait for that one to end"
            )
        self.registered = True

    def static_workers(self) -> list[str]:
        # Read on the scheduler, not from `Client.scheduler_info()`: the client's periodic refresh of that
        # cache (which carries no workers) can land between its fetch and its return.
        view = self.client.run_on_scheduler(scheduler_view_of_workers, silent_heartbeats=SILENT_HEARTBEATS)
        static = [
            r
            for r in view["workers"]
            if is_static_worker(r, self.job.static_resource)
            and r["status"] in ("running", "paused")
            and not self.workers.has_left(r["address"])
        ]
        if not static:
            raise FatalError(
                f"no static workers on the cluster: start some with "
                f"`dask worker <scheduler> --resources {self.job.static_resource}=1`; data servers and the "
                "coordinator must live on workers that are never taken away"
            )
        return [r["address"] for r in sorted(static, key=lambda r: (str(r["name"]), r["address"]))]

    def overlap_decided(self, specs: RoleSpecs, plan: list[list[Piece]], loops: Iterable[str]) -> RoleSpecs:
        """`specs` with the loops' `overlap_push` decided where the job leaves it to the engine (None) and
        the model is big enough for it (`OVERLAP_MIN_BYTES`): off where a machine (one kernel:
        `cluster.machines`) runs compute loops and data servers holding parameters on fewer cores than they
        want (their CPU sets and cgroup CPU quotas: `cluster.machine_cores`; `bucket_push.cores_short`),
        as the members at the start stand; else left to the loops. Decided once for the job: a shard takes
        a step's gradients all in parts or all whole."""
        job = self.job
        if job.overlap_push is not None or job.overlap_pull or not self.mode.overlaps_push:
            return specs
        members = sorted(loops)
        size = sum(t.numel() * t.element_size() for t in self.persistence.initial.values())
        if size < OVERLAP_MIN_BYTES or not members:
            return specs
        holders = [where for where, pieces in zip(self.roles.placement, plan, strict=True) if pieces]
        workers = sorted({*holders, *members})
        try:
            hosts = {w: get_address_host(w) for w in workers}
            found = self.client.sync(self._cpu_shares, workers, job.call_timeout)
        except Exception as exc:  # (a worker gone or frozen meanwhile: the model's size decides, as before)
            log.info("job %s: the machines' cores were not read (%r); overlap_push by size", job.job_id, exc)
            return specs
        # (Workers in containers of one machine are on one machine, whatever their addresses; workers pinned
        # to cores of their own add up; workers in one cgroup share its CPU quota.)
        machine = machines(found, hosts)
        cores = machine_cores(found, machine)
        short = cores_short(machine, cores, holders, members, job.threads_per_worker)
        if not short:
            return specs
        wanted = cores_wanted(machine, holders, members, job.threads_per_worker)
        named = [
            f"{'/'.join(sorted({hosts[w] for w in workers if machine[w] == m}))} ({wanted[m]} wanted, "
            f"{cores[m]:g} there)"
            for m in short
        ]
        log.info(
            "job %s: gradients are pushed whole after backward: on %s the compute loops and data servers "
            "want more cores than there are (CPU sets and cgroup CPU quotas), and the overlapped step would "
            "put the shards' work on backward's cores (overlap_push=True asks for it anyway)",
            job.job_id, "; ".join(named),
        )  # fmt: skip
        return dataclasses.replace(specs, loop=dataclasses.replace(specs.loop, overlap_push=False))

    async def _cpu_shares(self, workers: list[str], timeout: float) -> dict[str, CpuShare]:
        """Each worker's CPU set, cgroup quotas and machine (`cluster.cpu_share`: torch-free, so a worker
        that has not loaded the engine yet imports little to run it), within `timeout`: a call to a worker
        gone meanwhile would wait for Dask's connect timeout."""
        run = self.client._run(cpu_share, workers=workers, on_error="ignore")
        found: dict[str, CpuShare] = await asyncio.wait_for(run, timeout)
        return found

    def start_servers(self) -> None:
        """Start the data servers and the coordinator on the static workers. Nothing is trained before they
        all stand, so a static worker lost meanwhile costs nothing but the start: it is tried again on the
        static workers left (a standby is one more of them), up to `START_TRIES` times."""
        job = self.job
        # (A tensor larger than a data server's share is split across several, where the job allows it.)
        plan = plan_pieces(self.persistence.initial, job.data_servers, job.min_shard_bytes, job.splits)
        self.persistence.plan = plan  # (a checkpoint joins the parts by it)
        tries = 0
        while True:
            static = self.static_workers()
            for where in static:  # (a standby's engine loads too: it may be promoted soon)
                self.engine.load(where)
            try:
                self.start_servers_on(static, plan)
                return
            except Exception as exc:
                gone = sorted(
                    w
                    for w in {*self.roles.placement, self.roles.coordinator_at} - {""}
                    if self.workers.leaves_soon(w, LEAVING_GRACE_SECONDS, heard=False)
                )
                if not gone:
                    raise
                self.abandon_start()
                tries += 1
                if tries >= START_TRIES:
                    raise DataServerLostError(
                        f"job {job.job_id} could not start: static workers were lost while its data servers "
                        f"started, {tries} times (the last: {', '.join(gone)}); check why its static workers "
                        "die, then run the job again"
                    ) from exc
                log.warning(
                    "job %s: static worker %s lost while the data servers started (%s: %s); starting them "
                    "again on the static workers left",
                    job.job_id, ", ".join(gone), type(exc).__name__, exc,
                )  # fmt: skip

    def start_servers_on(self, static: list[str], plan: list[list[Piece]]) -> None:
        job = self.job
        roles = self.roles
        roles.place(static, len(plan))
        for where in sorted(set(roles.placement)):
            self.await_engine(where, self.startup_timeout(), heard=False)
        for i, names in enumerate(plan):
            start = self.persistence.shard_start(i, names)
            roles.submitted(self.submit_data_server(i, roles.placement[i], start))
        roles.submitted(
            self.submit_coordinator(roles.coordinator_at, self.persistence.resume()), coordinator=True
        )
        # Reading a partition may take a while on a big dataset; the wait is still bounded.
        slow = self.startup_timeout()
        shards = [
            self.calls.wait_unless_left(f, roles.placement[i], slow, heard=False)
            for i, f in enumerate(roles.actor_futures)
        ]
        coordinator = controller_handle(
            self.calls.wait_unless_left(roles.coordinator_future, roles.coordinator_at, slow, heard=False)
        )
        # The step path's own connections (wire/channel.py): compute loops reach each shard there.
        channels = [
            self.calls.wait_unless_left(s.open_channel(), roles.placement[i], job.call_timeout, heard=False)
            for i, s in enumerate(shards)
        ]
        roles.started(coordinator, list(shards), channels, plan)
        self.calls.wait_unless_left(
            coordinator.attach(shards, channels),
            roles.coordinator_at,
            job.call_timeout,
            heard=False,
        )

    def abandon_start(self) -> None:
        """Drop what a start that lost a static worker made: its actors (on the workers left) and places."""
        futures = self.roles.abandon()
        with contextlib.suppress(Exception):
            self.client.cancel(futures)

    def await_engine(
        self,
        where: str,
        timeout: float,
        elastic: bool = False,
        heard: bool = True,
        gone: Callable[[], bool] | None = None,
    ) -> None:
        """Wait for the engine to be loaded on `where` (`Calls.wait_unless_left`, with its options)."""
        future = self.engine.load(where)
        if future is not None:
            self.calls.wait_unless_left(future, where, timeout, elastic, heard, gone)
            self.engine.load(where)  # (drops the future)

    def submit_coordinator(self, where: str, resume: Resume | None) -> Future:
        job = self.job
        self.workers.placed_on(where)
        return self.client.submit(
            Coordinator, self.coordinator_spec, resume, job.call_timeout, self.steady_sync(),
            actor=True, workers=[where], allow_other_workers=False, pure=False,
            key=f"prefect-elastic-{job.job_id}-{self.run_id}-coordinator-{uuid.uuid4().hex[:6]}",
        )  # fmt: skip

    def steady_sync(self) -> float:
        """How often the coordinator reads the shards in a sync job's steady state: as often as near the
        end where this controller polls progress for a caller that acts on steps as they commit (faults,
        `on_progress`), whose fault at step 5 of a short job would otherwise come after its end."""
        return SYNC_SECONDS if self.progress_poll < PROGRESS_POLL_IDLE_SECONDS else STEADY_SYNC_SECONDS

    def startup_timeout(self) -> float:
        return max(self.job.call_timeout, 600.0)

    def submit_data_server(
        self, index: int, where: str, start: ShardStart | None, version: int = 0
    ) -> Future:
        """A data server for shard `index` on the static worker `where`: with the tensors of `start`
        (scattered straight to that worker, not put in the task graph, which would make a big model's
        graph big), or empty, to take its state from its peer (`adopt`) at `version`."""
        applied: tuple[int, ...] = ()
        if start is None:
            tensors: list[Any] = [{}, {}, None]
        else:
            applied = start.applied
            version = start.version
            tensors = self.client.sync(
                self.scatter_unless_left, [start.params, start.buffers, start.optimizer_state], where
            )
        self.workers.placed_on(where)
        return self.client.submit(
            DataServer, index, self.prepared.specs.shard, self.prepared.batches, self.prepared.schedule,
            *tensors, version, applied, self.mode.applies,
            actor=True, workers=[where], allow_other_workers=False,
            key=f"prefect-elastic-{self.job.job_id}-{self.run_id}-data-server-{index}-{uuid.uuid4().hex[:6]}",
            pure=False,
        )  # fmt: skip

    async def scatter_unless_left(self, data: list[Any], where: str) -> list[Future]:
        """`data` scattered to the worker `where`, unless it leaves first: a scatter to a worker that died
        waits for Dask's connect timeout (30 s) before it fails."""
        scatter = asyncio.ensure_future(self.client._scatter(data, workers=[where], hash=False))
        while True:
            done, _ = await asyncio.wait([scatter], timeout=WATCH_WHILE_CALLING_SECONDS)
            if done:
                futures: list[Future] = scatter.result()
                return futures
            if self.workers.has_left(where):
                scatter.cancel()
                raise StaticWorkerLeft(where)
