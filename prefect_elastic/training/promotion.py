"""A lost data server's role goes to a standby: started from its peer's replica of the last snapshot
every shard holds (or from the start, or the checkpoint), then promoted by the coordinator in a new
generation; a data server that was only silent keeps its role.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from typing import TYPE_CHECKING

from distributed import Future

from ..checkpoint import ShardStart
from ..compute import leave_links
from ..coordinator import actor_key
from ..errors import (
    DataServerLostError,
)
from ..messages import (
    MembershipEvent,
    Promotion,
    ShardHandle,
)
from ..wire import ChannelAddress
from .actors import START_TRIES
from .calls import LEAVING_GRACE_SECONDS
from .pacing import MEMBERSHIP_POLL_SECONDS
from .signals import CoordinatorLost, StartCancelled, StaticWorkerLeft
from .workers import pass_over_standby, readiest_first, standbys

if TYPE_CHECKING:
    from .run import TrainingRun

log = logging.getLogger(__name__)


class Promotions:
    """(of a `TrainingRun`)"""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.job = run.job
        self.client = run.client
        # The standby a data server is being started on: silent to the scheduler, it is asked for Dask's
        # handshake before it counts as gone (`Workers.view`), as a role's worker is.
        self.starting_on: set[str] = set()

    def promote_standbys(self, lost: list[int], ask: bool = True) -> None:
        """Suspend training, then for each lost data server: start one on a standby static worker, from
        its peer's in-memory replica of the last snapshot every shard holds, and let the coordinator bring
        every shard to that snapshot in a new generation (`Coordinator.promote`). Where that would lose a
        shard, lost data servers are asked first if `ask` (`Calls.answering`; once: not again when this calls
        itself after asking)."""
        job, coordinator, shards = self.job, self.run.coordinator, self.run.shards
        seen, clock = time.time(), time.monotonic()
        left = ", ".join(sorted({self.run.placement[i] for i in lost}))
        told = coordinator.shards_lost(lost, f"static worker {left} left", [shards[i].key for i in lost])
        targets = dict.fromkeys(lost, self.run.calls.call(told))
        if self.run.mode.shards_apart:
            # Each shard snapshots at its own version (async mode): each standby starts from its own.
            targets = {i: self.run.calls.call(coordinator.snapshot_version(i)) for i in lost}
        suspended = time.monotonic() - clock

        def peer_holding_replica(i: int) -> ShardHandle | None:
            # The peer, if it holds the copy of the snapshot to go back to (one promoted since holds none).
            peer = (i + 1) % len(shards)
            if not job.peer_replicas or peer in lost or peer == i:
                return None
            try:
                asked = shards[peer].status(self.run.schedule.total_steps)
            except RuntimeError as exc:  # Dask already knows the peer's worker is gone
                raise StaticWorkerLeft(self.run.placement[peer]) from exc
            status = self.run.calls.wait_unless_left(asked, self.run.placement[peer], job.call_timeout)
            return shards[peer] if targets[i] in status.replicas else None

        try:
            replicas = {i: peer_holding_replica(i) for i in lost}
        except StaticWorkerLeft as left:
            # A peer died too, after the first loss was seen: its replica is gone with it.
            self.promote_standbys(
                sorted({*lost, *(j for j, w in enumerate(self.run.placement) if w == left.worker)}), ask
            )
            return
        unrestorable = [
            i
            for i in lost
            if replicas[i] is None and targets[i] != self.run.persistence.shard_start(i, []).version
        ]
        # Only silent for a moment (`Calls.answering`): each keeps its role, and the rest are promoted.
        asked = ask and bool(unrestorable)
        kept = [i for i in sorted(self.run.calls.answering(lost) if asked else ()) if self.keep(i)]
        if kept:
            rest = [i for i in lost if i not in kept]
            if rest:
                self.promote_standbys(rest, ask=False)
            else:
                self.run._copy_journal()
            return
        if unrestorable:
            if not job.peer_replicas:
                why = "the job has peer_replicas=False, so no copy of a shard was kept"
            else:
                why = "; ".join(
                    f"data server {i}'s replica was held by data server {(i + 1) % len(shards)}, "
                    + ("lost with it" if (i + 1) % len(shards) in lost else "whose own worker died since")
                    for i in unrestorable
                )
            self.run.roles.restore_from_checkpoint(
                lost, f"data servers {unrestorable} cannot be restored: {why}"
            )
            return
        for i in lost:
            replica = replicas[i]
            start = None if replica is not None else self.run.persistence.shard_start(i, self.run.plan[i])
            while True:
                try:
                    standby, future, shard, channel, started, adopted = self.start_on_standby(
                        i, start, targets[i], replica
                    )
                except StaticWorkerLeft:
                    # The peer died too (after the first loss was seen): its replica is gone with it.
                    self.promote_standbys(
                        sorted({*lost[lost.index(i) :], (i + 1) % len(shards)}), ask=not asked
                    )
                    return
                clock = time.monotonic()
                try:
                    event = self.promote_on(i, standby, future, shard, channel)
                    break
                except StaticWorkerLeft:
                    continue  # the standby died in the middle of its promotion: the next one
            promotion = Promotion(
                index=i, lost_worker=self.run.placement[i], standby=standby, step=event.step, seen=seen,
                suspend=suspended, start=started, adopt=adopted, promote=time.monotonic() - clock,
                source="start" if replica is None else "replica",
            )  # fmt: skip
            self.run.promotions.append(promotion)
            # The old data server's actor is released: it is gone with its worker, or (a hand-over) its
            # worker is retiring and must not hold it.
            old, self.run.actor_futures[i] = self.run.actor_futures[i], future
            with contextlib.suppress(Exception):
                self.client.cancel([old])
            moved = self.run.channels[i]
            shards[i], self.run.channels[i], self.run.placement[i] = shard, channel, standby
            self.starting_on = set()  # (a role's worker now)
            self.run._told_lost.discard(i)
            self.leave_links([moved])
            log.warning(
                "job %s: data server %d now on standby %s at step %d, %.2f s after it was lost (suspend "
                "%.3f s, start %.3f s, copy from the peer %.3f s, promote %.3f s)",
                job.job_id, i, standby, event.step, time.time() - seen, suspended, started, adopted,
                promotion.promote,
            )  # fmt: skip
            suspended = 0.0
        self.run.standbys = tuple(w for w in self.run.standbys if w not in self.run.placement)
        self.run._copy_journal()

    def leave_links(self, channels: list[ChannelAddress]) -> None:
        """Tell the compute loops to drop their connections to `channels`, where shards whose roles moved
        listened (`compute.leave_links`): one blocked on a frozen static worker would wait a call timeout.
        Not waited for: a member that does not answer has its own loop to wake, or none."""
        members = sorted(a for a in self.run.known_live if a in self.run.loops)
        if not members:
            return

        async def tell() -> None:
            with contextlib.suppress(Exception):
                await self.client._run(
                    leave_links,
                    self.job.job_id,
                    [tuple(c) for c in channels],
                    workers=members,
                    on_error="return",
                )

        if self.client.loop is not None:
            self.client.loop.add_callback(tell)

    def keep(self, index: int) -> bool:
        """Data server `index`, taken for lost, answered (`Calls.answering`): it keeps its role, every shard
        brought to the snapshot as in a promotion (`Coordinator.promote` with its own handle: event `kept`).
        False if that failed (it died or stalled meanwhile): it is lost after all."""
        where = self.run.placement[index]
        try:
            event = self.run.calls.call(
                self.run.coordinator.promote(index, self.run.shards[index], self.run.channels[index], where)
            )
        except CoordinatorLost:
            raise
        except Exception as exc:
            log.warning("job %s: data server %d could not keep its role (%s)", self.job.job_id, index, exc)
            return False
        self.run._kept[(index, where)] += 1
        self.run._told_lost.discard(index)
        log.warning("job %s: data server %d keeps its role at step %d", self.job.job_id, index, event.step)
        return True

    def promote_on(
        self, index: int, standby: str, future: Future, shard: ShardHandle, channel: ChannelAddress
    ) -> MembershipEvent:
        """`Coordinator.promote`: the data server just started on `standby` takes the role of lost shard
        `index`. If the standby dies meanwhile, the coordinator is told at once (`Calls.tell_lost_shards`: a
        call to a dead worker waits for Dask's connect timeout), the data server is released and
        `StaticWorkerLeft` raised, for the next standby; so is it when the coordinator is lost (its
        rebuild promotes a standby again)."""
        key = actor_key(shard) or ""  # what `shards_lost` matches
        self.run._promoting = (index, standby, key)
        try:
            return self.run.calls.call(self.run.coordinator.promote(index, shard, channel, standby))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.client.cancel([future])
            if isinstance(exc, CoordinatorLost) or not self.run.calls.leaves_soon(
                standby, LEAVING_GRACE_SECONDS
            ):
                raise
            log.warning(
                "job %s: standby %s left while data server %d was promoted on it (%s); taking the next",
                self.job.job_id, standby, index, exc,
            )  # fmt: skip
            # It may have died after the coordinator counted it promoted (while peers were named again):
            # then it is lost again, for the next standby (keyed: a no-op where it was not promoted).
            reason = f"standby {standby} left during its promotion"
            self.run.calls.call(self.run.coordinator.shards_lost([index], reason, [key]))
            raise StaticWorkerLeft(standby) from exc
        finally:
            self.run._promoting = None

    def start_on_standby(
        self, index: int, start: ShardStart | None, version: int, replica: ShardHandle | None
    ) -> tuple[str, Future, ShardHandle, ChannelAddress, float, float]:
        """A data server for shard `index` on a standby: started from `start`, or empty and then given the
        snapshot of `version` from `replica` (the peer). A standby that dies meanwhile is passed over for
        the next one (a call to it would wait for the startup timeout); the peer's death raises
        `StaticWorkerLeft` for the peer. Returns the standby, the actor's future, its handle, where its
        channel listens, and the seconds its start and the copy from the peer took."""
        peer_at = self.run.placement[(index + 1) % len(self.run.placement)]
        cancelled = 0
        while True:
            waited = time.monotonic()
            standby = self.wait_for_standby(index)
            clock = time.monotonic()
            waited = clock - waited
            future: Future | None = None
            watched = standby  # the worker whose loss would explain a broken call
            self.starting_on = {standby}
            passed_over = functools.partial(self.standby_gone, standby)
            try:
                warm = self.warmth(standby)
                self.run.actors.await_engine(standby, self.run.actors.startup_timeout(), gone=passed_over)
                engine = time.monotonic() - clock
                future = self.run.actors.submit_data_server(index, standby, start, version)
                shard: ShardHandle = self.run.calls.wait_unless_left(
                    future,
                    standby,
                    self.run.actors.startup_timeout(),
                    gone=passed_over,
                )
                started = time.monotonic() - clock
                log.info(
                    "job %s: data server %d started on standby %s (%s) in %.3f s: the engine's load %.3f s, "
                    "the actor %.3f s (%.3f s waited for a standby before)",
                    self.job.job_id, index, standby, warm, started, engine, started - engine, waited,
                )  # fmt: skip
                if replica is not None:
                    watched = peer_at
                    self.run.calls.wait_unless_left(
                        shard.adopt(replica, version), peer_at, self.run.actors.startup_timeout()
                    )
                    watched = standby
                adopted = time.monotonic() - clock - started
                channel = self.run.calls.wait_unless_left(
                    shard.open_channel(),
                    standby,
                    self.job.call_timeout,
                    gone=passed_over,
                )
                return standby, future, shard, channel, started, adopted
            except Exception as exc:
                self.starting_on = set()
                if future is not None:
                    with contextlib.suppress(Exception):
                        self.client.cancel([future])
                if isinstance(exc, StartCancelled):
                    cancelled += 1
                    if cancelled >= START_TRIES:
                        raise DataServerLostError(
                            f"data server {index} of job {self.job.job_id} could not be started on a "
                            f"standby: Dask cancelled its start {cancelled} times ({exc})"
                        ) from exc
                    log.warning("job %s: %s on standby %s; starting it again", self.job.job_id, exc, standby)
                    continue
                gone = isinstance(exc, StaticWorkerLeft) and exc.worker == standby
                if isinstance(exc, StaticWorkerLeft) and not gone:
                    raise  # the peer
                # A broken call to the standby had its grace (`Calls.wait_unless_left`); the copy from the
                # peer may have broken because the standby, which receives it, died.
                if not gone and (
                    watched == standby or not self.run.calls.leaves_soon(standby, LEAVING_GRACE_SECONDS)
                ):
                    raise
                log.warning(
                    "job %s: standby %s left while data server %d started on it (%s); taking the next",
                    self.job.job_id, standby, index, exc,
                )  # fmt: skip

    def standby_gone(self, standby: str) -> bool:
        """Whether to give up the standby a data server is being started on (`pass_over_standby`)."""
        view = self.run.workers.view()
        others = [w for w in view.static if w not in self.run.leaving and w != standby]
        return pass_over_standby(
            listed=standby in view.static or standby in view.silent_static,
            silent_for=None if standby in view.static else view.silence.get(standby, math.inf),
            another_free=bool(standbys(others, self.run.placement)),
            patience=self.job.call_timeout,
        )

    def warmth(self, standby: str) -> str:
        """Where `standby`'s warming (`warm_standby`) stands, for the promotion's log."""
        warmed = self.run.warmed.get(standby)
        if warmed is None:
            return "not warmed"
        return "warm" if warmed.done() else "still warming"

    def wait_for_standby(self, index: int, taken: list[str] | None = None) -> str:
        """A static worker holding no data server of this job (nor one of `taken`); waits up to
        `min_workers_timeout` for one to join, then fails naming the role."""
        deadline = time.monotonic() + self.job.min_workers_timeout
        while True:
            view = self.run.workers.view()
            free = standbys(
                [w for w in view.static if w not in self.run.leaving], taken or self.run.placement
            )
            if free:
                warm = {w for w, f in self.run.warmed.items() if f.done()}
                warming = set(self.run.warmed) - warm
                return readiest_first(free, warm, warming)[0]
            if time.monotonic() >= deadline:
                raise DataServerLostError(
                    f"data server {index} of job {self.job.job_id} was lost with its static worker "
                    f"{self.run.placement[index]}, and no standby static worker joined within "
                    f"{self.job.min_workers_timeout:g} s (min_workers_timeout): start one with "
                    f"`dask worker <scheduler> --resources {self.job.static_resource}=1`"
                )
            time.sleep(MEMBERSHIP_POLL_SECONDS)
