"""The step's apply on a shard, in its two modes: two implementations of `StepApplies` (`step_applies.py`).

- `SyncApplies` (sync mode): a step's gradients are collected from every worker's push, and the push that
  completes the step applies it, summed in batch-id order: the shard is a commit point of its own, with no
  round trip to the coordinator on the step path. A pull of a step waits until the step before is applied.
- `AsyncApplies` (async mode): each micro-batch's gradient is applied as it arrives, once per batch id,
  refused above `max_staleness`; a loop reads the parameters as they are now (`current`).

The data server is handed one of them (`prefect_elastic.modes`, chosen when the job is prepared) and never
asks which it has. Both act on the shard's `ShardState` and keep its records; the decisions are pure
(`records.py`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import torch

from ..errors import FatalError
from ..messages import StepRecord, Tensors
from ..schedule import Schedule
from ..stragglers import RECENT_STEPS, backup_after, backup_due_in
from ..wire import Apply, Confirm, Part, Push
from ..wire.signals import BackupWanted, RecoverableError, StepPassed
from .bucketed import OpenBuckets
from .hooks import ServerHooks
from .optimizer import Gradient
from .records import OpenStep, async_verdict, push_refusal, replicas_kept_async, replicas_kept_sync
from .state import ShardState

log = logging.getLogger(__name__)

# How often a pull that waits looks again whether a backup is due, while a member is behind (a push does
# not wake it).
BACKUP_LOOK_SECONDS = 0.02


class SyncApplies:
    """Sync mode: the push that completes a step applies it."""

    def __init__(self, state: ShardState, schedule: Schedule, hooks: ServerHooks, max_staleness: int) -> None:
        self._state = state
        self._schedule = schedule
        self._open = OpenStep()
        # A data server that holds no state: pushes of steps after its open one, kept until it gets there
        # (a loop does not wait for such a server's answer, so its pushes can overtake another's).
        self._later: dict[int, OpenStep] = {}
        self._advancing = False  # `advance` under way
        self._step_applied: asyncio.Future[None] | None = None  # done when the last `_apply_step` ends
        # When the last steps were applied (monotonic), the pace a backup waits on (`stragglers.py`).
        self._applied_at: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS + 1)
        # The positions in a step (micro-batch `j`) that the last step applied got from a backup.
        self._behind: set[int] = set()
        self._parts = OpenBuckets(state.index)  # the open step's gradients where they come in parts

    async def push(self, push: Push, grads: dict[int, Gradient], buffers: dict[int, Tensors]) -> None:
        """The push that completes step `step` applies it."""
        generation, step, worker, losses = push.generation, push.step, push.worker, push.losses
        backup, bucketed = push.backup, push.bucketed
        state = self._state
        state.check(generation, "push")
        if self._parts.error is not None:
            raise self._parts.error
        if step < state.version or (step == state.version and state.applying):
            # Applied (or being applied) without this push: its batch ids came from a backup.
            raise StepPassed(step, state.version + state.applying, state.index)
        refusal = push_refusal(state.index, step, state.version, state.applying, state.stateless)
        if refusal is not None:
            raise RecoverableError(refusal)
        opened = self._open if step == state.version else self._later.setdefault(step, OpenStep())
        if opened.opened is None:
            opened.opened = time.monotonic()
        if bucketed:
            self._parts.check_sealed(generation, step, [int(b) for b in losses])
            opened.bucketed = True
        for batch_id in losses:
            if self._schedule.step_of(batch_id) != step:
                raise FatalError(f"gradient of batch {batch_id} pushed for step {step}")
            opened.take(
                batch_id,
                worker,
                grads.get(batch_id, {}),
                buffers.get(batch_id, {}),
                losses[batch_id],
                backup,
            )
        await self.advance()

    async def part(self, part: Part, run: torch.Tensor) -> None:
        """Summed into the open step's book; dropped when of another generation or step (`bucketed.py`)."""
        generation, step, batch_id = part.generation, part.step, part.batch
        state = self._state
        # (Another generation's or step's is dropped: the seal after it on its connection is refused.)
        if generation == state.generation and step == state.version and not state.applying:
            numel = state.optimizer.numel if state.optimizer is not None else None
            batches = self._schedule.step_batches(step)
            # A member's own part of an id this shard asked a backup of is held aside, as its seal is
            # (`OpenStep.take`): it may have been computed on parameters a peer moved from the backup.
            aside = not part.backup and batch_id in self._open.wanted
            bucket, bounds = part.bucket, part.bounds
            self._parts.take(generation, step, batches, batch_id, bucket, bounds, numel, run, aside)
            self._apply_whole_buckets()

    def _apply_whole_buckets(self) -> None:
        """A bucket whole (every micro-batch's part in) is applied now, into the copy loops do not read."""
        state = self._state
        copy = self._parts.other_copy(state.optimizer)
        if copy is not None and self._parts.ready():
            state.copies.apply_started()  # (the other copy, which held the version before, is written)
            self._parts.apply_whole(copy, state.apply_inline)

    async def pull(self, generation: int, step: int, wait: float, asker: str | None = None) -> Tensors:
        """A worker asks for the next step's parameters right after pushing this step's gradients; the call
        waits (up to `wait` seconds) until the shard has applied the step before, so the answer leaves the
        moment the parameters exist. It fails when the generation changes or the wait runs out, and asks
        `asker` for a backup (once a step) when the step before stood open too long with micro-batches
        missing (`stragglers.py`)."""
        state = self._state
        state.check(generation, "pull")
        deadline = time.monotonic() + wait
        while (state.version < step or state.applying) and not state.held(step):
            now = time.monotonic()
            due = self._backup_due_in(step, asker, now)
            if due <= 0.0:
                raise self._backup_wanted(step - 1, asker)
            remaining = deadline - now
            if remaining <= 0.0:
                break
            # (A push does not end this wait: while a member is behind, the shard looks again soon.)
            look_again = BACKUP_LOOK_SECONDS if self._behind else remaining
            await state.wait_for_version(generation, step, min(remaining, due, look_again))
        if state.held(step):  # (also a hold that came while this pull waited)
            raise RecoverableError(
                f"shard {state.index} holds at step {state.hold} (a static worker retires)"
            )
        if state.version > step:
            raise StepPassed(step, state.version, state.index)
        if state.applying or state.version != step:
            raise RecoverableError(
                f"pull for step {step}, but shard {state.index} is at step {state.version}"
            )
        # No copy: the tensors are serialized as this reply is sent, or read in place by a loop on this
        # machine while it computes (`wire/published.py`). The shard changes them only when it applies this
        # step, which needs the gradient of every batch id of it: from the workers that compute with them
        # (each is done with them before its push), or from a backup of a silent one's share. A straggler
        # still reading them then computes on parameters that moved, but its push of a step applied already
        # is refused (`StepPassed`). A reply still on the wire to a worker declared dead, or a loop of that
        # worker reading in place, may see a restore; that worker's generation is refused anyway.
        return state.live()

    def _backup_due_in(self, step: int, asker: str | None, now: float) -> float:
        """Seconds until a pull of `step` by `asker` asks it for a backup of the open step (`inf`: never)."""
        state, opened = self._state, self._open
        if asker is None or opened.opened is None:
            return float("inf")
        if state.applying or step != state.version + 1 or state.version >= self._schedule.total_steps:
            return float("inf")
        batches = self._schedule.step_batches(state.version)
        missing = [b - batches.start for b in opened.missing(batches)]
        times = self._applied_at
        after = backup_after(
            [later - earlier for earlier, later in zip(times, list(times)[1:], strict=False)]
        )
        return backup_due_in(now, opened.opened, after, missing, self._behind, opened.told.get(asker))

    def _backup_wanted(self, step: int, asker: str | None) -> BackupWanted:
        if asker is not None:
            self._open.told[asker] = time.monotonic()
        missing = tuple(self._open.missing(self._schedule.step_batches(step)))
        # From now on a member's own copy of these is held aside (`OpenStep.take`): it may have been
        # computed on parameters a peer applied this step to, from the backup.
        self._open.wanted.update(missing)
        return BackupWanted(step, missing)

    async def confirm(self, confirm: Confirm) -> None:
        """A member's copies held aside go in (`OpenStep.confirm`), their parts with them where they came
        in parts (`OpenBuckets.confirm`): it pushed them to every shard before any applied the step. Of
        another step, or of ids a backup's copy came for: nothing to do."""
        state = self._state
        state.check(confirm.generation, "confirm")
        if confirm.step != state.version or state.applying:
            return
        taken = self._open.confirm(confirm.worker, confirm.batch_ids)
        if taken:
            if self._open.bucketed:
                self._parts.confirm(confirm.generation, confirm.step, taken)
                self._apply_whole_buckets()
            await self.advance()

    async def apply_one(self, apply: Apply, grads: Tensors, buffers: Tensors) -> tuple[str, int]:
        self._state.check(apply.generation, "apply")
        raise FatalError(f"shard {self._state.index} got an async gradient in a sync job")

    async def current(self, generation: int) -> tuple[int, Tensors]:
        self._state.check(generation, "pull")
        raise FatalError(f"shard {self._state.index} of a sync job was asked for its parameters of no step")

    async def current_for_answer(self, generation: int) -> tuple[int, Tensors]:
        return await self.current(generation)

    async def advance(self) -> None:
        """Apply the open step if every gradient of it is here and no hold keeps it; then the next one,
        from the pushes kept for later (`_later`), as far as they go."""
        if self._advancing:
            return  # the call under way checks again after each step it applies
        self._advancing = True
        state = self._state
        try:
            # One at a time: a push that completes the next step while `_apply_step` awaits (its version
            # announced, a snapshot due) leaves the apply to this loop, so each step's own ends run first.
            while not state.applying and self._open_step_complete() and not state.held(state.version):
                await self._apply_step(state.version)
        finally:
            self._advancing = False

    def _open_step_complete(self) -> bool:
        state = self._state
        step = state.version
        return (
            step < self._schedule.total_steps
            and self._open.complete(len(self._schedule.step_batches(step)))
            and (not self._open.bucketed or self._parts.whole(state.generation, step))
        )

    async def _apply_step(self, step: int) -> None:
        state = self._state
        opened, self._open = self._open, OpenStep()
        _, grads, buffers = opened.in_order()
        # Gradients in parts: applied bucket by bucket into the other copy, published now; or (an optimizer
        # without an out-of-place update) their mean, applied here as one gradient.
        copy = self._parts.other_copy(state.optimizer) if opened.bucketed else None
        if opened.bucketed and copy is None:
            grads = [self._parts.mean()]  # (one gradient: `ShardOptimizer.step` takes it as the mean)
        state.applying = True
        done = self._step_applied = asyncio.get_running_loop().create_future()
        try:
            # A snapshot of this version still reads the tensors (with two copies: the one this commit
            # makes the next step's to write into).
            await state.snapshot_taken()
            if copy is not None:
                await self._parts.finish(copy, state.apply_inline)
                state.publish(copy.flip, buffers)
            else:
                await state.run_apply(grads, buffers)
        finally:
            state.applying = False
            done.set_result(None)
        if copy is None:
            state.copies.applied_in_place()  # (`publish` committed the other copy's)
        self._applied_at.append(time.monotonic())
        first = self._schedule.step_batches(step).start
        self._behind = {b - first for b in opened.backed_up}
        # (Before any await: a push of the new step may come in at the next one.)
        self._open = self._later.pop(state.version, self._open)
        state.records.add(opened.record(step, state.generation, time.time()))
        await state.announce_version()
        if state.snapshot_wanted == state.version:
            state.start_snapshot()

    async def settle(self) -> int:
        if self._step_applied is not None:
            # A step being applied in a thread (a shard too big to apply on the event loop) ends before
            # the fence's answer says where the shard stands; else a restore would copy the snapshot into
            # tensors the thread is still changing, and the version would move after the answer.
            await asyncio.shield(self._step_applied)
        try:
            # (Likewise a bucket being applied into the other copy: it reads the published one.)
            await self._parts.applies_done()
        except Exception as exc:  # (its step is dropped here: what failed is of no step any more)
            log.warning("shard %d: a bucket's apply failed before a fence: %r", self._state.index, exc)
        pending = self.pending
        self.drop_open()
        return pending

    async def step_back(self, version: int) -> int:
        """Back to `version`, the one before this shard's, where its other copy still holds it whole
        (`ShardState.kept`: a kill between a member's seals to two shards left this one a step ahead).
        Raises RecoverableError where it cannot: the coordinator then restores the snapshot."""
        state = self._state
        copy = self._parts.made_copy(state.optimizer)
        # (A shard that holds no state has nothing to keep: it counts its version back.)
        able = state.stateless or (copy is not None and state.copies.can_step_back_to(version))
        if state.version != version + 1 or not able or state.applying:
            raise RecoverableError(
                f"shard {state.index} at step {state.version} cannot step back to {version} "
                f"(it keeps {state.kept})"
            )
        await state.snapshot_taken()  # (a snapshot of the step undone still reads the parameters)
        state.step_back(copy.flip_back if copy is not None and not state.stateless else None)
        await state.announce_version()
        return state.version

    def drop_open(self) -> None:
        self._open = OpenStep()
        self._parts.drop()
        self._later.clear()
        self._behind = set()  # (a new generation's ranks hold other positions)

    def reset(self) -> None:
        self.drop_open()

    @property
    def pending(self) -> int:
        return len(self._open.grads)

    @property
    def parts_phases(self) -> dict[str, float]:
        parts = self._parts
        copy = parts.made_copy(self._state.optimizer)
        return {
            "parts": float(parts.taken),
            "parts_dropped": float(parts.dropped),
            "buckets_applied": float(copy.applied if copy is not None else 0),
            "buckets_undone": float(parts.undone),
            "apply_buckets": parts.apply_seconds,
        }

    def applied_from(self, first: int) -> tuple[int, ...] | None:
        return None  # (the steps' records say what was applied)

    def replicas_kept(self, versions: list[int], keep: int) -> set[int]:
        return replicas_kept_sync(versions, keep)


