"""The coordinator (seed 000's task information server): an async Dask actor on a static worker.

Off the step path: compute workers ask it for their `Role` once per generation (`role`), not for work per
step, and shards apply steps without it. It learns what the shards applied by reading their status every
`SYNC_SECONDS` or `STEADY_SYNC_SECONDS` (the ledger, the history, progress), and it carries out survival
detection (`survival_check`): the decision is the pure `survival.survival_check`, the bookkeeping the pure
`coordinator_state.CoordinatorState`; this actor only makes the calls they ask for (fence, restore,
snapshot on every shard).

Does not own: parameters or data (the data servers), which workers exist (the controller reads the
scheduler and passes the live list in), process lifecycles (the controller).

Called by compute workers (`role`, `report_failure`) and by the controller (`survival_check`, `progress`,
`outcome`, `stop`, `snapshot_now`, `snapshot_record`, and `journal`: the controller's copy of the record,
from which `rebuild` makes a new coordinator on another static worker when this one's dies). Every method
is `async def` (see data_server.py on why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from .channel import ChannelAddress
from .coordinator_state import CoordinatorState, Failure, rebuild_applied_from
from .errors import FatalError, RecoverableError
from .messages import (
    EventKind,
    Journal,
    MembershipEvent,
    Outcome,
    Progress,
    Resume,
    Role,
    ShardStatus,
    direct,
)
from .schedule import Schedule
from .survival import Action, Decision, Policy, spare_graceful_leaves, survival_check

log = logging.getLogger(__name__)

# How long a worker's request for its role waits on the coordinator before it is answered "nothing yet";
# short enough that loops notice a stop quickly, long enough to cost nothing while idle.
ROLE_POLL_SECONDS = 0.5
# How long a hand-over waits for the step in flight to be applied on every shard before it fences anyway.
HOLD_WAIT_SECONDS = 5.0
# How often the coordinator reads the shards' status (committed steps, snapshots) while the job runs
# (`CoordinatorState.sync_interval` chooses): often where something waits on the read (async mode's
# re-queued batch ids, a job's end, a caller that acts on steps as they commit), less often in a sync
# job's steady state. Each read is a Dask call to every shard, on processes that share the machine with
# the compute workers: 20 reads a second slowed a 20 ms CNN step by 4 to 6% on this 2-core machine
# (docs/benchmarks.md, issue 9).
SYNC_SECONDS = 0.05
STEADY_SYNC_SECONDS = 0.25


def _fence(
    shard: Any, generation: int, since: int = 0, applied_from: int | None = None
) -> Awaitable[ShardStatus]:
    fenced: Awaitable[ShardStatus] = shard.fence(generation, since, applied_from)
    return fenced


def _hold_at(shard: Any, generation: int, version: int, wait: float) -> Awaitable[int]:
    held: Awaitable[int] = shard.hold_at(generation, version, wait)
    return held


class ShardUnreachable(Exception):
    """A call to data server `index` failed (its worker is gone, or it did not answer in time)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self) -> tuple[type[ShardUnreachable], tuple[int, str]]:
        # Raised out of an actor call, it is pickled to the caller: by default with its message alone.
        return (type(self), (self.index, str(self)))


