"""A lost data server's role goes to a standby: started from its peer's replica of the last snapshot
every shard holds (or from the start, or the checkpoint), then promoted by the coordinator in a new
generation; a data server that was only silent keeps its role.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from distributed import Client, Future

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
from .recovery import (
    Again,
    kept_answered,
    peer_gone_during_start,
    peer_gone_while_asked,
    plan_recovery,
    replica_peer,
)
from .signals import CoordinatorLost, StartCancelled, StaticWorkerLeft

if TYPE_CHECKING:
    from .actors import Actors
    from .calls import Calls
    from .fallback import CheckpointFallback
    from .loops import ComputeLoops
    from .prepare import Prepared
    from .record_copy import RecordCopy
    from .role_table import RoleTable
    from .standby import StandbyChoice
    from .workers import Workers

log = logging.getLogger(__name__)


class Promotions:
    """A lost data server's role given to a standby: the plan (`recovery.plan_recovery`) made, then carried
    out, and made again whenever a peer or a standby dies under it; the role table records each move."""

    def __init__(
        self,
        client: Client,
        prepared: Prepared,
        roles: RoleTable,
        workers: Workers,
        calls: Calls,
        actors: Actors,
        standbys: StandbyChoice,
        record: RecordCopy,
        fallback: CheckpointFallback,
        loops: ComputeLoops,
    ) -> None:
        self.client = client
        self.prepared = prepared
        self.job = prepared.job
        self.roles = roles
        self.workers = workers
        self.calls = calls
        self.actors = actors
        self.standbys = standbys
        self.record = record
        self.fallback = fallback
        self.loops = loops

    def promote(self, lost: list[int]) -> None:
        """Suspend training, then for each lost data server: start one on a standby static worker, from
        its peer's in-memory replica of the last snapshot every shard holds, and let the coordinator bring
        every shard to that snapshot in a new generation (`Coordinator.promote`). Where that would lose a
        shard, the lost data servers are asked first, once (`Calls.answering`): one that answers keeps its
        role. A peer that dies meanwhile takes its replica with it: the plan is made again, with it lost."""
        again: Again | None = Again(tuple(sorted(set(lost))), True)
        while again is not None and again.lost:
            again = self.promote_round(list(again.lost), again.ask)
        self.record.update()

    def promote_round(self, lost: list[int], ask: bool) -> Again | None:
        """One round of `promote`: what is left to promote after it (`recovery.Again`: a peer died under it,
        or some answered and keep their roles), or None."""
        job, roles, prepared = self.job, self.roles, self.prepared
        coordinator, shards = roles.coordinator, roles.shards
        seen, clock = time.time(), time.monotonic()
        left = ", ".join(sorted({roles.placement[i] for i in lost}))
        told = coordinator.shards_lost(lost, f"static worker {left} left", [shards[i].key for i in lost])
        targets = dict.fromkeys(lost, self.calls.call(told))
        if prepared.mode.shards_apart:
            # Each shard snapshots at its own version (async mode): each standby starts from its own.
            targets = {i: self.calls.call(coordinator.snapshot_version(i)) for i in lost}
        suspended = time.monotonic() - clock
        try:
            held = {i: self.replica_held(i, lost, targets[i]) for i in lost}
        except StaticWorkerLeft as gone:
            # A peer died too, after the first loss was seen: its replica is gone with it.
            return peer_gone_while_asked(lost, roles.on(gone.worker), ask)
        plan = plan_recovery(
            lost, len(shards), targets, {i: prepared.persistence.shard_start(i, []).version for i in lost},
            held, job.peer_replicas, ask,
        )  # fmt: skip
        # Only silent for a moment (`Calls.answering`): each keeps its role, and the rest are promoted.
        kept = [
            i for i in sorted(self.calls.answering(plan.ask_first) if plan.ask_first else ()) if self.keep(i)
        ]
        if kept:
            return kept_answered(lost, kept)
        if plan.back_to_checkpoint:
            self.fallback.restore(
                list(plan.lost), f"data servers {list(plan.unrestorable)} cannot be restored: {plan.why}"
            )
            return None
        asked = bool(plan.ask_first)
        for i in plan.lost:
            replica = shards[(i + 1) % len(shards)] if i in plan.from_replica else None
            start = None if replica is not None else prepared.persistence.shard_start(i, roles.plan[i])
            while True:
                try:
                    standby, future, shard, channel, started, adopted = self.start_on_standby(
                        i, start, targets[i], replica
                    )
                except StaticWorkerLeft:
                    # The peer died too (after the first loss was seen): its replica is gone with it.
                    return peer_gone_during_start(lost, i, len(shards), asked)
                clock = time.monotonic()
                try:
                    event = self.promote_on(i, standby, future, shard, channel)
                    break
                except StaticWorkerLeft:
                    continue  # the standby died in the middle of its promotion: the next one
            promotion = Promotion(
                index=i, lost_worker=roles.placement[i], standby=standby, step=event.step, seen=seen,
                suspend=suspended, start=started, adopt=adopted, promote=time.monotonic() - clock,
                source="start" if replica is None else "replica",
            )  # fmt: skip
            old, moved = roles.promoted(promotion, future, shard, channel)
            # The old data server's actor is released: it is gone with its worker, or (a hand-over) its
            # worker is retiring and must not hold it.
            with contextlib.suppress(Exception):
                self.client.cancel([old])
            if moved is not None:
                self.leave_links([moved])
            log.warning(
                "job %s: data server %d now on standby %s at step %d, %.2f s after it was lost (suspend "
                "%.3f s, start %.3f s, copy from the peer %.3f s, promote %.3f s)",
                job.job_id, i, standby, event.step, time.time() - seen, suspended, started, adopted,
                promotion.promote,
            )  # fmt: skip
            suspended = 0.0
        return None

    def replica_held(self, index: int, lost: list[int], target: int) -> bool:
        """Whether the peer of data server `index` holds the copy of the snapshot of `target` (one promoted
        since holds none); `StaticWorkerLeft` if the peer's worker is gone."""
        peer = replica_peer(index, lost, len(self.roles.shards), self.job.peer_replicas)
        if peer is None:
            return False
        try:
            asked = self.roles.shards[peer].status(self.prepared.schedule.total_steps)
        except RuntimeError as exc:  # Dask already knows the peer's worker is gone
            raise StaticWorkerLeft(self.roles.placement[peer]) from exc
        status = self.calls.wait_unless_left(asked, self.roles.placement[peer], self.job.call_timeout)
        return target in status.replicas

    def leave_links(self, channels: list[ChannelAddress]) -> None:
        """Tell the compute loops to drop their connections to `channels`, where shards whose roles moved
        listened (`compute.leave_links`): one blocked on a frozen static worker would wait a call timeout.
        Not waited for: a member that does not answer has its own loop to wake, or none."""
        members = self.loops.members_with_loops(self.workers.members)
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
        roles = self.roles
        where = roles.placement[index]
        try:
            event = self.calls.call(
                roles.coordinator.promote(index, roles.shards[index], roles.channels[index], where)
            )
        except CoordinatorLost:
            raise
        except Exception as exc:
            log.warning("job %s: data server %d could not keep its role (%s)", self.job.job_id, index, exc)
            return False
        roles.keep(index)
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
        self.roles.promoting_on(index, standby, key)
        try:
            return self.calls.call(self.roles.coordinator.promote(index, shard, channel, standby))
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.client.cancel([future])
            if isinstance(exc, CoordinatorLost) or not self.workers.leaves_soon(
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
            self.calls.call(self.roles.coordinator.shards_lost([index], reason, [key]))
            raise StaticWorkerLeft(standby) from exc
        finally:
            self.roles.promotion_ended()

    def start_on_standby(
        self, index: int, start: ShardStart | None, version: int, replica: ShardHandle | None
    ) -> tuple[str, Future, ShardHandle, ChannelAddress, float, float]:
        """A data server for shard `index` on a standby: started from `start`, or empty and then given the
        snapshot of `version` from `replica` (the peer). A standby that dies meanwhile is passed over for
        the next one (a call to it would wait for the startup timeout); the peer's death raises
        `StaticWorkerLeft` for the peer. Returns the standby, the actor's future, its handle, where its
        channel listens, and the seconds its start and the copy from the peer took."""
        peer_at = self.roles.placement[(index + 1) % len(self.roles.placement)]
        cancelled = 0
        while True:
            waited = time.monotonic()
            standby = self.standbys.wait_for_standby(index)
            clock = time.monotonic()
            waited = clock - waited
            future: Future | None = None
            watched = standby  # the worker whose loss would explain a broken call
            self.roles.starting_on_standby(standby)
            passed_over = functools.partial(self.standbys.standby_gone, standby)
            try:
                warm = self.roles.warmth(standby)
                self.actors.await_engine(standby, self.actors.startup_timeout(), gone=passed_over)
                engine = time.monotonic() - clock
                future = self.actors.submit_data_server(index, standby, start, version)
                shard: ShardHandle = self.calls.wait_unless_left(
                    future,
                    standby,
                    self.actors.startup_timeout(),
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
                    self.calls.wait_unless_left(
                        shard.adopt(replica, version), peer_at, self.actors.startup_timeout()
                    )
                    watched = standby
                adopted = time.monotonic() - clock - started
                channel = self.calls.wait_unless_left(
                    shard.open_channel(),
                    standby,
                    self.job.call_timeout,
                    gone=passed_over,
                )
                return standby, future, shard, channel, started, adopted
            except Exception as exc:
                self.roles.start_ended()
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
                    watched == standby or not self.workers.leaves_soon(standby, LEAVING_GRACE_SECONDS)
                ):
                    raise
                log.warning(
                    "job %s: standby %s left while data server %d started on it (%s); taking the next",
                    self.job.job_id, standby, index, exc,
                )  # fmt: skip