class AsyncApplies:
    """Async mode: each micro-batch's gradient is applied as it arrives, once per batch id."""

    def __init__(self, state: ShardState, schedule: Schedule, hooks: ServerHooks, max_staleness: int) -> None:
        self._state = state
        self._total_batches = schedule.total_batches
        self._hooks = hooks
        self._max_staleness = max_staleness
        self._published: tuple[int, Tensors] | None = None  # (version, a copy of the state) for pulls

    async def push(self, push: Push, grads: dict[int, Gradient], buffers: dict[int, Tensors]) -> None:
        self._state.check(push.generation, "push")
        raise FatalError(f"shard {self._state.index} got a sync push in an async job")

    async def part(self, part: Part, run: torch.Tensor) -> None:
        self._state.check(part.generation, "push")
        raise FatalError(f"shard {self._state.index} got a gradient in parts in an async job")

    async def pull(self, generation: int, step: int, wait: float, asker: str | None = None) -> Tensors:
        self._state.check(generation, "pull")
        raise FatalError(f"shard {self._state.index} got a pull of step {step} in an async job")

    async def confirm(self, confirm: Confirm) -> None:
        self._state.check(confirm.generation, "confirm")
        raise FatalError(f"shard {self._state.index} got a sync confirm in an async job")

    async def apply_one(self, apply: Apply, grads: Tensors, buffers: Tensors) -> tuple[str, int]:
        """Apply the gradient of one micro-batch now, unless this shard applied that batch id already or
        it is too stale (`async_verdict`). Returns the outcome and the staleness."""
        generation, worker, batch_id = apply.generation, apply.worker, apply.batch_id
        computed_on, loss = apply.computed_on, apply.loss
        state = self._state
        state.check(generation, "apply")
        if not 0 <= batch_id < self._total_batches or computed_on < 0:
            raise FatalError(f"gradient of batch {batch_id} computed on version {computed_on}")
        async with state.turn():
            state.check(generation, "apply")  # a fence may have come while this one waited its turn
            await self._hooks.before_apply()
            state.check(generation, "apply")  # (and while a hook held it)
            verdict, staleness = async_verdict(
                batch_id, computed_on, state.version, state.applied, self._max_staleness
            )
            if verdict is not None:
                # (A stale one is counted by the loops, as `stale_refusals`; `refused` counts messages of
                # old generations.)
                return verdict, staleness
            if state.held(state.version):
                raise RecoverableError(f"shard {state.index} holds at version {state.hold}")
            if staleness > 1:
                # Staleness-aware step (Zhang et al., 2016): a gradient computed `staleness` versions ago
                # counts 1/staleness. With several workers pushing, plain async SGD with momentum diverges
                # (a transformer, 4 workers, staleness 5 to 8: the loss went from 1.4 to 1e9).
                grads = {n: g.div_(staleness) for n, g in grads.items()}
            state.applying = True
            try:
                await state.run_apply([grads], [buffers])
            finally:
                state.applying = False
            state.applied.add(batch_id)
            state.records.add(
                StepRecord(
                    state.version,
                    state.generation,
                    (batch_id,),
                    {batch_id: worker},
                    {batch_id: loss},
                    time.time(),
                    computed_on,
                    staleness,
                )
            )
            state.copies.applied_in_place()
            self._published = None
        await state.announce_version()
        return "applied", staleness

    async def current_for_answer(self, generation: int) -> tuple[int, Tensors]:
        """`current` without a copy where every apply runs on this event loop (`apply_inline`). No apply
        can then change the tensors between here and the answer's write, and `ShardServer` sends an
        answer's bytes, or copies them, before it awaits anything. (The mlp's 2.7 MB copy per apply cost
        the compute worker beside it more than the copy itself: memory bandwidth on a shared machine.)"""
        state = self._state
        if not state.apply_inline:
            return await self.current(generation)
        state.check(generation, "pull")
        return state.version, state.live()

    async def current(self, generation: int) -> tuple[int, Tensors]:
        """A copy, made once per version: an apply may change the live tensors while the answer is still
        being sent."""
        state = self._state
        state.check(generation, "pull")
        published = self._published
        if published is None or published[0] != state.version:
            async with state.turn():
                live = {n: t.detach().clone() for n, t in state.live().items()}
                published = self._published = (state.version, live)
        return published

    async def advance(self) -> None:
        return None  # (every gradient is applied as it arrives, or refused)

    async def step_back(self, version: int) -> int:
        raise FatalError(f"shard {self._state.index} of an async job was asked to step back")

    async def settle(self) -> int:
        return 0  # (the apply under way is waited for with every other turn: `ShardState.wait_turns`)

    def drop_open(self) -> None:
        return None

    def reset(self) -> None:
        self._published = None

    @property
    def pending(self) -> int:
        return 0

    @property
    def parts_phases(self) -> dict[str, float]:
        return {}  # (gradients never come in parts in async mode)

    def applied_from(self, first: int) -> tuple[int, ...] | None:
        # (Async commits run close to the lowest open id: few ids lie above it.)
        return tuple(sorted(b for b in self._state.applied if b >= first))

    def replicas_kept(self, versions: list[int], keep: int) -> set[int]:
        return replicas_kept_async(versions, keep)
