"""The coordinator (the task information server): an async Dask actor on a static worker.

Off the step path: compute workers ask it for their `Role` once per generation (`role`), not for work per
step, and shards apply steps without it. It learns what the shards applied by reading their status every
`SYNC_SECONDS` or `STEADY_SYNC_SECONDS` (the ledger, the history, progress), and it carries out survival
detection (`survival_check`): the decision is the pure `survival.survival_check`, the bookkeeping the pure
`state.CoordinatorState` with the job's commit bookkeeping (a `CommitBook`); this actor only makes the
calls they ask for (fence, restore, snapshot on every shard: `shard_calls.ShardCalls`; a data server lost,
promoted or handed over: `role_moves.RoleMoves`).

Does not own: parameters or data (the data servers), which workers exist (the controller reads the
scheduler and passes the live list in), process lifecycles (the controller).

Called by compute workers (`role`, `lease`, `report_failure`) and by the controller (`survival_check`,
`progress`, `outcome`, `stop`, `snapshot_now`, `snapshot_record`, and `journal`: the controller's copy of
the record, from which `rebuild` makes a new coordinator on another static worker when this one's dies).
Every method is `async def` (see data_server/actor.py on why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from ..messages import (
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
from ..wire import ChannelAddress
from .commit_book import SnapshotAt, SnapshotWhereFenced
from .pacing import STEADY_SYNC_SECONDS, SYNC_SECONDS
from .role_moves import RoleMoves
from .shard_calls import ShardUnreachable, fence
from .spec import CoordinatorSpec
from .state import CoordinatorState
from .survival import Action, Decision, spare_what_lost_nothing, survival_check

log = logging.getLogger(__name__)

# How long a change made only of joins waits for the step in flight to end on every shard before it
# fences them (`finishes_the_step_in_flight`); a step takes milliseconds to a second, and past this the
# fence goes on as it would have.
JOIN_HOLD_SECONDS = 1.0


def finishes_the_step_in_flight(decision: Decision) -> bool:
    """Whether the membership change `decision` lets the step in flight end before the fence: a reassign
    made only of joins, where no member that holds a share of that step is gone (under either policy:
    `survival.spare_what_lost_nothing` makes a rollback of joins alone a reassign). (A rollback goes back
    to the snapshot whatever the shards hold; a loss may have left a push missing forever.) Pure."""
    return decision.action is Action.REASSIGN and bool(decision.joined) and not decision.left


# How long a worker's request for its role waits on the coordinator before it is answered "nothing yet";
# short enough that loops notice a stop quickly, long enough to cost nothing while idle.
ROLE_POLL_SECONDS = 0.5


class Coordinator(RoleMoves):
    def __init__(
        self,
        spec: CoordinatorSpec,
        resume: Resume | None,
        call_timeout: float,
        steady_sync: float = STEADY_SYNC_SECONDS,
    ) -> None:
        state = CoordinatorState(spec, resume)
        super().__init__(spec.job_id, state, call_timeout)
        # How often a sync job's steady state reads the shards (`CoordinatorState.sync_interval`): the
        # controller asks for `SYNC_SECONDS` where its caller acts on steps as they commit (faults, a
        # progress callback, which it polls every 20 ms).
        self._steady_sync = steady_sync
        self._last_check_steps = state.committed_steps
        self._sync_task: asyncio.Task[None] | None = None

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
                    applied_from = state.rebuild_applied_from(journal)
                    fenced: list[ShardStatus] = await self._on_shards(
                        partial(fence, generation=generation, applied_from=applied_from)
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
        other kind stops the job ("data": a batch that could not be made, which no worker would make). A
        report of an older generation is dropped: its step was dropped with it, and the batch trains
        again."""
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
        change made only of them and of joins is not rolled back (`survival.spare_what_lost_nothing`).
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
        decision = spare_what_lost_nothing(
            survival_check(state.survival_state(), live, time.time()), graceful
        )
        if renew and decision.action in (Action.SNAPSHOT, Action.NOTHING) and decision.resume:
            # Same members, but a member's compute loop starts over: a loop that died may have pushed to
            # one shard and not to another, so it gets a clean start in a new generation.
            decision = replace(
                decision,
                action=state.policy.on_change,
                generation=state.generation + 1,
                reason="a compute loop started over",
            )
        progressed = state.committed_steps > self._last_check_steps
        self._last_check_steps = state.committed_steps
        if decision.action is Action.SNAPSHOT:
            plan = state.snapshot_plan(progressed)
            if isinstance(plan, SnapshotWhereFenced):
                await self._pause_for_snapshot(began)
                decision = replace(decision, generation=state.generation)  # (the pause's)
            elif isinstance(plan, SnapshotAt):
                version, keep = plan.version, plan.keep
                answers = await self._on_shards(lambda s: s.snapshot_at(state.generation, version, keep))
                for status in answers:
                    self._take(state.absorb(status))
        elif decision.action in (Action.START, Action.ROLLBACK, Action.REASSIGN):
            # Only joins: every member is alive, so the step in flight completes on every shard. Held at
            # that step's end, the fence finds the shards at one version: nothing is undone and the step is
            # not trained again. (Fenced in the middle of it, one shard could stand a step ahead of another,
            # and every shard went back to the last snapshot: 6 to 10 steps undone by a join in the chaos
            # soak.) Not in async mode, whose shards stand apart anyway.
            if (
                finishes_the_step_in_flight(decision)
                and not state.suspended
                and state.members
                and not isinstance(state.snapshot_when_stopped(), SnapshotWhereFenced)
            ):
                await self._hold_at_one_version(tries=2, wait=JOIN_HOLD_SECONDS)
            await self._change_membership(decision, trigger, began)
        self._take(state.after_decision(decision, time.time(), began))

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
        version where the bookkeeping has one, snapshot, and stop handing out roles. Returns the
        snapshot's step."""
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
                plan = await self._to_one_version(decision, fenced)
                if plan.restore_to is not None or plan.step_back_to is not None:
                    state.change_membership(decision, plan, fenced, "stop", time.time(), began)
                else:
                    state.generation = decision.generation
                if isinstance(state.snapshot_when_stopped(), SnapshotWhereFenced):
                    await self._snapshot_where_fenced(fenced, began)
                else:
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

    async def snapshot_record(self) -> Resume:
        """The coordinator's part of the last snapshot, for a persistent checkpoint."""
        return self._state.snapshot_record()
