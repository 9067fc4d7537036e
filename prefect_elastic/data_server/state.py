"""One shard's state on its data server: parameters, buffers and optimizer, the version, the generation,
the snapshots and the records, shared by the step's apply (either mode), the replicas and the actor.

Everything here is touched from the worker's event loop only; the optimizer step of a big shard runs in a
thread (`run_apply`), and every caller that could meet it waits for it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FatalError
from ..job import ModelSpec
from ..messages import Tensors
from ..wire.signals import StaleGenerationError
from .bucket_book import TwoCopies
from .optimizer import Gradient, ShardBuffers, ShardOptimizer
from .records import StepRecords

# Shards with fewer parameter elements than this apply a step on the event loop; a thread hand-off
# costs more than such a step (about 0.2 ms on this machine), and heartbeats are not held up long.
INLINE_APPLY_ELEMENTS = 1 << 20


@dataclass
class Snapshot:
    """A copy of the shard at one version, never changed once taken (a restore copies out of it)."""

    version: int
    params: Tensors
    buffers: Tensors
    optimizer: dict[str, Any]
    time: float
    seconds: float
    applied: frozenset[int] = frozenset()  # async mode: the batch ids applied up to this version


class ShardState:
    def __init__(
        self,
        index: int,
        model: ModelSpec,
        params: Tensors,
        buffers: Tensors,
        optimizer_state: dict[str, Any] | None,
        version: int,
        applied: Sequence[int],
    ) -> None:
        self.index = index
        self._model = model  # builds the optimizer over the shard's parameters
        self.generation = 0
        self.refused = 0  # messages of another generation refused since the shard started
        self.records = StepRecords()
        self.applying = False  # an optimizer step under way (it may be in a thread)
        self.apply_seconds = 0.0
        self.hold: int | None = None  # no step from this one on starts or is applied (`hold_at`)
        # The buffers of the version this shard can step back to (`kept`), as they were then.
        self.kept_buffers: Tensors = {}
        self.applied: set[int] = set(applied)  # batch ids applied here (async mode; a checkpoint's)
        self.snapshot_wanted: int | None = None  # the version the coordinator asked a snapshot of
        self.snapshotting: asyncio.Task[None] | None = None
        # Told of every snapshot taken in the background (`tell_snapshots_to`).
        self._on_snapshot: weakref.WeakMethod[Callable[[Snapshot], None]] | None = None
        self._version_changed: asyncio.Condition | None = None  # made in the event loop, on first use
        self._turn: asyncio.Lock | None = None  # one async apply or copy at a time (made on first use)
        self.load(params, buffers, optimizer_state, version)

    def load(
        self,
        params: Tensors,
        buffers: Tensors,
        optimizer_state: dict[str, Any] | None,
        version: int,
        owned: bool = False,
    ) -> None:
        """Take a shard's state (at the start, or from a peer's replica on promotion) as version
        `version`, with its own snapshot of it. `owned`: the tensors are this shard's alone (a replica just
        received), so they are taken as they are, and the caller copies the snapshot in the background
        (`start_snapshot`; the first apply waits for it); else both are copies."""
        # The parameters live in one flat tensor (`data_server/optimizer.py`); `params` are views of it.
        self.optimizer = ShardOptimizer(self._model, params, owned) if params else None
        self.params = self.optimizer.params if self.optimizer is not None else {}
        # The buffers live in one flat tensor per dtype (`ShardBuffers`); `buffers` are views of them.
        self.buffer_runs = ShardBuffers(buffers, owned)
        self.buffers = self.buffer_runs.tensors
        if optimizer_state and self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer_state, owned)
        # A step small enough is applied on the event loop: a thread hand-off costs more than it does.
        self.apply_inline = sum(p.numel() for p in self.params.values()) < INLINE_APPLY_ELEMENTS
        # The number of steps applied (`version`), and the one this shard can step back to (`kept`): the
        # one before, whole in its other copy since the last commit published that copy (`step_back`).
        self.copies = TwoCopies(version)
        self.snapshots: dict[int, Snapshot] = {}
        if not owned:
            first = self.copy_state()
            self.snapshots[first.version] = first

    @property
    def version(self) -> int:
        return self.copies.version

    @property
    def kept(self) -> int | None:
        return self.copies.kept

    @property
    def stateless(self) -> bool:
        """Holds no parameters and no buffers (`plan_shards` left it none): it only serves batches and
        counts the steps' batch ids, and a compute loop does not wait for its answer to a push."""
        return self.optimizer is None and not self.buffers

    def live(self) -> Tensors:
        """The live parameters and buffers, by name (no copy)."""
        return {**self.params, **self.buffers}

    def check(self, generation: int, what: str) -> None:
        if generation != self.generation:
            self.refused += 1
            raise StaleGenerationError(generation, self.generation, what)

    def check_not_older(self, generation: int, what: str) -> None:
        """For calls a newer generation may make (a resumed job's shards start at 0)."""
        if generation < self.generation:
            self.refused += 1
            raise StaleGenerationError(generation, self.generation, what)

    def held(self, step: int) -> bool:
        """Whether a hand-over's hold (`hold_at`) keeps step `step` from starting or being applied."""
        return self.hold is not None and step >= self.hold

    def turn(self) -> asyncio.Lock:
        """The lock an async apply, and a copy of the live state, take their turn on."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    async def wait_turns(self) -> None:
        """Until the apply or copy under way ends (the ones waiting for their turn are refused after a
        fence: their generation is old then)."""
        if self._turn is not None:
            async with self._turn:
                pass

    # -- applying ----------------------------------------------------------------------------------

    def apply(self, grads: Sequence[Gradient], buffers: list[Tensors]) -> None:
        if self.optimizer is not None:
            self.optimizer.step(grads)
        self.buffer_runs.update(buffers)

    async def run_apply(self, grads: Sequence[Gradient], buffers: list[Tensors]) -> None:
        """One optimizer step with these gradients (in order) and buffers: on the event loop for a small
        shard, else in a thread so heartbeats go on. The caller marks the shard `applying`."""
        began = time.perf_counter()
        self.copies.apply_started()  # (applied in place: nothing to step back to)
        if self.apply_inline:
            self.apply(grads, buffers)
        else:
            await asyncio.to_thread(self.apply, grads, buffers)
        self.apply_seconds += time.perf_counter() - began

    def publish(self, flip: Callable[[], None], buffers: list[Tensors]) -> None:
        """The overlapped step's commit, its buckets all applied into the other copy: `flip` publishes that
        copy (`OtherCopy.flip`), and the buffers are updated as by `apply`. The caller marks the shard
        `applying`."""
        began = time.perf_counter()
        # (The buffers of the version before, a few bytes a layer, for a step back.)
        self.kept_buffers = {n: b.clone() for n, b in self.buffers.items()}
        flip()
        self.buffer_runs.update(buffers)
        self.copies.commit()
        self.apply_seconds += time.perf_counter() - began

    def step_back(self, flip_back: Callable[[], None] | None) -> None:
        """Back to the version before (`kept`): `flip_back` publishes the other copy again, the buffers
        are those of then, the records and snapshots of the step undone go. The caller checked `kept`.
        A shard that holds no state (`flip_back` None) only counts its version back."""
        if flip_back is None:
            if not self.stateless:
                raise FatalError(f"shard {self.index} holds state: it steps back only through its copy")
            self.copies.counted_back()
        else:
            if not self.copies.can_step_back_to(self.version - 1):
                raise FatalError(f"shard {self.index} at {self.version} keeps {self.kept}: no step back")
            flip_back()
            with torch.no_grad():
                for name, b in self.buffers.items():
                    b.copy_(self.kept_buffers[name])
            self.copies.step_back()
        self.kept_buffers = {}
        self.records.drop_from(self.version)
        for version in [v for v in self.snapshots if v > self.version]:
            del self.snapshots[version]

    async def announce_version(self) -> None:
        if self._version_changed is not None:
            async with self._version_changed:
                self._version_changed.notify_all()

    async def wait_for_version(self, generation: int, step: int, wait: float) -> None:
        """Until the shard stands at `step` or later with no apply under way, `wait` seconds at most;
        refused if the generation changed meanwhile."""
        if self._version_changed is None:
            self._version_changed = asyncio.Condition()
        changed = self._version_changed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        async with changed:
            while (self.version < step or self.applying) and self.generation == generation:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        self.check(generation, "pull")

    # -- snapshots ---------------------------------------------------------------------------------

    def copy_state(self) -> Snapshot:
        began = time.perf_counter()
        params = {n: t.detach().clone() for n, t in self.params.items()}
        buffers = {n: t.clone() for n, t in self.buffers.items()}
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else {}
        applied = frozenset(self.applied)
        return Snapshot(
            self.version, params, buffers, optimizer, time.time(), time.perf_counter() - began, applied
        )

    def tell_snapshots_to(self, listener: Callable[[Snapshot], None]) -> None:
        """Hand every snapshot taken in the background to `listener` (a bound method: the replicas copy it
        to the peer). Held weakly: its object holds this state, and a cycle would keep a released data
        server's tensors until a full collection, which may never come (`freeze_startup_objects`)."""
        self._on_snapshot = weakref.WeakMethod(listener)

    def start_snapshot(self) -> None:
        """Copy the shard in the background (started once the waiting pulls have their answer); the next
        apply waits for it (it only reads). One at a time: a second ask while one is being copied (of this
        version: the version moves only once it ended) waits for that one. Two at once, the first to end
        would say none runs, and a commit could re-point the parameters (`OtherCopy.flip`) while the
        second still read them."""
        self.snapshot_wanted = None
        if self.snapshotting is not None and not self.snapshotting.done():
            return

        async def take() -> None:
            snap = await asyncio.to_thread(self.copy_state) if not self.apply_inline else self.copy_state()
            self.snapshots[snap.version] = snap
            if self.snapshotting is task:
                self.snapshotting = None
            listener = self._on_snapshot() if self._on_snapshot is not None else None
            if listener is not None:
                listener(snap)

        task = self.snapshotting = asyncio.ensure_future(take())

    async def snapshot_taken(self) -> None:
        if self.snapshotting is not None:
            await self.snapshotting

    async def restore(self, version: int) -> None:
        """Reload the snapshot of `version`; the records of the steps after it are dropped."""
        await self.snapshot_taken()  # (just promoted: its first snapshot is still being copied)
        snap = self.snapshots.get(version)
        if snap is None:
            held = sorted(self.snapshots)
            raise FatalError(f"shard {self.index} holds no snapshot of version {version} (it holds {held})")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(snap.params[name])
            for name, b in self.buffers.items():
                b.copy_(snap.buffers[name])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(snap.optimizer)
        self.copies.restored(snap.version)
        self.records.drop_from(version)
