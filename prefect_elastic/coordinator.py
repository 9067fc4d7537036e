"""The coordinator (seed 000's task information server): an async Dask actor on a static worker.

Off the step path: compute workers ask it for their `Role` once per generation (`role`), not for work per
step, and shards apply steps without it. It learns what the shards applied by reading their status every
`SYNC_SECONDS` (the ledger, the history, progress), and it carries out survival detection
(`survival_check`): the decision is the pure `survival.survival_check`, the bookkeeping the pure
`coordinator_state.CoordinatorState`; this actor only makes the calls they ask for (fence, restore,
snapshot on every shard).

Does not own: parameters or data (the data servers), which workers exist (the controller reads the
scheduler and passes the live list in), process lifecycles (the controller).

Called by compute workers (`role`, `report_failure`) and by the controller (`survival_check`, `progress`,
`outcome`, `stop`, `snapshot_now`, `snapshot_record`). Every method is `async def` (see data_server.py on
why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from .coordinator_state import CoordinatorState, Failure
from .errors import DataServerLostError, FatalError, RecoverableError
from .messages import EventKind, MembershipEvent, Outcome, Progress, Resume, Role, ShardStatus
from .schedule import Schedule
from .survival import Action, Decision, Policy, survival_check

log = logging.getLogger(__name__)

# How long a worker's request for its role waits on the coordinator before it is answered "nothing yet";
# short enough that loops notice a stop quickly, long enough to cost nothing while idle.
ROLE_POLL_SECONDS = 0.5
# How often the coordinator reads the shards' status (committed steps, snapshots) while the job runs.
SYNC_SECONDS = 0.05


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
    ) -> None:
        self.job_id = job_id
        self._state = CoordinatorState(
            job_id, schedule, shards, policy, min_workers, min_workers_timeout, resume
        )
        self._call_timeout = call_timeout
        self._shards: list[Any] = []  # Dask actor handles of the data servers (awaitable calls here)
        self._unreported: list[MembershipEvent] = []  # events the controller has not been given yet
        self._last_check_steps = self._state.committed_steps
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Condition | None = None
        self._sync_task: asyncio.Task[None] | None = None

    # asyncio primitives are made on first use, inside the worker's event loop (__init__ runs in a thread).
    def _primitives(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None or self._changed is None:
            self._lock = asyncio.Lock()
            self._changed = asyncio.Condition()
        return self._lock, self._changed

    async def attach(self, shards: list[Any]) -> None:
        self._shards = list(shards)
        self._sync_task = asyncio.ensure_future(self._follow_shards())

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
            except DataServerLostError as exc:
                self._fail("data-server-lost", str(exc), self._state.committed_steps)
            except Exception as exc:
                self._fail("internal", f"reading the shards failed: {type(exc).__name__}: {exc}", None)
            await asyncio.sleep(SYNC_SECONDS)
        await self._notify()

    async def _sync(self) -> None:
        lock, _ = self._primitives()
        async with lock:
            if self._state.finished:
                return
            since = self._state.committed_steps
            statuses = await self._on_shards(lambda s: s.status(since))
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

    async def report_failure(
        self, generation: int, worker: str, step: int, batch_id: int | None, kind: str, message: str
    ) -> None:
        """A failure that no retry fixes (the model raised, a NaN loss): the job stops. A report of an
        older generation is dropped: its step was dropped with it, and the batch trains again."""
        if generation != self._state.generation:
            log.info(
                "job %s: dropped a failure report of generation %d: %s", self.job_id, generation, message
            )
            return
        self._fail(kind, f"{message} (on {worker})", step, batch_id)
        await self._notify()

    # -- survival detection ----------------------------------------------------------------------

    async def survival_check(
        self, live_workers: Iterable[str], trigger: str = "interval", renew: bool = False
    ) -> list[MembershipEvent]:
        """Decide and carry out survival detection; returns the events recorded since the last call.

        Training stops only when the membership changed (or `renew`: a member's compute loop was
        restarted and must start from a fence): the shards are fenced into a new generation, brought to
        one version, and the new members get their roles. Otherwise a snapshot is asked for, which the
        shards take between two steps without stopping.
        """
        began = time.time()
        lock, _ = self._primitives()
        live = frozenset(live_workers)
        try:
            async with lock:
                if not self._state.finished:
                    await self._check(live, trigger, renew, began)
        except DataServerLostError as exc:
            self._fail("data-server-lost", str(exc), self._state.committed_steps)
        except Exception as exc:
            self._fail("internal", f"survival detection failed: {type(exc).__name__}: {exc}", None)
        finally:
            await self._notify()
        events, self._unreported = self._unreported, []
        return events

    async def _check(self, live: frozenset[str], trigger: str, renew: bool, began: float) -> None:
        state = self._state
        statuses = await self._on_shards(lambda s: s.status(state.committed_steps))
        for status in statuses:
            self._take(state.absorb(status))
        if state.finished:
            return
        decision = survival_check(state.survival_state(), live, time.time())
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
        if decision.action is Action.SNAPSHOT:
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
        fenced: list[ShardStatus] = await self._on_shards(lambda s: s.fence(decision.generation))
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

    async def _on_shards(self, call: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """Run `call(shard)` on every shard at once, each bounded by the call timeout."""

        async def one(i: int, shard: Any) -> Any:
            try:
                return await asyncio.wait_for(call(shard), self._call_timeout)
            except (RecoverableError, FatalError):
                raise
            except Exception as exc:
                raise DataServerLostError(
                    f"data server {i} did not answer ({type(exc).__name__}: {exc}); "
                    "a lost static worker ends the job (standby static workers are not in this version)"
                ) from exc

        outcomes = await asyncio.gather(
            *(one(i, s) for i, s in enumerate(self._shards)), return_exceptions=True
        )
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
                fenced: list[ShardStatus] = await self._on_shards(lambda s: s.fence(decision.generation))
                plan = state.reconcile(decision, fenced)
                if plan.restore_to is not None:
                    target = plan.restore_to
                    await self._on_shards(lambda s: s.restore(decision.generation, target))
                    state.change_membership(decision, plan, fenced, "stop", time.time(), began)
                else:
                    state.generation = decision.generation
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
        statuses = await self._on_shards(lambda s: s.status(state.committed_steps))
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

    async def snapshot_record(self) -> Resume:
        """The coordinator's part of the last snapshot, for a persistent checkpoint."""
        return self._state.snapshot_record()
