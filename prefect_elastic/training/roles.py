"""The static roles: every role's worker checked at each look, a retiring static worker's roles handed over,
a lost coordinator rebuilt from the controller's copy of its record, and every shard sent back to the
checkpoint when a shard's last copy is lost.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ..data_server import warm_standby
from ..errors import (
    DataServerLostError,
)
from ..messages import (
    EventKind,
    Journal,
    MembershipEvent,
)
from .actors import START_TRIES
from .calls import controller_handle, settled_result
from .pacing import MEMBERSHIP_POLL_SECONDS
from .signals import CoordinatorLost, StartCancelled, StaticWorkerLeft
from .workers import WorkersView, standbys

if TYPE_CHECKING:
    from .run import TrainingRun

log = logging.getLogger(__name__)


class StaticRoles:
    """(of a `TrainingRun`)"""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.job = run.job
        self.client = run.client

    def keep_roles(self, view: WorkersView) -> None:
        """Check that every role's static worker is still there; give a lost data server's role to a
        standby. A lost coordinator raises `CoordinatorLost`, which `supervise` answers by rebuilding it."""
        self.run.standbys = standbys(
            [w for w in view.static if w not in self.run.leaving], self.run.placement
        )
        for worker in self.run.actors.engine_loaded_on(self.run.standbys):
            if worker not in self.run.warmed:
                # Fire and forget: a standby promoted before it finished is only slower to start.
                self.run.warmed[worker] = self.client.submit(
                    warm_standby, self.run.specs.shard, workers=[worker], allow_other_workers=False,
                    pure=False,
                    key=f"prefect-elastic-{self.job.job_id}-{self.run.run_id}-warm-{worker}",
                )  # fmt: skip
        if self.run.coordinator_at not in view.static:
            raise CoordinatorLost(f"its static worker {self.run.coordinator_at} left the cluster")
        lost = [i for i, where in enumerate(self.run.placement) if where not in view.static]
        if lost:
            self.run.promotion.promote_standbys(lost)
        for worker in sorted(self.run.retiring):
            # (Dropped first: a hand-over that raises is not tried again at every check.)
            self.run.retiring.discard(worker)
            if worker in view.static and not self.hand_over(worker):
                # No standby can relieve it yet: asked again at the next check, so it goes once one is
                # heard from (a SIGTERMed one closes by itself meanwhile, after `SIGTERM_HAND_OVER_SECONDS`).
                self.run.retiring.add(worker)

    def hand_over(self, worker: str) -> bool:
        """Someone asked to retire the static worker `worker` (`Client.retire_workers`, a cluster scaling
        down), which the scheduler refuses while it holds an actor: hand its roles over before it goes.
        Training stops at a step every shard applied, which is snapshotted (its copies whole on the peers);
        its data servers go to standbys from that snapshot and its coordinator is rebuilt elsewhere, so no
        committed step is redone. Then it is retired. False if no standby can take its data servers now (none
        is there, or none was heard from lately: a loaded machine delays heartbeats); it is then asked
        again at the next survival check."""
        job = self.job
        indices = [i for i, w in enumerate(self.run.placement) if w == worker]
        if indices or worker == self.run.coordinator_at:
            if indices and not standbys(self.run.workers.view().static, self.run.placement):
                if worker not in self.run.retire_waiting:
                    self.run.retire_waiting.add(worker)
                    log.warning(
                        "job %s: static worker %s is asked to retire, but no standby can take data servers "
                        "%s now; it is retired once one can (start a static worker if there is none)",
                        job.job_id, worker, indices,
                    )  # fmt: skip
                return False
            self.run.retire_waiting.discard(worker)
            reason = f"static worker {worker} is retiring"
            self.run.leaving.add(worker)
            log.warning("job %s: %s; handing over its roles", job.job_id, reason)
            self.run.calls.call(self.run.coordinator.hand_over(indices, reason), timeout=3 * job.call_timeout)
            if indices:
                self.run.promotion.promote_standbys(indices)
            if worker == self.run.coordinator_at:
                self.run._copy_journal()
                self.rebuild_coordinator(reason)
        self.client.retire_workers([worker], close_workers=True)
        self.run._check_soon()  # a survival check hands roles out again at once
        return True

    def restore_from_checkpoint(self, lost: list[int], why: str) -> None:
        """Data servers lost with the replicas of their shards: every shard goes back to the newest
        persistent checkpoint in the same run (the lost ones on standbys, the others on their workers, all
        started afresh from it), and the coordinator to the record of that step (`Coordinator.rebuild`
        from the controller's copy). Without `checkpoint` on the job, fails naming the lost data servers."""
        job = self.job
        if self.run.mode.shards_apart:
            # (The coordinator's loss too, with data server 0 and no replica of its shard: the shards stand
            # at different versions, which the rebuild from a checkpoint does not handle yet.)
            raise DataServerLostError(
                f"{why}; async mode cannot go back to a checkpoint in the same run yet "
                "(docs/design/async.md): run the job again (it resumes from its checkpoint), or use "
                "mode='sync'"
            )
        found = self.run.persistence.fallback()
        if found is None:
            raise DataServerLostError(
                f"{why}. Job {job.job_id} has no `checkpoint` to go back to in the same run: set one, or "
                "run the job again (with `checkpoint` set it resumes from the last checkpoint)"
            )
        checkpoint, source = found
        began, clock = time.time(), time.monotonic()
        log.warning("job %s: %s; every shard goes back to %s", job.job_id, why, source)
        holders = list(self.run.placement)
        for i in lost:
            holders[i] = self.run.promotion.wait_for_standby(i, taken=holders)
        futures = [
            self.run.actors.submit_data_server(
                i, holders[i], self.run.persistence.shard_start(i, names, checkpoint)
            )
            for i, names in enumerate(self.run.plan)
        ]
        shards = [settled_result(f, self.run.actors.startup_timeout()) for f in futures]
        channels = [s.open_channel().result(timeout=job.call_timeout) for s in shards]
        old, self.run.actor_futures = self.run.actor_futures, futures
        for i, shard in enumerate(self.run.shards):
            if i not in lost:
                with contextlib.suppress(Exception):
                    shard.close_channel().result(timeout=job.call_timeout)
        with contextlib.suppress(Exception):
            self.client.cancel(old)
        self.run.shards[:], self.run.channels[:], self.run.placement[:] = shards, channels, holders
        version = checkpoint.committed_steps if checkpoint is not None else 0
        event: MembershipEvent = self.run.calls.call(
            self.run.coordinator.rebuild(
                self.run.journal, self.run.shards, self.run.channels, [], self.run.coordinator_at,
                f"{why}; every shard went back to {source} (step {version})", began, EventKind.RESTORED,
            ),
            timeout=3 * job.call_timeout,
        )  # fmt: skip
        self.run._told_lost.clear()
        self.run.standbys = tuple(w for w in self.run.standbys if w not in self.run.placement)
        self.run.journal = Journal()
        self.run._copy_journal()
        self.run._check_soon()
        log.warning(
            "job %s: every shard back to %s at step %d in %.2f s (%d committed steps to train again)",
            job.job_id, source, event.step, time.monotonic() - clock, event.steps_lost,
        )  # fmt: skip

    def rebuild_coordinator(self, reason: str) -> None:
        """The coordinator's static worker died: start a coordinator on another static worker and rebuild
        its record from the controller's copy and from the shards (`Coordinator.rebuild`). Compute loops
        start over with the new handle; data servers lost with it are promoted next, as any lost one."""
        began, clock = time.time(), time.monotonic()
        job, lost_at = self.job, self.run.coordinator_at
        log.warning("job %s: the coordinator is lost (%s); rebuilding it", job.job_id, reason)
        cancelled = 0
        while True:
            # The worker chosen may be dying too (two static workers killed at once): place it again then.
            where = self.place_coordinator(lost_at)
            future = self.run.actors.submit_coordinator(where, None)
            try:
                coordinator = controller_handle(
                    self.run.calls.wait_unless_left(future, where, self.run.actors.startup_timeout())
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
        static = self.run.workers.view().static
        lost = [i for i, holder in enumerate(self.run.placement) if holder not in static]
        started = time.monotonic() - clock
        old, self.run.coordinator_future = self.run.coordinator_future, future
        self.run.coordinator, self.run.coordinator_at = coordinator, where
        with contextlib.suppress(Exception):
            self.client.cancel([old])  # released: gone with its worker, or (a hand-over) that worker retires
        # Compute loops hold the old coordinator's handle: they start over with the new one (a loop that
        # was cancelled ends at its next step, and whatever it sends is of an old generation).
        for addr, loop in self.run.loops.items():
            loop.cancel()
            self.run.loop_restarts[addr] = max(0, self.run.loop_restarts.get(addr, 1) - 1)
        self.run.loops.clear()
        self.run._check_soon()
        for ask in (True, False):  # the second time with the data servers that answered
            try:
                event: MembershipEvent = self.run.calls.call(
                    coordinator.rebuild(
                        self.run.journal, self.run.shards, self.run.channels, lost, where, reason, began,
                        EventKind.COORDINATOR_REBUILT,
                    ),
                    timeout=3 * job.call_timeout,
                )  # fmt: skip
                break
            except CoordinatorLost:
                raise
            except DataServerLostError as exc:
                # Data servers died with it, and with them the replicas of their shards; or they were
                # only silent for a moment, and answer (then the rebuild takes them in).
                back = self.run.calls.answering(lost) if ask else set()
                if not back:
                    why = f"the coordinator's static worker {lost_at} died: {exc}"
                    self.restore_from_checkpoint(lost, why)
                    return
                lost = [i for i in lost if i not in back]
                self.run._told_lost -= back
                for i in back:
                    self.run._kept[(i, self.run.placement[i])] += 1
        # The copy is kept until the new coordinator's first part replaces it whole (a rebuilt record
        # sends everything from step 0): the shards dropped the records of the steps it holds
        # (`records_kept_from`), so if the new coordinator died before that part came, the next one would
        # have nothing else to rebuild those steps from.
        self.run._copy_journal()
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
            static = [w for w in self.run.workers.view().static if w not in self.run.leaving]
            beside = [w for w in self.run.placement if w in static]
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