class Coordinator:
    def __init__(
        self,
        job_id: str,
        schedule: Schedule,
        shards: int,
        policy: Policy,
        min_workers: int,
        min_workers_timeout: float,
        call_timeout: float,
        resume: Resume | None = None,
        mode: str = "sync",
        snapshot_every: int = 0,
        steady_sync: float = STEADY_SYNC_SECONDS,
    ) -> None:
        self.job_id = job_id
        # How often a sync job's steady state reads the shards (`CoordinatorState.sync_interval`): the
        # controller asks for `SYNC_SECONDS` where its caller acts on steps as they commit (faults, a
        # progress callback, which it polls every 20 ms).
        self._steady_sync = steady_sync
        self._state = CoordinatorState(
            job_id, schedule, shards, policy, min_workers, min_workers_timeout, resume, mode, snapshot_every
        )
        self._call_timeout = call_timeout
        self._shards: list[Any] = []  # Dask actor handles of the data servers (awaitable calls here)
        self._unreported: list[MembershipEvent] = []  # events the controller has not been given yet
        self._last_check_steps = self._state.committed_steps
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Condition | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._gone: dict[int, asyncio.Event] = {}  # set when a shard is known lost: calls to it give up

    # asyncio primitives are made on first use, inside the worker's event loop (__init__ runs in a thread).
    def _primitives(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None or self._changed is None:
            self._lock = asyncio.Lock()
            self._changed = asyncio.Condition()
        return self._lock, self._changed

    async def attach(self, shards: list[Any], channels: list[ChannelAddress]) -> None:
        """Take the data servers' handles and where each listens for compute loops; name each shard's
        peer (the next shard), which keeps in memory a copy of every snapshot it takes."""
        self._shards = [direct(shard) for shard in shards]
        self._state.channels = tuple(ChannelAddress(*c) for c in channels)
        await self._wire_peers(range(len(self._shards)))
        self._sync_task = asyncio.ensure_future(self._follow_shards())

    async def rebuild(
        self,
        journal: Journal,
        shards: list[Any],
        channels: list[ChannelAddress],
        lost: list[int],
        where: str,
        reason: str,
        began: float,
        kind: EventKind = EventKind.COORDINATOR_REBUILT,
    ) -> MembershipEvent:
        """Take over from a coordinator whose static worker died (this one holds nothing yet): fence the
        live shards into a generation above any they have seen, so nothing the old one or the compute
        loops of its generations send is taken, and rebuild the record from the controller's copy
        (`journal`) and what the shards hold (`CoordinatorState.rebuild`). Data servers in `lost` died
        with it: they wait for a standby (`promote`), as any lost data server. Then follow the shards, as
        after `attach`; their peers are unchanged.

        With `kind` RESTORED (on this coordinator or a new one) the shards are new, all started from a
        persistent checkpoint: each is given its peer, as after `attach`."""
        lock, _ = self._primitives()
        state = self._state
        async with lock:
            self._shards = [direct(shard) for shard in shards]
            state.channels = tuple(ChannelAddress(*c) for c in channels)
            state.lost = set(lost)
            self._gone = {i: asyncio.Event() for i in range(len(shards))}
            for i in lost:
                self._gone[i].set()
            while True:
                try:
                    seen: list[ShardStatus] = await self._on_shards(
                        lambda s: s.status(state.schedule.total_steps)
                    )
                    # Above any generation handed out: the old coordinator fenced every live shard into
                    # each one before its roles went out, and (restoring here) this one knows its own.
                    generation = (
                        max([journal.generation, state.generation, *(s.generation for s in seen)]) + 1
                    )
                    # Async mode: with the ids each applied, recorded or not (a shard promoted since the
                    # copy has no record of what its snapshot holds), from those the copy has not
                    # committed or committed after its snapshot (a promotion may have retracted those).
                    applied_from = rebuild_applied_from(journal) if state.mode == "async" else None
                    fenced: list[ShardStatus] = await self._on_shards(
                        partial(_fence, generation=generation, applied_from=applied_from)
                    )
                    break
                except ShardUnreachable as other:
                    # Another data server died meanwhile: it waits for a standby with the others.
                    state.lost.add(other.index)
                    self._gone[other.index].set()
            lost = sorted(state.lost)
            event = state.rebuild(journal, fenced, lost, generation, where, reason, time.time(), began, kind)
            self._take([event])
            self._last_check_steps = state.committed_steps
            if kind is EventKind.RESTORED:
                await self._wire_peers(range(len(self._shards)))
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.ensure_future(self._follow_shards())
        await self._notify()
        return event

    async def journal(self, known_steps: int, known_events: int) -> Journal:
        """What the controller's copy of the record lacks (`CoordinatorState.journal`)."""
        return self._state.journal(known_steps, known_events)

    async def _wire_peers(self, indices: Iterable[int]) -> None:
        count = len(self._shards)
        if count < 2:
            return  # one shard has no peer: only a persistent checkpoint outlives its worker
        generation, lost = self._state.generation, self._state.lost
        # A shard whose peer is lost is named its new peer when that one's role is taken.
        wired = [i for i in indices if i not in lost and (i + 1) % count not in lost]
        await asyncio.gather(
            *(self._shards[i].set_peer(generation, self._shards[(i + 1) % count]) for i in wired)
        )

    async def _notify(self) -> None:
        _, changed = self._primitives()
        async with changed:
            changed.notify_all()

    def _take(self, events: list[MembershipEvent]) -> None:
        for event in events:
            self._unreported.append(event)
            log.info(
                "job %s %s: generation %d, step %d, workers %s, %.3f s: %s",
                self.job_id,
                event.kind.value,
                event.generation,
                event.step,
                list(event.workers),
                event.seconds,
                event.reason,
            )

    # -- following the shards --------------------------------------------------------------------

    async def _follow_shards(self) -> None:
        while not self._state.finished:
            try:
                await self._sync()
            except ShardUnreachable as exc:
                await self.shards_lost([exc.index], str(exc))
            except Exception as exc:
                self._fail("internal", f"reading the shards failed: {type(exc).__name__}: {exc}", None)
            await asyncio.sleep(self._state.sync_interval(SYNC_SECONDS, self._steady_sync))
        await self._notify()

    async def _sync(self) -> None:
        lock, _ = self._primitives()
        async with lock:
            if self._state.finished or self._state.lost:
                return
            since, keep_from = self._state.since(), self._state.records_kept_from()
            generation = self._state.generation
            statuses = await self._on_shards(lambda s: s.status(since, keep_from, generation))
            finished_before = self._state.finished
            for status in statuses:
                self._take(self._state.absorb(status))
        if self._state.finished and not finished_before:
            await self._notify()

    # -- compute workers -------------------------------------------------------------------------

    async def role(self, worker: str, generation: int) -> Role | None:
        """`worker`'s role in the current generation when it does not have it yet (it knows
        `generation`), a stop when the job is over, `None` after a short wait when there is nothing new
        (training suspended, the worker not a member, or no new generation)."""
        _, changed = self._primitives()
        deadline = time.monotonic() + ROLE_POLL_SECONDS
        while True:
            role = self._state.role(worker, generation)
            remaining = deadline - time.monotonic()
            if role is not None or remaining <= 0:
                return role
            async with changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)

    async def lease(self, worker: str, generation: int, count: int, renew: bool = False) -> list[int] | None:
        """Async mode: up to `count` batch ids for `worker` to train (`CoordinatorState.lease`). A loop asks
        for its next lease while it trains the last one, so this call is off its step path."""
        return self._state.lease(worker, generation, count, renew)

    async def report_failure(
        self, generation: int, worker: str, step: int, batch_id: int | None, kind: str, message: str
    ) -> None:
        """A failure that no retry on the same worker fixes. The model raised (or its loss was not finite):
        the worker is excluded and its share goes to the others at once, and the job fails only when the
        batch failed on another worker too, or no member is left (`CoordinatorState.model_failed`). Any
        other kind stops the job. A report of an older generation is dropped: its step was dropped with
        it, and the batch trains again."""
        state = self._state
        if generation != state.generation:
            log.info(
                "job %s: dropped a failure report of generation %d: %s", self.job_id, generation, message
            )
            return
        if kind != "model":
            self._fail(kind, f"{message} (on {worker})", step, batch_id)
            await self._notify()
            return
        events = state.model_failed(worker, step, batch_id, message, time.time())
        self._take(events)
        if any(e.kind is EventKind.EXCLUDED for e in events) and not state.finished:
            log.warning("job %s: compute worker %s excluded: %s", self.job_id, worker, message)
            # Its share goes to the others now, not at the controller's next check.
            await self._survive(frozenset(state.members), "excluded")
        await self._notify()

    # -- survival detection ----------------------------------------------------------------------

    async def survival_check(
        self,
        live_workers: Iterable[str],
        trigger: str = "interval",
        renew: bool = False,
        graceful: Iterable[str] | None = None,
    ) -> list[MembershipEvent]:
        """Decide and carry out survival detection; returns the events recorded since the last call.

        Training stops only when the membership changed (or `renew`: a member's compute loop was
        restarted and must start from a fence): the shards are fenced into a new generation, brought to
        one version, and the new members get their roles. Otherwise a snapshot is asked for, which the
        shards take between two steps without stopping. Workers in `graceful` left gracefully (retired): a
        change made only of them is not rolled back (`survival.spare_graceful_leaves`).
        """
        await self._survive(frozenset(live_workers), trigger, renew, frozenset(graceful or ()))
        events, self._unreported = self._unreported, []
        return events

    async def _survive(
        self, live: frozenset[str], trigger: str, renew: bool = False, graceful: frozenset[str] = frozenset()
    ) -> None:
        began = time.time()
        lock, _ = self._primitives()
        lost: ShardUnreachable | None = None
        try:
            async with lock:
                # While a data server is lost nothing is decided: the promotion of a standby comes first,
                # and the check after it sees whatever changed meanwhile.
                if not self._state.finished and not self._state.lost:
                    await self._check(live, trigger, renew, began, graceful)
        except ShardUnreachable as exc:
            lost = exc
        except Exception as exc:
            self._fail("internal", f"survival detection failed: {type(exc).__name__}: {exc}", None)
        finally:
            await self._notify()
        if lost is not None:
            await self.shards_lost([lost.index], str(lost))

    # -- a data server lost, and a standby promoted (seed 001) -----------------------------------

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
        """A static worker is retiring: stop training at a step every shard applied (every shard fenced
        into a new generation and brought to one version; only the open step is dropped), snapshot that
        version on every shard (its copies whole on the peers), and count the data servers `indices` lost,
        so that standbys take them from that snapshot with no committed step redone. Nothing is handed
        out until the controller's next survival check. Returns the snapshot's step."""
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
        if state.mode == "async":
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

    async def _hold_at_one_version(self, tries: int = 3) -> None:
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
            hold = partial(_hold_at, generation=state.generation, version=target, wait=HOLD_WAIT_SECONDS)
            reached: list[int] = await self._on_shards(hold)
            if len(set(reached)) == 1:
                return
            target = max(reached)

    async def promote(self, index: int, shard: Any, channel: ChannelAddress, worker: str) -> MembershipEvent:
        """`shard` (a data server started on the standby `worker`, holding the replica of the last
        snapshot) takes the role of lost shard `index`: every shard is fenced into a new generation and
        brought to that snapshot, peers are named again, and roles go out with the new channel. Given the
        lost data server's own handle (it was only silent, and answered: `TrainingRun._keep`), the same
        happens with it in place: event `kept`."""
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
            # (Async mode: the other shards stay where they stand; nothing goes back.)
            target = state.ledger.snapshot_step if state.mode == "sync" else None
            state.lost.discard(index)
            try:
                fenced = await self._fence_and_restore(generation, target, index)
            finally:
                state.lost.add(index)
            where = ChannelAddress(*channel)
            applied: frozenset[int] = frozenset()
            if state.mode == "async":
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

    async def _check(
        self,
        live: frozenset[str],
        trigger: str,
        renew: bool,
        began: float,
        graceful: frozenset[str] = frozenset(),
    ) -> None:
        state = self._state
        live = frozenset(w for w in live if w not in state.excluded)  # (their model failed: not members)
        since = state.since()
        statuses = await self._on_shards(lambda s: s.status(since))
        for status in statuses:
            self._take(state.absorb(status))
        if state.finished:
            return
        decision = spare_graceful_leaves(survival_check(state.survival_state(), live, time.time()), graceful)
        if renew and decision.action in (Action.SNAPSHOT, Action.NOTHING) and decision.resume:
            # Same members, but a member's compute loop starts over: a loop that died may have pushed to
            # one shard and not to another, so it gets a clean start in a new generation.
            decision = replace(
                decision,
                action=Action.ROLLBACK if state.policy == "rollback" else Action.REASSIGN,
                generation=state.generation + 1,
                reason="a compute loop started over",
            )
        progressed = state.committed_steps > self._last_check_steps
        self._last_check_steps = state.committed_steps
        if decision.action is Action.SNAPSHOT and state.mode == "async":
            if progressed and state.async_snapshot_due():
                await self._pause_for_snapshot(began)
                decision = replace(decision, generation=state.generation)  # (the pause's)
        elif decision.action is Action.SNAPSHOT:
            version = state.want_snapshot(progressed)
            if version is not None:
                keep = state.ledger.snapshot_step
                answers = await self._on_shards(lambda s: s.snapshot_at(state.generation, version, keep))
                for status in answers:
                    self._take(state.absorb(status))
        elif decision.action in (Action.START, Action.ROLLBACK, Action.REASSIGN):
            await self._change_membership(decision, trigger, began)
        self._take(state.after_decision(decision, time.time(), began))

    async def _change_membership(self, decision: Decision, trigger: str, began: float) -> None:
        state = self._state
        # No role of the new generation goes out before `change_membership`: roles follow the state's
        # generation, which changes there (after the shards are fenced and brought to one version).
        fenced = await self._fence_shards(decision.generation)
        plan = state.reconcile(decision, fenced)
        if plan.restore_to is not None:
            target = plan.restore_to
            await self._on_shards(lambda s: s.restore(decision.generation, target))
        self._take([state.change_membership(decision, plan, fenced, trigger, time.time(), began)])

    def _fail(self, kind: str, message: str, step: int | None, batch_id: int | None = None) -> None:
        events = self._state.fail(Failure(kind, message, step, batch_id), time.time())
        if events:
            log.error(
                "job %s failed (%s) at step %s, batch %s: %s", self.job_id, kind, step, batch_id, message
            )
        self._take(events)

    async def _fence_shards(self, generation: int) -> list[ShardStatus]:
        """Fence every shard not lost into `generation`; their statuses carry the records from the first
        step the state has not taken in (the older ones it ignores)."""
        return await self._on_shards(partial(_fence, generation=generation, since=self._state.since()))

    async def _on_shards(self, call: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """Run `call(shard)` on every shard that is not lost, at once, each bounded by the call timeout;
        a shard that does not answer raises `ShardUnreachable`."""
        targets = [(i, s) for i, s in enumerate(self._shards) if i not in self._state.lost]
        # A call to a worker that died can hang until Dask's connect timeout (it retries a refused
        # connection), and so can a call to a live shard that waits on a dead one (a snapshot whose copy
        # goes to a peer that died): once any of these shards is known lost (`shards_lost`), every call
        # is given up at once.
        gone = {i: self._gone.setdefault(i, asyncio.Event()) for i, _ in targets}
        watch = [asyncio.ensure_future(event.wait()) for event in gone.values()]

        async def one(i: int, shard: Any) -> Any:
            answer = asyncio.ensure_future(call(shard))
            await asyncio.wait({answer, *watch}, timeout=self._call_timeout, return_when="FIRST_COMPLETED")
            if not answer.done():
                answer.cancel()
                lost = [j for j, event in gone.items() if event.is_set()]
                if i in lost or not lost:
                    why = "its worker left" if lost else f"no answer within {self._call_timeout:g} s"
                    raise ShardUnreachable(i, f"data server {i} did not answer ({why})")
                raise ShardUnreachable(lost[0], f"data server {lost[0]} was lost during a call to {i}")
            try:
                return answer.result()
            except (RecoverableError, FatalError):
                raise
            except OSError as exc:
                if type(exc) is not OSError or "Unable to contact Actor's worker" not in str(exc):
                    raise ShardUnreachable(
                        i, f"data server {i} did not answer ({type(exc).__name__}: {exc})"
                    ) from exc
                # Dask gave up connecting to its worker (after its own retries): the worker is dead or cut
                # off, as survival detection will find too.
                raise ShardUnreachable(
                    i, f"data server {i} cannot be reached: its worker is gone ({exc})"
                ) from exc
            except Exception as exc:
                raise ShardUnreachable(
                    i, f"data server {i} did not answer ({type(exc).__name__}: {exc})"
                ) from exc

        try:
            outcomes = await asyncio.gather(*(one(i, s) for i, s in targets), return_exceptions=True)
        finally:
            for waiting in watch:
                waiting.cancel()
        # Wait for every shard before raising, so no call is left running behind a decision.
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)

    # -- controller ------------------------------------------------------------------------------

    async def progress(self) -> Progress:
        return self._state.progress()

    async def outcome(self) -> Outcome:
        state = self._state
        return Outcome(
            ledger=state.ledger.entries(),
            events=list(state.events),
            history=list(state.history),
            commit_times=list(state.commit_times),
            generation=state.generation,
            counters={
                **state.counters,
                "committed_steps": state.committed_steps,
                "dropped_steps": state.ledger.dropped_steps,
                "dropped_batches": state.ledger.dropped_batches,
                "stale_messages": state.refused,
            },
        )

    async def stop(self, reason: str) -> int:
        """Stop the job: fence every shard (compute loops stop at their next call), bring them to one
        version, snapshot it, and stop handing out roles. Returns the snapshot's step."""
        began = time.time()
        lock, _ = self._primitives()
        async with lock:
            state = self._state
            if not state.finished:
                decision = replace(
                    survival_check(state.survival_state(), frozenset(state.members), began),
                    action=Action.REASSIGN,
                    generation=state.generation + 1,
                    reason="stopped by the controller",
                )
                fenced = await self._fence_shards(decision.generation)
                plan = state.reconcile(decision, fenced)
                if state.mode == "async":
                    state.generation = decision.generation
                    await self._snapshot_async(fenced, began)
                elif plan.restore_to is not None:
                    target = plan.restore_to
                    await self._on_shards(lambda s: s.restore(decision.generation, target))
                    state.change_membership(decision, plan, fenced, "stop", time.time(), began)
                else:
                    state.generation = decision.generation
                if state.mode != "async":
                    await self._snapshot_committed(began)
            self._fail("stopped", reason, state.committed_steps)
        await self._notify()
        return state.ledger.snapshot_step

    async def snapshot_now(self) -> int:
        """Snapshot the committed state at once (at the end); returns its step."""
        began = time.time()
        lock, _ = self._primitives()
        async with lock:
            await self._snapshot_committed(began)
        return self._state.ledger.snapshot_step

    async def _snapshot_committed(self, began: float) -> None:
        state = self._state
        since = state.since()
        statuses = await self._on_shards(lambda s: s.status(since))
        for status in statuses:
            self._take(state.absorb(status))
        if len({s.version for s in statuses}) != 1 or state.committed_steps <= state.ledger.snapshot_step:
            return  # nothing new, or the shards are mid-step: the last snapshot stays the latest
        version = state.committed_steps
        state.snapshot_wanted = version
        keep = state.ledger.snapshot_step
        answers = await self._on_shards(lambda s: s.snapshot_at(state.generation, version, keep))
        for status in answers:
            self._take(state.absorb(status))
        if state.ledger.snapshot_step != version:
            raise FatalError(f"shards did not snapshot step {version}")
        if state.events and state.events[-1].kind is EventKind.SNAPSHOT:
            # Asked by the controller: say so, and time it from the request.
            last = state.events[-1]
            state.events[-1] = replace(
                last, reason="requested by the controller", seconds=time.time() - began
            )

    async def _pause_for_snapshot(self, began: float) -> None:
        """Async mode: fence every shard into a new generation (nothing is applied meanwhile), snapshot
        each at its own version, and go on at once: the members get their roles of the new generation."""
        state = self._state
        generation = state.generation + 1
        fenced = await self._fence_shards(generation)
        state.pause(generation)
        await self._snapshot_async(fenced, began)

    async def _snapshot_async(self, fenced: list[ShardStatus], began: float) -> None:
        """Async mode, every shard fenced (`fenced`: where each stands): each snapshots its own version."""
        state = self._state
        for status in fenced:
            self._take(state.absorb(status))
        versions = {i: s.version for i, s in enumerate(sorted(fenced, key=lambda s: s.index))}
        by_handle = {id(shard): versions[i] for i, shard in enumerate(self._shards)}
        generation = state.generation
        await self._on_shards(lambda s: s.snapshot_at(generation, by_handle[id(s)], by_handle[id(s)]))
        ordered = tuple(versions[i] for i in range(len(versions)))
        self._take([state.snapshot_async(ordered, time.time(), time.time() - began)])

    async def snapshot_record(self) -> Resume:
        """The coordinator's part of the last snapshot, for a persistent checkpoint."""
        return self._state.snapshot_record()


def actor_key(shard: Any) -> str | None:
    """The actor key of a data server's handle (a Dask `Actor`); None for one that has none."""
    return getattr(shard, "key", None)
