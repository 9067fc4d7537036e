"""Fault injection as a reusable schedule, for tests, demos and users who want to rehearse failures.

    from prefect_elastic.local.faults import FaultSchedule

    faults = FaultSchedule(seed=1).kill_worker(at_step=5).add_worker(at_step=9)
    result = train(job, cluster=local_cluster, faults=faults)
    faults.log   # what was done, at which step

Actions run from the controller's supervision loop once the committed step reaches `at_step`, on a
`LocalElasticCluster` (real processes, real signals). A target left as `None` is a live compute worker
chosen by the schedule's seeded random generator, so a schedule replays the same way.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..messages import Progress
from .cluster import LocalElasticCluster

log = logging.getLogger(__name__)

FaultKind = Literal["kill", "restart", "retire", "add", "add-static", "freeze", "pause", "slow", "partition"]


@dataclass
class Fault:
    at_step: int
    kind: FaultKind
    count: int = 1
    worker: str | None = None  # a name or address; None: a live compute worker chosen at random
    sig: int = signal.SIGKILL
    # A static role instead of a worker: "data-server-<i>" or "coordinator", resolved from the progress
    # (`Progress.data_servers`, `Progress.coordinator_at`) when the fault is due.
    role: str | None = None
    factor: float = 1.0  # "slow": how many times slower the worker computes
    seconds: float = 0.0  # "pause": how long the worker stays stopped before its SIGCONT


@dataclass(frozen=True)
class FaultRecord:
    step: int
    kind: FaultKind
    target: str
    time: float
    sig: int = 0  # of a kill or a restart
    role: str | None = None  # the static role whose worker was acted on, if any


@dataclass
class FaultSchedule:
    seed: int = 0
    faults: list[Fault] = field(default_factory=list)
    log: list[FaultRecord] = field(default_factory=list)
    cluster: LocalElasticCluster | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._background: list[threading.Thread] = []
        self._freezing: tuple[Fault, str] | None = None
        self._paused: set[str] = set()

    # -- building --------------------------------------------------------------------------------

    def kill_worker(
        self, at_step: int, worker: str | None = None, count: int = 1, sig: int = signal.SIGKILL
    ) -> FaultSchedule:
        """Kill `count` compute workers for good (worker process and nanny) with `sig`."""
        self.faults.append(Fault(at_step, "kill", count, worker, sig))
        return self

    def restart_worker(
        self, at_step: int, worker: str | None = None, sig: int = signal.SIGKILL
    ) -> FaultSchedule:
        """Kill the worker process only; its nanny starts it again (a new address, the same name)."""
        self.faults.append(Fault(at_step, "restart", 1, worker, sig))
        return self

    def freeze_worker(self, at_step: int) -> FaultSchedule:
        """SIGSTOP a compute worker (nanny and worker) that is a member holding micro-batches of the open
        step (`Progress.holding`). The scheduler keeps it for its worker-ttl; `thaw()` or a kill ends the
        freeze."""
        self.faults.append(Fault(at_step, "freeze", 1, None, signal.SIGSTOP))
        return self

    def thaw(self) -> None:
        """SIGKILL what this schedule froze (a frozen process cannot be stopped any other way)."""
        assert self.cluster is not None
        for record in self.log:
            if record.kind == "freeze":
                self.cluster.kill_worker(record.target)

    def pause_worker(self, at_step: int, seconds: float, worker: str | None = None) -> FaultSchedule:
        """SIGSTOP a compute worker (nanny and worker), then SIGCONT it `seconds` later (in the
        background): a hung device or a stuck read that ends by itself. Stopped for more than two liveness
        intervals, it leaves the membership; woken, its messages are of an old generation and it joins
        again."""
        if not 0.0 < seconds <= 600.0:
            raise ValueError(f"seconds={seconds!r}: give how long the pause lasts, > 0 and <= 600")
        self.faults.append(Fault(at_step, "pause", 1, worker, signal.SIGSTOP, seconds=seconds))
        return self

    def retire_worker(self, at_step: int, worker: str | None = None) -> FaultSchedule:
        """Retire a compute worker gracefully (`Client.retire_workers`)."""
        self.faults.append(Fault(at_step, "retire", 1, worker))
        return self

    def add_worker(self, at_step: int, count: int = 1) -> FaultSchedule:
        """Start `count` new elastic worker processes."""
        self.faults.append(Fault(at_step, "add", count))
        return self

    def kill_data_server(self, at_step: int, index: int, sig: int = signal.SIGKILL) -> FaultSchedule:
        """Kill for good the static worker (worker process and nanny) that holds data server `index`."""
        self.faults.append(Fault(at_step, "kill", 1, None, sig, role=f"data-server-{index}"))
        return self

    def kill_coordinator(self, at_step: int, sig: int = signal.SIGKILL) -> FaultSchedule:
        """Kill for good the static worker that holds the coordinator."""
        self.faults.append(Fault(at_step, "kill", 1, None, sig, role="coordinator"))
        return self

    def retire_data_server(self, at_step: int, index: int) -> FaultSchedule:
        """Retire gracefully the static worker that holds data server `index` (`Client.retire_workers`):
        the scheduler refuses while it holds the job's actor, and the job's controller hands its roles
        over, then retires it; this waits (in the background) until it left."""
        self.faults.append(Fault(at_step, "retire", 1, None, role=f"data-server-{index}"))
        return self

    def retire_coordinator(self, at_step: int) -> FaultSchedule:
        """Retire gracefully the static worker that holds the coordinator (as `retire_data_server`)."""
        self.faults.append(Fault(at_step, "retire", 1, None, role="coordinator"))
        return self

    def slow_worker(self, at_step: int, factor: float, worker: str | None = None) -> FaultSchedule:
        """Make a compute worker a straggler from `at_step` on: each micro-batch's compute takes `factor`
        times as long (`local.slow.Straggler`; one straggler at a time: a later one replaces it)."""
        if not factor >= 1.0:
            raise ValueError(f"factor={factor!r}: a straggler is slower, so give a factor of 1 or more")
        self.faults.append(Fault(at_step, "slow", 1, worker, factor=factor))
        return self

    def partition_worker(
        self, at_step: int, worker: str | None = None, heal_after: float = 20.0
    ) -> FaultSchedule:
        """Cut the network of a worker started in a network namespace (`LocalElasticCluster.add_worker(
        netns=...)`; `netns.NetworkNamespace.cut`: every packet in and out dropped), and heal it
        `heal_after` seconds later (in the background). `worker` (a name or an address; a static worker
        too) or, if None, a compute worker in the membership that runs in a namespace. Cut off for long
        enough, Dask's worker exits; a supervised one (``supervise=True``) is started again, and joins
        once the link heals."""
        if not 0.0 < heal_after <= 600.0:
            raise ValueError(f"heal_after={heal_after!r}: give how long the cut lasts, > 0 and <= 600")
        self.faults.append(Fault(at_step, "partition", 1, worker, seconds=heal_after))
        return self

    def add_static_worker(self, at_step: int, count: int = 1) -> FaultSchedule:
        """Start `count` new static worker processes (standbys for the job's static roles)."""
        self.faults.append(Fault(at_step, "add-static", count))
        return self

    @classmethod
    def random(
        cls,
        seed: int,
        steps: int,
        events: int,
        *,
        first_step: int = 2,
        min_alive: int = 1,
        start_alive: int = 2,
        data_server_kills: int = 0,
        data_servers: int = 2,
    ) -> FaultSchedule:
        """`events` kills, restarts and joins of compute workers at random steps in [first_step, steps),
        never leaving fewer than `min_alive` compute workers by the schedule's own count; and
        `data_server_kills` SIGKILLs of a data server's static worker (never data server 0's, which holds
        the coordinator), each with a new static worker started at the same step (the next standby)."""
        rng = random.Random(seed)
        schedule = cls(seed=seed)
        alive = start_alive
        for at in sorted(rng.randrange(first_step, steps) for _ in range(events)):
            kinds: list[FaultKind] = ["add", "restart"]
            if alive > min_alive:
                kinds += ["kill", "kill"]
            kind = rng.choice(kinds)
            schedule.faults.append(Fault(at, kind))
            alive += {"add": 1, "kill": -1}.get(kind, 0)
        if data_server_kills and data_servers < 2:
            raise ValueError("data_server_kills needs data_servers >= 2: data server 0 holds the coordinator")
        for at in sorted(rng.randrange(first_step, steps) for _ in range(data_server_kills)):
            index = rng.randrange(1, data_servers)
            schedule.kill_data_server(at, index).add_static_worker(at)
        schedule.faults.sort(key=lambda f: f.at_step)
        return schedule

    # -- running ---------------------------------------------------------------------------------

    def bind(self, cluster: LocalElasticCluster) -> FaultSchedule:
        self.cluster = cluster
        return self

    def apply(self, progress: Progress) -> None:
        if self.cluster is None:
            raise RuntimeError("FaultSchedule needs a LocalElasticCluster: train(..., cluster=...) binds it")
        if self._freezing is not None:
            self._check_freeze(progress)
        due = [f for f in self.faults if f.at_step <= progress.committed_steps]
        for fault in due:
            self.faults.remove(fault)
            for _ in range(fault.count):
                self._run(fault, progress)

    def watch(
        self,
        cluster: LocalElasticCluster,
        job_id: str,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> threading.Event:
        """Apply the schedule from a thread, following the progress that the controller of `job_id`
        publishes on the cluster (for a controller that runs elsewhere, such as a Prefect flow). Set the
        returned event to stop watching; it stops by itself when the job ends."""
        from ..registry import CONTROLLER_LOST, read_progress

        self.bind(cluster)
        done = threading.Event()

        def follow() -> None:
            with cluster.client() as client:
                while not done.wait(0.05):
                    progress = read_progress(client, job_id)
                    if progress is None:
                        continue
                    if on_progress is not None:
                        on_progress(progress)
                    if progress.state in ("done", "failed", CONTROLLER_LOST):
                        return
                    self.apply(progress)

        thread = threading.Thread(target=follow, name=f"fault-schedule-{job_id}", daemon=True)
        thread.start()
        self._background.append(thread)
        return done

    def wait(self, timeout: float = 60.0) -> None:
        """Wait for background actions (graceful retires, the ends of pauses) to finish."""
        for t in self._background:
            t.join(timeout)

    def _run(self, fault: Fault, progress: Progress) -> None:
        cluster = self.cluster
        assert cluster is not None
        if fault.kind == "add":
            target = cluster.add_worker(wait=False)
        elif fault.kind == "add-static":
            target = cluster.add_worker(static=True, wait=False)
        elif fault.kind == "freeze":
            picked = self._pick(progress, holding_only=True)
            if picked is None:
                self.faults.append(fault)  # nobody holds a batch right now; try at the next poll
                return
            cluster.kill_worker(picked, sig=signal.SIGSTOP)
            self._freezing = (fault, picked)
            return  # recorded once a fresh progress shows it froze while holding batches
        elif fault.kind == "partition":
            in_netns = [] if fault.worker else [w for w in sorted(progress.workers) if cluster.netns_of(w)]
            if fault.worker is None and not in_netns:
                self.faults.append(fault)  # no member in a namespace yet (one may be joining): next poll
                return
            target = fault.worker or self._rng.choice(in_netns)
            ns = cluster.netns_of(target)
            if ns is None:
                raise ValueError(f"partition: worker {target!r} was not started in a network namespace")
            ns.cut()
            heal = threading.Timer(fault.seconds, ns.heal)
            heal.daemon = True
            heal.start()
            self._background.append(heal)
        else:
            picked = fault.worker or (
                self._holder(progress, fault.role) if fault.role else self._pick(progress)
            )
            if picked is None:
                if fault.worker is None and fault.role is None:
                    # Every compute worker is gone or already hit (joins still starting): at the next
                    # poll, a worker that registered meanwhile is the target.
                    self.faults.append(fault)
                    return
                log.warning("fault %s at step %d: no worker to act on", fault.kind, fault.at_step)
                return
            target = picked
            if fault.kind == "pause":
                self._paused.add(target)
                cluster.kill_worker(target, sig=signal.SIGSTOP)
                wake = threading.Timer(fault.seconds, self._wake, args=(target,))
                wake.daemon = True
                wake.start()
                self._background.append(wake)
            elif fault.kind == "slow":
                cluster.slow_worker(target, fault.factor)
            elif fault.kind == "kill":
                cluster.kill_worker(target, sig=fault.sig)
            elif fault.kind == "restart":
                cluster.kill_worker(target, sig=fault.sig, restart=True)
            else:
                # A graceful retire takes a while; supervision must go on meanwhile.
                retire = self._retire_static if fault.role else cluster.retire_worker
                thread = threading.Thread(target=retire, args=(target,), daemon=True)
                thread.start()
                self._background.append(thread)
        record = FaultRecord(
            progress.committed_steps,
            fault.kind,
            target,
            time.time(),
            int(fault.sig) if fault.kind in ("kill", "restart") else 0,
            fault.role,
        )
        self.log.append(record)
        log.info("fault: %s %s at step %d", fault.kind, target, progress.committed_steps)

    def _wake(self, worker: str) -> None:
        assert self.cluster is not None
        with contextlib.suppress(ValueError, RuntimeError):  # killed meanwhile, or the cluster closed
            self.cluster.kill_worker(worker, sig=signal.SIGCONT)
        self._paused.discard(worker)  # awake: a target again

    def _retire_static(self, worker: str) -> None:
        assert self.cluster is not None
        with self.cluster.client() as client:
            client.retire_workers([worker], close_workers=True)  # refused while it holds an actor
        self.cluster.wait_until_gone([worker])  # the job's controller retires it once its roles moved

    def _check_freeze(self, progress: Progress) -> None:
        # The progress that chose the worker is a few ms old: the worker may have left the membership or
        # handed its share back since. A stopped process can change nothing, so the first progress after
        # the stop tells for sure whether it froze as a member holding micro-batches. Only that is
        # checked: how many it holds may or may not change once it is frozen.
        assert self._freezing is not None and self.cluster is not None
        fault, target = self._freezing
        self._freezing = None
        if self._holds(progress, target):
            self.log.append(FaultRecord(progress.committed_steps, "freeze", target, time.time()))
            log.info("fault: froze %s holding %d micro-batches", target, progress.holds(target))
        else:
            self.cluster.kill_worker(target, sig=signal.SIGCONT)
            self.faults.append(fault)

    @staticmethod
    def _holder(progress: Progress, role: str) -> str | None:
        """The static worker holding `role` ("data-server-<i>", "coordinator") as the progress says."""
        if role == "coordinator":
            return progress.coordinator_at
        index = int(role.removeprefix("data-server-"))
        return progress.data_servers[index] if index < len(progress.data_servers) else None

    @staticmethod
    def _holds(progress: Progress, worker: str) -> bool:
        """Whether `worker` is a member with a non-empty share of the open step."""
        return worker in progress.workers and progress.holds(worker) > 0

    def _pick(self, progress: Progress, holding_only: bool = False) -> str | None:
        # Prefer compute workers that hold micro-batches (a fault mid-step), then other members; never
        # one this schedule already hit (a killed worker stays in the scheduler's list for a few ms).
        hit = {r.target for r in self.log if r.kind not in ("add", "pause")} | self._paused
        live = [w for w in (self.cluster.elastic_addresses() if self.cluster else []) if w not in hit]
        members = [w for w in sorted(progress.workers) if w in live]
        holders = [w for w in members if self._holds(progress, w)]
        candidates = holders if holding_only else holders or members or sorted(live)
        return self._rng.choice(candidates) if candidates else None
