"""The coordinator actor's part in the static roles: a data server lost with its static worker, the
standby that takes its role, and a static worker that retires and hands its roles over. Called by the
controller (`shards_lost`, `snapshot_version`, `promote`, `hand_over`), and by the actor itself when a call
to a shard fails.

What goes back, and how far, is the state's (`CoordinatorState.lose_shard`, `promote_shard`, and the
`PromotionPlan` its commit bookkeeping gives); this class makes the calls to the shards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import replace
from functools import partial
from typing import Any

from ..errors import FatalError
from ..messages import MembershipEvent, ShardStatus, direct
from ..wire import ChannelAddress
from .commit_book import SnapshotWhereFenced
from .shard_calls import ShardCalls, ShardUnreachable, actor_key
from .survival import Action, survival_check

log = logging.getLogger(__name__)

# How long a hand-over waits for the step in flight to be applied on every shard before it fences anyway.
HOLD_WAIT_SECONDS = 5.0


def _hold_at(shard: Any, generation: int, version: int, wait: float) -> Awaitable[int]:
    held: Awaitable[int] = shard.hold_at(generation, version, wait)
    return held


class RoleMoves(ShardCalls):
    async def shards_lost(self, indices: list[int], reason: str, keys: list[str] | None = None) -> int:
        """The data servers `indices` are gone with their static workers (the controller saw them leave,
        or a call to one failed): fence every other shard into a new generation, so compute loops stop,
        and hand out no role until a standby took each one's place. Returns the version a replacement
        must take (the last snapshot every shard holds, whose copy is on a lost shard's peer).

        `keys`: the actor keys of the data servers seen lost, one per index. A report about one that a
        standby has replaced since is ignored: the controller tells of a loss without waiting for the
        answer, so the report can arrive after the promotion it caused."""
        began = time.time()
        if keys is not None:
            indices = [i for i, key in zip(indices, keys, strict=True) if actor_key(self._shards[i]) == key]
        lock, _ = self._primitives()
        state = self._state
        # Calls to them in flight (holding the lock) give up now instead of at their timeout; all of them
        # at once, so that fencing the others does not wait on one lost with the first.
        for index in indices:
            self._gone.setdefault(index, asyncio.Event()).set()
        async with lock:
            new = [i for i in indices if i not in state.lost]
            if not state.finished and new:
                generation = state.generation + 1
                state.lost.update(new)  # no call to them from now on
                try:
                    await self._fence_shards(generation)
                except ShardUnreachable as other:
                    # Another one lost at the same time: it is suspended with these.
                    self._take(state.lose_shard(other.index, generation, str(other), time.time()))
                state.lost.difference_update(new)
                for index in new:
                    self._take(state.lose_shard(index, generation, reason, time.time()))
                log.warning(
                    "job %s: data servers %s lost (%s), %.3f s", self.job_id, new, reason, time.time() - began
                )
        await self._notify()
        return state.ledger.snapshot_step

    async def snapshot_version(self, index: int) -> int:
        """The version a standby taking shard `index` starts from: of the last snapshot every shard holds
        (in async mode, the shard's own version in it)."""
        return self._state.snapshot_version_of(index)

    async def hand_over(self, indices: list[int], reason: str) -> int:
        """A static worker is retiring: stop training where every shard can be snapshotted (with sync
        commits, at a step every shard applied: every shard fenced into a new generation and brought to one
        version; only the open step is dropped), snapshot on every shard (its copies whole on the peers),
        and count the data servers `indices` lost, so that standbys take them from that snapshot with no
        committed step redone. Nothing is handed out until the controller's next survival check. Returns
        the snapshot's step."""
        began = time.time()
        lock, _ = self._primitives()
        state = self._state
        try:
            async with lock:
                if not state.finished:
                    await self._hand_over(indices, reason, began)
        except ShardUnreachable as lost:
            # A worker died in the middle (the retiring one itself, killed before it was done): a loss like
            # any other, so its data servers go to standbys from the last snapshot every shard confirmed.
            await self.shards_lost([lost.index], f"{reason}, and was lost during the hand-over: {lost}")
        await self._notify()
        return state.ledger.snapshot_step

    async def _hand_over(self, indices: list[int], reason: str, began: float) -> None:
        state = self._state
        if isinstance(state.snapshot_when_stopped(), SnapshotWhereFenced):
            # Every shard fenced and snapshotted where it stands (its copy on the peer): the standby takes
            # exactly what the retiring shard had applied, so nothing is redone.
            await self._pause_for_snapshot(began)
        else:
            if not state.suspended and state.members:  # (standing shards take no step to wait for)
                await self._hold_at_one_version()
            decision = replace(
                survival_check(state.survival_state(), frozenset(state.members), began),
                action=Action.REASSIGN,
                generation=state.generation + 1,
                reason=reason,
            )
            await self._change_membership(decision, "hand-over", began)
            state.suspended = True
            await self._snapshot_committed(began)
        for index in indices:
            self._take(state.lose_shard(index, state.generation, reason, time.time()))

    async def _hold_at_one_version(self, tries: int = 3, wait: float = HOLD_WAIT_SECONDS) -> None:
        """Let the step in flight finish, then stop every shard at the same step boundary (`hold_at`), so
        that the fence after finds them at one version: a fence in the middle of a step finds one shard a
        step ahead of another, and the shards go back to the last snapshot. A held shard applies no step
        beyond its hold, so the newest version a hold finds is one every shard can still reach: the next
        try holds them all there. A step that does not finish within the wait (a member that died between
        its pushes) leaves it to the fence."""
        state = self._state
        statuses: list[ShardStatus] = await self._on_shards(lambda s: s.status(state.schedule.total_steps))
        target = min(max(s.version for s in statuses) + 1, state.schedule.total_steps)
        for _ in range(tries):
            hold = partial(_hold_at, generation=state.generation, version=target, wait=wait)
            reached: list[int] = await self._on_shards(hold)
            if len(set(reached)) == 1:
                return
            target = max(reached)

    async def promote(self, index: int, shard: Any, channel: ChannelAddress, worker: str) -> MembershipEvent:
        """`shard` (a data server started on the standby `worker`, holding the replica of the last
        snapshot) takes the role of lost shard `index`: every shard is fenced into a new generation (and,
        as the commit bookkeeping says, brought to that snapshot), peers are named again, and roles go out
        with the new channel. Given the lost data server's own handle (it was only silent, and answered:
        `Promotions.keep` in training/promotion.py), the same happens with it in place: event `kept`."""
        began = time.time()
        lock, _ = self._primitives()
        state = self._state
        async with lock:
            if index not in state.lost:
                raise FatalError(f"data server {index} is not lost; nothing to promote")
            # The same data server, taken for lost while silent, that answered after all: it keeps its role.
            kept = actor_key(shard) is not None and actor_key(shard) == actor_key(self._shards[index])
            self._shards[index] = direct(shard)
            self._gone[index] = asyncio.Event()
            generation = state.generation + 1
            promotion = state.promotion()
            state.lost.discard(index)
            try:
                fenced = await self._fence_and_restore(generation, promotion.restore_to, index)
            finally:
                state.lost.add(index)
            where = ChannelAddress(*channel)
            applied: frozenset[int] = frozenset()
            if promotion.asks_applied:
                applied = frozenset(await shard.applied_ids())
            version = next(f.version for f in fenced if f.index == index)
            event = state.promote_shard(
                index, worker, generation, where, time.time(), began, applied=applied, version=version,
                kept=kept,
            )  # fmt: skip
            self._take([event])
            # The promoted shard copies its snapshot to its peer, and the shard whose peer it is now copies
            # its own to it (the copies the lost worker held are gone).
            count = len(self._shards)
            await self._wire_peers({index, (index - 1) % count})
        await self._notify()
        return event

    async def _fence_and_restore(self, generation: int, target: int | None, keep: int) -> list[ShardStatus]:
        """Fence every shard not lost into `generation` and bring it to version `target` (None: leave it
        where it stands). Another shard found lost meanwhile (not `keep`) is recorded lost and left out:
        its own promotion comes next. Returns where the shards stood when fenced."""
        state = self._state
        while True:
            try:
                fenced = await self._fence_shards(generation)
                if target is not None and any(f.version != target for f in fenced):
                    await self._on_shards(lambda s: s.restore(generation, target))
                return fenced
            except ShardUnreachable as other:
                if other.index == keep or other.index in state.lost:
                    raise
                self._gone.setdefault(other.index, asyncio.Event()).set()
                self._take(state.lose_shard(other.index, generation, str(other), time.time()))
