"""The coordinator actor's calls to the data servers, and what a fence, a restore or a snapshot of every
shard takes: the base of the actor (`actor.Coordinator`), shared with its static roles
(`role_moves.RoleMoves`).

Every call goes to every shard not lost, at once, each bounded by the call timeout; a shard that does not
answer raises `ShardUnreachable`, and once a shard is known lost every call waiting on it gives up. The
bookkeeping is the state's (`state.CoordinatorState`); this class feeds it the shards' answers, and records
the events it returns for the controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from ..dask_failures import actor_unreachable
from ..errors import FatalError
from ..messages import EventKind, MembershipEvent, ShardStatus
from ..wire.signals import RecoverableError
from .commit_book import Reconciliation
from .record import Failure
from .state import CoordinatorState
from .survival import Decision

log = logging.getLogger(__name__)


def fence(
    shard: Any, generation: int, since: int = 0, applied_from: int | None = None
) -> Awaitable[ShardStatus]:
    fenced: Awaitable[ShardStatus] = shard.fence(generation, since, applied_from)
    return fenced


class ShardUnreachable(Exception):
    """A call to data server `index` failed (its worker is gone, or it did not answer in time)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self) -> tuple[type[ShardUnreachable], tuple[int, str]]:
        # Raised out of an actor call, it is pickled to the caller: by default with its message alone.
        return (type(self), (self.index, str(self)))


def actor_key(shard: Any) -> str | None:
    """The actor key of a data server's handle (a Dask `Actor`); None for one that has none."""
    return getattr(shard, "key", None)


class ShardCalls:
    def __init__(self, job_id: str, state: CoordinatorState, call_timeout: float) -> None:
        self.job_id = job_id
        self._state = state
        self._call_timeout = call_timeout
        self._shards: list[Any] = []  # Dask actor handles of the data servers (awaitable calls here)
        self._unreported: list[MembershipEvent] = []  # events the controller has not been given yet
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Condition | None = None
        self._gone: dict[int, asyncio.Event] = {}  # set when a shard is known lost: calls to it give up

    # asyncio primitives are made on first use, inside the worker's event loop (__init__ runs in a thread).
    def _primitives(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None or self._changed is None:
            self._lock = asyncio.Lock()
            self._changed = asyncio.Condition()
        return self._lock, self._changed

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

    def _fail(self, kind: str, message: str, step: int | None, batch_id: int | None = None) -> None:
        events = self._state.fail(Failure(kind, message, step, batch_id), time.time())
        if events:
            log.error(
                "job %s failed (%s) at step %s, batch %s: %s", self.job_id, kind, step, batch_id, message
            )
        self._take(events)

    # -- calls to every shard --------------------------------------------------------------------

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

    async def _fence_shards(self, generation: int) -> list[ShardStatus]:
        """Fence every shard not lost into `generation`; their statuses carry the records from the first
        step the state has not taken in (the older ones it ignores)."""
        return await self._on_shards(partial(fence, generation=generation, since=self._state.since()))

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
                if not actor_unreachable(exc):
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

    # -- a membership change, and snapshots ------------------------------------------------------

    async def _change_membership(self, decision: Decision, trigger: str, began: float) -> None:
        state = self._state
        # No role of the new generation goes out before `change_membership`: roles follow the state's
        # generation, which changes there (after the shards are fenced and brought to one version).
        fenced = await self._fence_shards(decision.generation)
        plan = await self._to_one_version(decision, fenced)
        self._take([state.change_membership(decision, plan, fenced, trigger, time.time(), began)])

    async def _to_one_version(self, decision: Decision, fenced: list[ShardStatus]) -> Reconciliation:
        """Bring the fenced shards to one version (`CoordinatorState.reconcile`): the shards ahead step
        back, or every shard restores the snapshot (also where a step back was refused)."""
        state = self._state
        plan = state.reconcile(decision, fenced)
        if plan.step_back_to is not None:
            back = plan.step_back_to
            try:
                await self._on_shards(lambda s: s.step_back(decision.generation, back))
            except RecoverableError as exc:
                log.warning(
                    "a step back to step %d was refused (%s): every shard restores the snapshot", back, exc
                )
                plan = replace(plan, step_back_to=None, restore_to=state.ledger.snapshot_step)
        if plan.restore_to is not None:
            target = plan.restore_to
            await self._on_shards(lambda s: s.restore(decision.generation, target))
        return plan

    async def _snapshot_committed(self, began: float) -> None:
        """Every shard snapshots the committed step, if they stand at one version and it is new."""
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
        """Fence every shard into a new generation (nothing is applied meanwhile), snapshot each at its own
        version, and go on at once: the members get their roles of the new generation."""
        state = self._state
        generation = state.generation + 1
        fenced = await self._fence_shards(generation)
        state.pause(generation)
        await self._snapshot_where_fenced(fenced, began)

    async def _snapshot_where_fenced(self, fenced: list[ShardStatus], began: float) -> None:
        """Every shard fenced (`fenced`: where each stands): each snapshots its own version."""
        state = self._state
        for status in fenced:
            self._take(state.absorb(status))
        versions = {i: s.version for i, s in enumerate(sorted(fenced, key=lambda s: s.index))}
        by_handle = {id(shard): versions[i] for i, shard in enumerate(self._shards)}
        generation = state.generation
        await self._on_shards(lambda s: s.snapshot_at(generation, by_handle[id(s)], by_handle[id(s)]))
        ordered = tuple(versions[i] for i in range(len(versions)))
        self._take([state.snapshot_async(ordered, time.time(), time.time() - began)])
