"""The Dask plugins the engine installs, and what runs on the scheduler for the controller.

On the scheduler: `GracefulLeaves` (which workers left gracefully, as opposed to lost), `AnnounceRunning`
(a worker that turned "running" can take work), `scheduler_view_of_workers` (the rows the controller's
view of the workers is made from). On the workers and the nannies: `CloseOnSigterm` and
`NannyKeepsWorkerOnSigterm`, which turn SIGTERM (`scancel`, `docker stop`, pre-emption) into a graceful
leave, with time for a static worker to hand its roles over.

The scheduler and every nanny unpickle these, so this module imports no torch: a process that does stays
small.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, SchedulerPlugin, WorkerPlugin

log = logging.getLogger(__name__)


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
    retires it (`StaticRoles.hand_over` in training/roles.py): no committed step is lost."""

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
