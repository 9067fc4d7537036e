"""The coordinator (seed 000's task information server): an async Dask actor on a static worker.

Owns, for one job: the membership (live compute workers and the generation number), the batch ledger,
the work queue of the step in flight, the history of losses, and the event log. It hands out work
(`request_work`), collects reports (`report`), commits a step once all its micro-batches are reported
(it tells every shard to `apply`, then commits the ledger), and carries out survival detection
(`survival_check`): the decision itself is the pure `survival.survival_check`.

Does not own: parameters or data (the data servers), which workers exist (the controller reads the
scheduler and passes the live list in), process lifecycles (the controller).

Called by compute workers (`request_work`, `report`, `report_failure`) and by the controller
(`survival_check`, `progress`, `outcome`). Every method is `async def` (see data_server.py on why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import DataServerLostError, RecoverableError, StaleGenerationError
from .ledger import Ledger, LedgerEntry
from .schedule import Schedule
from .survival import Action, Decision, Policy, SurvivalState, survival_check

log = logging.getLogger(__name__)

# How long a worker's request for work waits on the coordinator before it is answered "nothing yet";
# short enough that loops notice a stop quickly, long enough to cost nothing while idle.
WORK_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Assignment:
    generation: int
    step: int
    batch_ids: tuple[int, ...]
    stop: bool = False  # the job is over: the loop ends


@dataclass(frozen=True)
class MembershipEvent:
    """One thing survival detection did, for `result.events` and the logs."""

    time: float
    kind: str  # joined-left | snapshot | rollback | reassign | waiting | failed | done
    generation: int
    step: int  # committed steps (the parameter version) after the event
    workers: tuple[str, ...]
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    steps_lost: int = 0  # committed steps undone (rollback)
    batches_dropped: int = 0  # micro-batches of the step in flight that were dropped and re-queued
    reason: str = ""
    # How long survival detection took to get here, from the moment the coordinator took the check up (a
    # wait for a commit in progress included): what the event held the training up, and for a snapshot
    # the window in which it could slow a step.
    seconds: float = 0.0


@dataclass(frozen=True)
class Progress:
    generation: int
    committed_steps: int
    total_steps: int
    workers: tuple[str, ...]
    state: str  # running | waiting | done | failed
    loss: float | None
    failure: str | None = None
    failure_kind: str | None = None
    failure_step: int | None = None
    failure_batch: int | None = None
    holding: tuple[tuple[str, int], ...] = ()  # (worker, micro-batches handed to it, not yet reported)

    def holds(self, worker: str) -> int:
        return dict(self.holding).get(worker, 0)


@dataclass(frozen=True)
class Resume:
    """Where a job restarts from (a persistent checkpoint)."""

    generation: int
    committed_steps: int
    ledger: list[LedgerEntry]
    history: list[float]


@dataclass
class Outcome:
    ledger: list[LedgerEntry]
    events: list[MembershipEvent]
    history: list[float]
    generation: int
    counters: dict[str, int] = field(default_factory=dict)
    commit_times: list[float] = field(default_factory=list)  # wall time each committed step committed


class Coordinator:
    def __init__(
        self,
        job_id: str,
        schedule: Schedule,
        policy: Policy,
        min_workers: int,
        min_workers_timeout: float,
        call_timeout: float,
        lease: float,
        resume: Resume | None = None,
    ) -> None:
        self.job_id = job_id
        self._lease = lease  # seconds a worker may hold a batch before it is handed to another
        self._schedule = schedule
        self._policy: Policy = policy
        self._min_workers = min_workers
        self._min_workers_timeout = min_workers_timeout
        self._call_timeout = call_timeout
        self._shards: list[Any] = []
        self._ledger = Ledger()
        self.generation = 0
        self._workers: frozenset[str] = frozenset()
        self._below_min_since: float | None = None
        # Nothing is handed out until the first survival check has seen workers.
        self._suspended = True
        self._waiting = False
        self._history: list[float] = []
        self._commit_times: list[float] = []  # parallel to _history; steps resumed from a checkpoint get nan
        if resume is not None:
            self._ledger.restore(resume.ledger, resume.committed_steps)
            self.generation = resume.generation
            self._history = list(resume.history)
            self._commit_times = [math.nan] * len(self._history)
        self._queue: deque[int] = deque()
        if not self._ledger.committed_steps >= schedule.total_steps:
            self._queue.extend(schedule.step_batches(self._ledger.committed_steps))
        self._assigned: dict[int, tuple[str, float]] = {}  # batch id -> (worker, when it was handed out)
        self._losses: dict[int, float] = {}  # batch id -> loss, for the step in flight
        self._reporters: dict[int, str] = {}  # batch id -> the worker that reported it
        self._events: list[MembershipEvent] = []
        self._failure: tuple[str, str, int | None, int | None] | None = None
        self._counters = {
            "assignments": 0,
            "stale_reports": 0,
            "rollbacks": 0,
            "reassigns": 0,
            "snapshots": 0,
            "leases_expired": 0,
        }
        self._lock: asyncio.Lock | None = None
        self._work_ready: asyncio.Condition | None = None

    # asyncio primitives are made on first use, inside the worker's event loop (__init__ runs in a thread).
    def _sync_primitives(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None or self._work_ready is None:
            self._lock = asyncio.Lock()
            self._work_ready = asyncio.Condition()
        return self._lock, self._work_ready

    async def attach(self, shards: list[Any]) -> None:
        self._shards = list(shards)

    @property
    def _finished(self) -> bool:
        return self._failure is not None or self._ledger.committed_steps >= self._schedule.total_steps

    async def _notify(self) -> None:
        _, ready = self._sync_primitives()
        async with ready:
            ready.notify_all()

    # -- compute workers -------------------------------------------------------------------------

    async def request_work(self, worker: str) -> Assignment | None:
        """Batch ids of the step in flight for `worker`, `None` when there is nothing for it yet."""
        return await self._next_work(worker)

    async def _next_work(self, worker: str) -> Assignment | None:
        _, ready = self._sync_primitives()
        deadline = time.monotonic() + WORK_POLL_SECONDS
        while True:
            if self._finished:
                return Assignment(self.generation, self._ledger.committed_steps, (), stop=True)
            if not self._suspended and worker in self._workers:
                self._requeue_orphans(worker)
                if not self._queue:
                    self._requeue_overdue(worker)
                if self._queue:
                    return self._assign(worker)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            async with ready:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), remaining)

    def _requeue_orphans(self, worker: str) -> None:
        # A worker asks for work only when it holds none, so anything still assigned to it was lost
        # with a loop that died (its process survived); hand it out again.
        orphans = sorted(b for b, (w, _) in self._assigned.items() if w == worker)
        for b in reversed(orphans):
            del self._assigned[b]
            self._queue.appendleft(b)

    def _requeue_overdue(self, worker: str) -> None:
        # A frozen worker (SIGSTOP, a hung GPU) stays in the scheduler until its worker-ttl, minutes later;
        # its batches go to an idle worker once their lease is up. Should the frozen one wake and push too,
        # its gradients are bitwise the same and overwrite the others; the step still commits once.
        now = time.monotonic()
        overdue = sorted(
            b for b, (w, since) in self._assigned.items() if w != worker and now - since > self._lease
        )
        for b in overdue:
            del self._assigned[b]
            self._queue.append(b)
        self._counters["leases_expired"] += len(overdue)

    def _assign(self, worker: str) -> Assignment:
        share = math.ceil(len(self._schedule.step_batches(self._ledger.committed_steps)) / len(self._workers))
        ids = tuple(self._queue.popleft() for _ in range(min(share, len(self._queue))))
        now = time.monotonic()
        for b in ids:
            self._assigned[b] = (worker, now)
        self._counters["assignments"] += 1
        return Assignment(self.generation, self._ledger.committed_steps, ids)

    async def report(
        self, generation: int, worker: str, step: int, losses: dict[int, float]
    ) -> Assignment | None:
        """`worker` pushed the gradients of these batch ids to every shard; returns its next work.

        The answer is what `request_work` would give next (waiting for it the same way), so a worker
        makes one round trip between computing a step and knowing its next one.
        """
        lock, _ = self._sync_primitives()
        async with lock:
            if generation != self.generation:
                self._counters["stale_reports"] += 1
                raise StaleGenerationError(generation, self.generation, "report")
            if step != self._ledger.committed_steps or self._finished:
                raise RecoverableError(
                    f"report for step {step}, but step {self._ledger.committed_steps} is open"
                )
            for b, loss in losses.items():
                self._assigned.pop(b, None)
                self._losses[b] = loss
                self._reporters[b] = worker
            committed = len(self._losses) == len(self._schedule.step_batches(step))
            if committed:
                await self._commit_step(step)
        if committed:
            await self._notify()
        return await self._next_work(worker)

    async def report_failure(
        self, generation: int, worker: str, step: int, batch_id: int | None, kind: str, message: str
    ) -> None:
        """A failure that no retry fixes (the model raised, a NaN loss): the job stops."""
        self._fail(kind, f"{message} (on {worker})", step, batch_id)
        await self._notify()

    async def _commit_step(self, step: int) -> None:
        ids = sorted(self._losses)
        try:
            await self._on_shards(lambda s: s.apply(self.generation, step, ids))
            self._ledger.commit(ids, step, self.generation, self._reporters)
        except DataServerLostError as exc:
            self._fail("data-server-lost", str(exc), step)
            return
        except Exception as exc:
            # Some shards may have applied the step and others not: no later step can be trusted.
            self._fail("internal", f"committing step {step} failed: {type(exc).__name__}: {exc}", step)
            return
        self._history.append(sum(self._losses[b] for b in ids) / len(ids))
        self._commit_times.append(time.time())
        self._losses.clear()
        self._reporters.clear()
        self._assigned.clear()
        self._queue.clear()
        if not self._finished:
            self._queue.extend(self._schedule.step_batches(self._ledger.committed_steps))
        elif self._failure is None:
            self._record("done")

    # -- survival detection ----------------------------------------------------------------------

    async def survival_check(
        self, live_workers: Iterable[str], trigger: str = "interval"
    ) -> MembershipEvent | None:
        """Suspend, decide, carry the decision out, resume. Returns the event it recorded, if any.

        Work is suspended only when the membership changed: a periodic check that just snapshots holds
        the lock (so no step commits half-way through the snapshot) but lets workers take work meanwhile.
        """
        began = time.time()
        lock, _ = self._sync_primitives()
        live = frozenset(live_workers)
        if live != self._workers:
            self._suspended = True
        try:
            async with lock:
                if self._finished:
                    return None
                state = SurvivalState(
                    generation=self.generation,
                    workers=self._workers,
                    policy=self._policy,
                    min_workers=self._min_workers,
                    min_workers_timeout=self._min_workers_timeout,
                    committed_steps=self._ledger.committed_steps,
                    snapshot_step=self._ledger.snapshot_step,
                    below_min_since=self._below_min_since,
                )
                decision = survival_check(state, live, time.time())
                event = await self._carry_out(decision, trigger, began)
                self._suspended = not decision.resume
                return event
        except DataServerLostError as exc:
            self._fail("data-server-lost", str(exc), self._ledger.committed_steps)
            return None
        except Exception as exc:
            self._fail("internal", f"survival detection failed: {type(exc).__name__}: {exc}", None)
            return None
        finally:
            await self._notify()

    async def _carry_out(self, d: Decision, trigger: str, began: float) -> MembershipEvent | None:
        in_flight = len(self._losses) + len(self._assigned)
        event: MembershipEvent | None = None
        if d.action is Action.SNAPSHOT:
            await self._on_shards(lambda s: s.snapshot(self.generation))
            self._ledger.mark_snapshot()
            self._counters["snapshots"] += 1
            event = self._record("snapshot", reason=d.reason, began=began)
        elif d.action in (Action.ROLLBACK, Action.REASSIGN):
            restore = d.action is Action.ROLLBACK
            self.generation = d.generation
            versions = await self._on_shards(lambda s: s.fence(d.generation, restore))
            steps_lost = 0
            if restore:
                before = self._ledger.committed_steps
                self._ledger.drop_after_snapshot()
                steps_lost = before - self._ledger.committed_steps
                del self._history[self._ledger.committed_steps :]
                del self._commit_times[self._ledger.committed_steps :]
                self._counters["rollbacks"] += 1
            else:
                self._counters["reassigns"] += 1
            if set(versions) != {self._ledger.committed_steps}:
                raise DataServerLostError(
                    f"shards at versions {versions} after {d.action.value}, ledger at "
                    f"{self._ledger.committed_steps}: the parameter state is inconsistent"
                )
            self._workers = d.workers
            self._requeue_step()
            event = self._record(
                d.action.value,
                joined=d.joined,
                left=d.left,
                steps_lost=steps_lost,
                batches_dropped=in_flight,
                reason=f"{d.reason} ({trigger})",
                began=began,
            )
        self._workers = d.workers
        self.generation = d.generation
        was_waiting, self._waiting = self._waiting, not d.resume
        self._below_min_since = d.below_min_since
        if self._waiting and not was_waiting:
            event = self._record("waiting", reason=d.reason, began=began)
        if d.failure is not None:
            self._fail("not-enough-workers", d.failure, self._ledger.committed_steps)
        if event is not None:
            log.info(
                "job %s %s: generation %d, step %d, workers %s, %.3f s: %s",
                self.job_id,
                event.kind,
                event.generation,
                event.step,
                list(event.workers),
                event.seconds,
                event.reason,
            )
        return event

    def _requeue_step(self) -> None:
        self._losses.clear()
        self._reporters.clear()
        self._assigned.clear()
        self._queue.clear()
        if not self._finished:
            self._queue.extend(self._schedule.step_batches(self._ledger.committed_steps))

    def _fail(self, kind: str, message: str, step: int | None, batch_id: int | None = None) -> None:
        if self._failure is None:
            self._failure = (kind, message, step, batch_id)
            self._record("failed", reason=message)
            log.error(
                "job %s failed (%s) at step %s, batch %s: %s", self.job_id, kind, step, batch_id, message
            )

    def _record(
        self,
        kind: str,
        *,
        joined: frozenset[str] = frozenset(),
        left: frozenset[str] = frozenset(),
        steps_lost: int = 0,
        batches_dropped: int = 0,
        reason: str = "",
        began: float | None = None,
    ) -> MembershipEvent:
        now = time.time()
        event = MembershipEvent(
            time=now,
            kind=kind,
            generation=self.generation,
            step=self._ledger.committed_steps,
            workers=tuple(sorted(self._workers)),
            joined=tuple(sorted(joined)),
            left=tuple(sorted(left)),
            steps_lost=steps_lost,
            batches_dropped=batches_dropped,
            reason=reason,
            seconds=0.0 if began is None else now - began,
        )
        self._events.append(event)
        return event

    async def _on_shards(self, call: Any) -> list[Any]:
        """Run `call(shard)` on every shard at once, each bounded by the call timeout."""

        async def one(i: int, shard: Any) -> Any:
            try:
                return await asyncio.wait_for(call(shard), self._call_timeout)
            except (RecoverableError, DataServerLostError):
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
        kind: str | None = None
        message: str | None = None
        step: int | None = None
        batch: int | None = None
        if self._failure is not None:
            kind, message, step, batch = self._failure
            state = "failed"
        else:
            state = "done" if self._finished else ("waiting" if self._waiting else "running")
        return Progress(
            generation=self.generation,
            committed_steps=self._ledger.committed_steps,
            total_steps=self._schedule.total_steps,
            workers=tuple(sorted(self._workers)),
            state=state,
            loss=self._history[-1] if self._history else None,
            failure=message,
            failure_kind=kind,
            failure_step=step,
            failure_batch=batch,
            holding=tuple(sorted(Counter(w for w, _ in self._assigned.values()).items())),
        )

    async def outcome(self) -> Outcome:
        return Outcome(
            ledger=self._ledger.entries(),
            events=list(self._events),
            history=list(self._history),
            commit_times=list(self._commit_times),
            generation=self.generation,
            counters={
                **self._counters,
                "committed_steps": self._ledger.committed_steps,
                "dropped_steps": self._ledger.dropped_steps,
                "dropped_batches": self._ledger.dropped_batches,
            },
        )

    async def stop(self, reason: str) -> None:
        """Stop handing out work (the controller is shutting the job down)."""
        self._fail("stopped", reason, self._ledger.committed_steps)
        await self._notify()

    async def snapshot_now(self) -> int:
        """Snapshot the committed state at once (at the end, or before stopping); returns its step."""
        began = time.time()
        lock, _ = self._sync_primitives()
        async with lock:
            if self._ledger.committed_steps > self._ledger.snapshot_step:
                await self._on_shards(lambda s: s.snapshot(self.generation))
                self._ledger.mark_snapshot()
                self._counters["snapshots"] += 1
                self._record("snapshot", reason="requested by the controller", began=began)
            return self._ledger.snapshot_step

    async def snapshot_record(self) -> Resume:
        """The coordinator's part of the last snapshot, for a persistent checkpoint."""
        step = self._ledger.snapshot_step
        return Resume(
            generation=self.generation,
            committed_steps=step,
            ledger=[e for e in self._ledger.entries() if e.step < step],
            history=self._history[:step],
        )
