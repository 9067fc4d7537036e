"""The static roles: every role's worker checked at each look (the decision: `membership.role_changes`), a
retiring static worker's roles handed over (`membership.retire`), a lost coordinator rebuilt from the
controller's copy of its record.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed import Client

from ..data_server import warm_standby
from ..errors import (
    DataServerLostError,
)
from ..messages import (
    EventKind,
    MembershipEvent,
)
from .actors import START_TRIES
from .calls import controller_handle
from .membership import HoldRetire, RebuildCoordinator, RoleChange, retire, role_changes
from .pacing import MEMBERSHIP_POLL_SECONDS
from .signals import CoordinatorLost, StartCancelled, StaticWorkerLeft
from .workers import WorkersView, standbys

if TYPE_CHECKING:
    from .actors import Actors
    from .calls import Calls
    from .engine import EngineLoads
    from .fallback import CheckpointFallback
    from .loops import ComputeLoops
    from .prepare import Prepared
    from .promotion import Promotions
    from .record_copy import RecordCopy
    from .role_table import RoleTable
    from .workers import Workers

log = logging.getLogger(__name__)


class StaticRoles:
    """The static roles kept: the membership decision on them (`membership.role_changes`, `retire`)
    carried out at every look, the coordinator rebuilt."""

    def __init__(
        self,
        client: Client,
        prepared: Prepared,
        key_prefix: str,
        roles: RoleTable,
        workers: Workers,
        calls: Calls,
        actors: Actors,
        engine: EngineLoads,
        promotions: Promotions,
        fallback: CheckpointFallback,
        loops: ComputeLoops,
        record: RecordCopy,
        check_soon: Callable[[], None],
    ) -> None:
        self.client = client
        self.prepared = prepared
        self.job = prepared.job
        self.key_prefix = key_prefix
        self.roles = roles
        self.workers = workers
        self.calls = calls
        self.actors = actors
        self.engine = engine
        self.promotions = promotions
        self.fallback = fallback
        self.loops = loops
        self.record = record
        self.check_soon = check_soon  # a survival check hands roles out again at once

    def keep_roles(self, view: WorkersView) -> None:
        """Check that every role's static worker is still there; give a lost data server's role to a
        standby. A lost coordinator raises `CoordinatorLost`, which `supervise` answers by rebuilding it."""
        self.warm(self.roles.seen_standbys(view.static))
        for change in role_changes(self.roles.coordinator_at, self.roles.placement, view.static):
            self.carry_out(change)
        for worker in self.workers.retire_requests():
            # (Dropped first: a hand-over that raises is not tried again at every check.)
            self.workers.retire_taken(worker)
            if worker in view.static:
                self.hand_over(worker)

    def carry_out(self, change: RoleChange) -> None:
        if isinstance(change, RebuildCoordinator):
            # (Raised for `supervise`, which waits for the scheduler first: `TrainingRun.supervise`.)
            raise CoordinatorLost(change.reason)
        self.promotions.promote(list(change.indices))

    def warm(self, standbys: tuple[str, ...]) -> None:
        """Make the standbys ready to take a role (`warm_standby`)."""
        for worker in self.engine.loaded_on(standbys):
            if worker not in self.roles.warmed:
                # Fire and forget: a standby promoted before it finished is only slower to start.
                self.roles.warming(worker, self.client.submit(
                    warm_standby, self.prepared.specs.shard, workers=[worker], allow_other_workers=False,
                    pure=False, key=f"{self.key_prefix}-warm-{worker}",
                ))  # fmt: skip

    def hand_over(self, worker: str) -> bool:
        """Someone asked to retire the static worker `worker` (`Client.retire_workers`, a cluster scaling
        down), which the scheduler refuses while it holds an actor: hand its roles over before it goes.
        Training stops at a step every shard applied, which is snapshotted (its copies whole on the peers);
        its data servers go to standbys from that snapshot and its coordinator is rebuilt elsewhere, so no
        committed step is redone. Then it is retired. False if no standby can take its data servers now (none
        is there, or none was heard from lately: a loaded machine delays heartbeats); it is then asked
        again at the next survival check, so it goes once one is heard from (a SIGTERMed one closes by
        itself meanwhile, after `SIGTERM_HAND_OVER_SECONDS`)."""
        job, roles = self.job, self.roles
        # (The workers' view is read only where there are data servers to place.)
        free = standbys(self.workers.view().static, roles.placement) if roles.on(worker) else ()
        decision = retire(worker, roles.placement, roles.coordinator_at, free)
        if isinstance(decision, HoldRetire):
            if self.workers.retire_waits(worker):
                log.warning(
                    "job %s: static worker %s is asked to retire, but no standby can take data servers "
                    "%s now; it is retired once one can (start a static worker if there is none)",
                    job.job_id, worker, list(decision.indices),
                )  # fmt: skip
            return False
        if decision.indices or decision.coordinator:
            self.workers.handing_over(worker)
            reason = f"static worker {worker} is retiring"
            roles.hand_over_begun(worker)
            log.warning("job %s: %s; handing over its roles", job.job_id, reason)
            indices = list(decision.indices)
            self.calls.call(roles.coordinator.hand_over(indices, reason), timeout=3 * job.call_timeout)
            if indices:
                self.promotions.promote(indices)
            if decision.coordinator:
                self.record.update()
                self.rebuild_coordinator(reason)
        self.client.retire_workers([worker], close_workers=True)
        self.check_soon()
        return True

    def rebuild_coordinator(self, reason: str) -> None:
        """The coordinator's static worker died: start a coordinator on another static worker and rebuild
        its record from the controller's copy and from the shards (`Coordinator.rebuild`). Compute loops
        start over with the new handle; data servers lost with it are promoted next, as any lost one."""
        began, clock = time.time(), time.monotonic()
        job, lost_at = self.job, self.roles.coordinator_at
        log.warning("job %s: the coordinator is lost (%s); rebuilding it", job.job_id, reason)
        cancelled = 0
        while True:
            # The worker chosen may be dying too (two static workers killed at once): place it again then.
            where = self.place_coordinator(lost_at)
            future = self.actors.submit_coordinator(where, None)
            try:
                coordinator = controller_handle(
                    self.calls.wait_unless_left(future, where, self.actors.startup_timeout())
                )
                break
            except (StaticWorkerLeft, StartCancelled) as exc:
                with contextlib.suppress(Exception):
                    self.client.cancel([future])
                cancelled += isinstance(exc, StartCancelled)
                if cancelled >= START_TRIES:
                    raise DataServerLostError(
                        f"the coordinator of job {job.job_id} could not be rebuilt: Dask cancelled its start "
                        f"{cancelled} times ({exc})"
                    ) from exc
        lost = self.roles.lost(self.workers.view().static)
        started = time.monotonic() - clock
        old = self.roles.coordinator_moved(coordinator, where, future)
        with contextlib.suppress(Exception):
            self.client.cancel([old])  # released: gone with its worker, or (a hand-over) that worker retires
        # Compute loops hold the old coordinator's handle: they start over with the new one.
        self.loops.drop_all()
        self.check_soon()
        for ask in (True, False):  # the second time with the data servers that answered
            try:
                event: MembershipEvent = self.calls.call(
                    coordinator.rebuild(
                        self.record.journal, self.roles.shards, self.roles.channels, lost, where, reason,
                        began, EventKind.COORDINATOR_REBUILT,
                    ),
                    timeout=3 * job.call_timeout,
                )  # fmt: skip
                break
            except CoordinatorLost:
                raise
            except DataServerLostError as exc:
                # Data servers died with it, and with them the replicas of their shards; or they were
                # only silent for a moment, and answer (then the rebuild takes them in).
                back = self.calls.answering(lost) if ask else set()
                if not back:
                    why = f"the coordinator's static worker {lost_at} died: {exc}"
                    self.fallback.restore(lost, why)
                    return
                lost = [i for i in lost if i not in back]
                for i in back:
                    self.roles.keep(i)
        # The copy is kept until the new coordinator's first part replaces it whole (a rebuilt record
        # sends everything from step 0): the shards dropped the records of the steps it holds
        # (`records_kept_from`), so if the new coordinator died before that part came, the next one would
        # have nothing else to rebuild those steps from.
        self.record.update()
        log.warning(
            "job %s: coordinator rebuilt on %s at step %d, %.2f s after it was seen lost (start %.3f s, "
            "rebuild %.3f s)%s",
            job.job_id, where, event.step, time.monotonic() - clock, started,
            time.monotonic() - clock - started, f"; data servers {lost} lost with it" if lost else "",
        )  # fmt: skip

    def place_coordinator(self, lost_at: str) -> str:
        """Where a rebuilt coordinator goes: beside a live data server (it needs little memory, and the
        standbys stay free for data servers), else on a standby; waits up to `min_workers_timeout` for a
        static worker to join."""
        deadline = time.monotonic() + self.job.min_workers_timeout
        while True:
            static = [w for w in self.workers.view().static if w not in self.roles.leaving]
            beside = [w for w in self.roles.placement if w in static]
            if beside or static:
                return (beside or list(static))[0]
            if time.monotonic() >= deadline:
                raise DataServerLostError(
                    f"the coordinator of job {self.job.job_id} was lost with its static worker {lost_at}, "
                    f"and no static worker was left or joined within {self.job.min_workers_timeout:g} s "
                    f"(min_workers_timeout) to rebuild it on: start one with "
                    f"`dask worker <scheduler> --resources {self.job.static_resource}=1`"
                )
            time.sleep(MEMBERSHIP_POLL_SECONDS)
