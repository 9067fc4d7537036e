"""Data server with its parameter shard (seed 000): a Dask actor on a static worker, one per partition.

Owns, for one job:
- one partition of the training data, read from the job's fsspec URL when the actor starts, served by
  batch id (`get_batch`);
- one shard of the model state (a fixed set of whole parameter and buffer tensors, see `plan_shards`) and
  the optimizer state for those parameters; `pull` serves them, `push` collects the gradients of one
  step, and the push that completes a step **applies** it: the shard is a commit point of its own, with no
  round trip to the coordinator on the step path;
- a record of every step it applied (batch ids, workers, losses), which the coordinator reads off the
  step path to keep the ledger (`status`);
- its snapshots, in memory: the last one every shard holds, and a newer one being taken
  (`snapshot_at`); `restore` reloads one.

Does not own: the generation (the coordinator raises it with `fence`), which snapshot is the committed
one, or what happens when shards disagree (the coordinator decides; see docs/design/commit-point.md).
Called by compute workers over its own connection (`channel.py`: one frame each way per step, carrying
`push`, then `pull` and `get_batch` of the step the worker trains next), and by the coordinator as a Dask
actor (`fence`, `restore`, `snapshot_at`, `status`). Every call carries the generation and a call from
another generation raises `StaleGenerationError` (and is counted), so a message of a worker that was
declared dead can never touch the parameters.

All methods are `async def`: Dask runs them on the worker's event loop, where actor-to-actor calls cannot
deadlock, and the channel's frames are handled on that same loop, so the shard's state is only ever
touched from one thread; the optimizer step of a big shard runs in a thread so heartbeats go on.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import signal
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

import torch

from .allocator import freeze_startup_objects, tune_allocator
from .channel import ChannelAddress, Entry, Frame, ShardLink, ShardServer, error_header, worker_tls
from .dataset import DatasetInfo, load_partition, partition_bounds
from .errors import FatalError, RecoverableError, StaleGenerationError
from .job import ElasticJob
from .messages import ShardStatus, SnapshotInfo, StepRecord, Tensors, direct
from .schedule import Schedule
from .shard_optimizer import Gradient, ShardBuffers, ShardOptimizer

log = logging.getLogger(__name__)

# Shards with fewer parameter elements than this apply a step on the event loop; a thread hand-off
# costs more than such a step (about 0.2 ms on this machine), and heartbeats are not held up long.
INLINE_APPLY_ELEMENTS = 1 << 20


def plan_shards(state: dict[str, torch.Tensor], shards: int, min_bytes: int = 0) -> list[list[str]]:
    """Deal whole tensors to shards, largest first onto the lightest shard (deterministic).

    Whole tensors keep each optimizer state entry on one shard; elementwise optimizers then give the
    same numbers as on the whole model. Ties break on the name so every process computes the same plan.

    Only as many shards as can each hold `min_bytes` of `state` get tensors (at least one; 0: every
    shard): each one that does is on the critical path of every step (`ElasticJob.min_shard_bytes`).
    They are the last ones: the controller places the coordinator beside data server 0, whose process
    then answers the coordinator's calls too.
    """
    total = sum(t.numel() * t.element_size() for t in state.values())
    holders = shards if min_bytes <= 0 else max(1, min(shards, total // min_bytes))
    loads = [0] * shards
    plan: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(state, key=lambda n: (-state[n].numel(), n)):
        target = min(range(shards - holders, shards), key=lambda i: (loads[i], i))
        plan[target].append(name)
        loads[target] += state[name].numel()
    order = {name: i for i, name in enumerate(state)}
    return [sorted(names, key=order.__getitem__) for names in plan]


@dataclass
class _Snapshot:
    version: int
    params: Tensors
    buffers: Tensors
    optimizer: dict[str, Any]
    time: float
    seconds: float
    applied: frozenset[int] = frozenset()  # async mode: the batch ids applied up to this version


@dataclass
class _OpenStep:
    """What the shard holds of the step it has not applied yet."""

    grads: dict[int, Gradient] = field(default_factory=dict)  # batch id -> gradient of this shard's params
    buffers: dict[int, Tensors] = field(default_factory=dict)  # batch id -> buffers after its forward
    losses: dict[int, float] = field(default_factory=dict)
    workers: dict[int, str] = field(default_factory=dict)


class DataServer:
    def __init__(
        self,
        index: int,
        job: ElasticJob,
        dataset: DatasetInfo,
        schedule: Schedule,
        params: Tensors,
        buffers: Tensors,
        optimizer_state: dict[str, Any] | None = None,
        version: int = 0,
        applied: tuple[int, ...] = (),
    ) -> None:
        tune_allocator()  # pulls, pushes and snapshots allocate megabytes every step; see allocator.py
        delay = _plugin_seconds(START_DELAY)
        if delay:
            time.sleep(delay)  # a slowed start (test hook, see local/slow.py; this runs in a task's thread)
        self.index = index
        self.job_id = job.job_id
        self._job = job
        self._schedule = schedule
        start, stop = partition_bounds(dataset.total, schedule.data_servers, index)
        x, y = load_partition(dataset, start, stop)
        self._x = torch.from_numpy(x)
        self._y = torch.from_numpy(y)
        self.generation = 0
        self._open = _OpenStep()
        # A data server that holds no state: pushes of steps after its open one, kept until it gets there
        # (a loop does not wait for such a server's answer, so its pushes can overtake another's).
        self._later: dict[int, _OpenStep] = {}
        self._advancing = False  # `_apply_complete_steps` under way
        self._step_applied: asyncio.Future[None] | None = None  # done when the last `_apply_step` ends
        self._applying = False
        self._records: list[StepRecord] = []
        self._refused = 0
        self._version_changed: asyncio.Condition | None = None  # made in the event loop, on first use
        self._snapshot_wanted: int | None = None  # the version the coordinator asked a snapshot of
        self._snapshotting: asyncio.Task[None] | None = None
        self._hold: int | None = None  # no step from this one on starts or is applied (`hold_at`)
        self._applied: set[int] = set(applied)  # batch ids applied here (async mode; a checkpoint's)
        self._load(params, buffers, optimizer_state, version)
        # Peer replicas (seed 001): every snapshot this shard takes is copied to its peer, shard
        # `(index + 1) % D`, which keeps it in memory; a standby promoted to this role takes it from there.
        # A snapshot counts (is reported to the coordinator) once its copy is whole on the peer.
        self._replicas_on = schedule.data_servers > 1 and job.peer_replicas
        self._peer: Any = None  # the peer's actor handle, once the coordinator names it (`set_peer`)
        # Versions of this shard's snapshots whole on the peer, with when each became whole (wall clock).
        self._replicated: dict[int, float] = {}
        self._replicating: dict[int, asyncio.Task[None]] = {}  # copies to the peer in flight, by version
        self._keep = version  # the snapshot every shard holds (from `snapshot_at`): kept, and its replica
        self._replicas: dict[int, dict[str, Any]] = {}  # version -> a snapshot of shard (index - 1) % D
        self._host = _worker_host()
        self._apply_seconds = 0.0
        self._server: ShardServer | None = None
        # Async mode (seed 002): each micro-batch's gradient is applied as it arrives, once per batch id.
        self._async = job.mode == "async"
        self._apply_lock: asyncio.Lock | None = None  # one apply at a time (async mode; made on first use)
        self._published: tuple[int, Tensors] | None = None  # (version, a copy of the state) for pulls
        freeze_startup_objects()  # see allocator.py: no full collection pauses a step for 0.1 s or more
        log.info(
            "data server %d of job %s: samples [%d, %d), %d params, %d buffers, version %d",
            index,
            self.job_id,
            start,
            stop,
            len(self._params),
            len(self._buffers),
            self.version,
        )

    def _load(
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
        (`_start_snapshot`; the first apply waits for it); else both are copies."""
        # The parameters live in one flat tensor (`shard_optimizer.py`); `_params` are views of it.
        self._optimizer = ShardOptimizer(self._job, params, owned) if params else None
        self._params = self._optimizer.params if self._optimizer is not None else {}
        # The buffers live in one flat tensor per dtype (`ShardBuffers`); `_buffers` are views of them.
        self._buffer_runs = ShardBuffers(buffers, owned)
        self._buffers = self._buffer_runs.tensors
        if optimizer_state and self._optimizer is not None:
            self._optimizer.load_state_dict(optimizer_state, owned)
        # A step small enough is applied on the event loop: a thread hand-off costs more than it does.
        self._apply_inline = sum(p.numel() for p in self._params.values()) < INLINE_APPLY_ELEMENTS
        self.version = version  # number of steps applied
        self._snapshots: dict[int, _Snapshot] = {}
        if not owned:
            first = self._copy_state()
            self._snapshots[first.version] = first

    def _check(self, generation: int, what: str) -> None:
        if generation != self.generation:
            self._refused += 1
            raise StaleGenerationError(generation, self.generation, what)

    # -- compute workers -------------------------------------------------------------------------

    async def open_channel(self) -> ChannelAddress:
        """Start listening for compute loops (`channel.py`) on this worker's host; returns the address."""
        if self._server is None or self._server.address is None:
            server = ShardServer(_weak_handler(self))
            await server.start(self._host, tls=worker_tls("listen"))
            loop = asyncio.get_running_loop()

            def close_later() -> None:
                with contextlib.suppress(RuntimeError):  # the worker's loop is already closed
                    loop.call_soon_threadsafe(server.close)

            # When the actor is released (the job ends, its controller is gone), stop listening.
            weakref.finalize(self, close_later)
            self._server = server
        assert self._server.address is not None
        return self._server.address

    async def phases(self) -> dict[str, float]:
        """Seconds spent on the step path by phase, summed over the run: the channel's `handle` and
        `send`, and `apply` (the optimizer step within `handle`); `frames` counts the frames answered,
        `bodies_shared` and `bodies_socket` the frames with tensors by the way they came (`inbox.py`),
        `params_in_place` the answers whose parameters a loop read in this shard's memory
        (`published.py`)."""
        server = self._server
        return {
            **(server.phases if server is not None else {}),
            "apply": self._apply_seconds,
            "frames": float(server.frames if server is not None else 0),
            "bodies_shared": float(server.bodies["shared"] if server is not None else 0),
            "bodies_socket": float(server.bodies["socket"] if server is not None else 0),
            "params_in_place": float(server.bodies.get("referenced", 0) if server is not None else 0),
        }

    async def close_channel(self) -> None:
        if self._server is not None:
            await self._server.aclose()

    async def on_frame(self, frame: Frame) -> Frame:
        """One frame of a compute loop: a push (gradients, buffers and losses of its share of a step)
        and/or what it needs next (`then`: the parameters of a step, once applied here, and batches that
        live here). A failed push fails the frame; a failed `then` (not ready within its wait, a fence)
        is answered as `next_error`, since the push itself went in."""
        header = frame.header
        generation = int(header["generation"])
        if header["op"] == "apply":
            return await self._on_apply(generation, frame)
        if header["op"] == "current":
            version, state = await self._current_for_answer(generation)
            return Frame(
                {"ok": True, "version": version}, [(Entry("state", -1, n), t) for n, t in state.items()]
            )
        if header["op"] == "replica":
            # A standby taking shard `source`'s role reads the replica's tensors here (`adopt`).
            # Each tensor's place in the outline (`replica_outline`) goes as the entry's batch id.
            _, held = _split_tensors(await self.replica(int(header["source"]), int(header["version"])))
            return Frame({"ok": True}, [(Entry("replica", place, ""), t) for place, t in held], True)
        if header["op"] == "push":
            grads: dict[int, Gradient] = {}
            buffers: dict[int, Tensors] = {}
            for entry, tensor in frame.tensors:
                if entry.kind == "grads":  # packed: one flat run over the parameters `order` names
                    grads[entry.batch_id] = self._packed(header.get("order") or [], tensor)
                    continue
                target: dict[int, Any] = grads if entry.kind == "grad" else buffers
                target.setdefault(entry.batch_id, {})[entry.name] = tensor
            losses = {int(b): float(v) for b, v in header["losses"].items()}
            await self.push(generation, int(header["step"]), str(header["worker"]), grads, buffers, losses)
        then = header.get("then")
        if then is None:
            return Frame({"ok": True})
        answer: dict[str, Any] = {"ok": True}
        tensors: list[tuple[Entry, torch.Tensor]] = []
        try:
            if then.get("step") is not None:
                state = await self.pull(generation, int(then["step"]), float(then["wait"]))
                optimizer = self._optimizer
                if optimizer is not None and optimizer.flat is not None:
                    # The parameters as the one flat tensor they live in, named in the header: one tensor
                    # to encode instead of one per parameter (the loop takes views of it, of this shard's
                    # own memory where it reads them in place, unless it asks for a copy: `fetch`).
                    answer["params"] = optimizer.names
                    flat = optimizer.flat.clone() if then.get("copy") else optimizer.flat
                    tensors = [(Entry("params", -1, ""), flat)]
                    state = self._buffers
                    runs = self._buffer_runs.runs
                    if runs:
                        # Likewise the buffers: one flat tensor per dtype, their names in the header.
                        answer["buffers"] = [names for names, _ in runs]
                        tensors += [(Entry("buffers", k, ""), run) for k, (_, run) in enumerate(runs)]
                        state = {}
                tensors += [(Entry("state", -1, name), t) for name, t in state.items()]
            for b in then["batches"]:
                x, y = await self.get_batch(generation, int(b))
                tensors += [(Entry("x", int(b), ""), x), (Entry("y", int(b), ""), y)]
        except Exception as exc:
            return Frame({"ok": True, "next_error": error_header(exc)})
        return Frame(answer, tensors)

    def _packed(self, order: list[str], flat: torch.Tensor) -> Gradient:
        if self._optimizer is None:
            raise FatalError(f"a packed gradient for data server {self.index}, which holds no parameters")
        return self._optimizer.packed(order, flat)

    async def _on_apply(self, generation: int, frame: Frame) -> Frame:
        """Async mode: one micro-batch's gradient (with the version of this shard it was computed on),
        applied at once; the answer says what became of it and, if asked (`then`), carries the
        parameters as they are after it and the batches asked for."""
        header = frame.header
        grads: Tensors = {}
        buffers: Tensors = {}
        for entry, tensor in frame.tensors:
            (grads if entry.kind == "grad" else buffers)[entry.name] = tensor
        outcome, staleness = await self.apply_one(
            generation,
            str(header["worker"]),
            int(header["batch_id"]),
            int(header["computed_on"]),
            grads,
            buffers,
            float(header["loss"]),
        )
        answer = {"ok": True, "outcome": outcome, "staleness": staleness}
        then = header.get("then") or {}
        tensors: list[tuple[Entry, torch.Tensor]] = []
        if then.get("state"):
            version, state = await self._current_for_answer(generation)
            answer["version"] = version
            tensors = [(Entry("state", -1, name), t) for name, t in state.items()]
        return Frame(answer, tensors)

    async def apply_one(
        self,
        generation: int,
        worker: str,
        batch_id: int,
        computed_on: int,
        grads: Tensors,
        buffers: Tensors,
        loss: float,
    ) -> tuple[str, int]:
        """Async mode: apply the gradient of one micro-batch now, unless this shard applied that batch id
        already ("duplicate": its worker died after pushing here, and the batch was trained again) or the
        parameters it was computed on are more than `max_staleness` versions old ("stale": the worker
        trains it again on fresh parameters). Returns the outcome and the staleness."""
        self._check(generation, "apply")
        if not self._async:
            raise FatalError(f"shard {self.index} got an async gradient in a sync job")
        if not 0 <= batch_id < self._schedule.total_batches or computed_on < 0:
            raise FatalError(f"gradient of batch {batch_id} computed on version {computed_on}")
        if self._apply_lock is None:
            self._apply_lock = asyncio.Lock()
        async with self._apply_lock:
            self._check(generation, "apply")  # a fence may have come while this one waited its turn
            delay = _plugin_seconds(SHARD_DELAY)
            if delay:
                await asyncio.sleep(delay)  # a slowed shard (test hook, see local/slow.py)
                self._check(generation, "apply")
            staleness = self.version - computed_on
            if batch_id in self._applied:
                return "duplicate", staleness
            if staleness > self._job.max_staleness or staleness < 0:
                # (Counted by the loops, as `stale_refusals`; `_refused` counts messages of old generations.)
                return "stale", staleness
            if self._hold is not None and self.version >= self._hold:
                raise RecoverableError(f"shard {self.index} holds at version {self._hold}")
            if staleness > 1:
                # Staleness-aware step (Zhang et al., 2016): a gradient computed `staleness` versions ago
                # counts 1/staleness. With several workers pushing, plain async SGD with momentum diverges
                # (a transformer, 4 workers, staleness 5 to 8: the loss went from 1.4 to 1e9).
                grads = {n: g.div_(staleness) for n, g in grads.items()}
            self._applying = True
            try:
                began = time.perf_counter()
                if self._apply_inline:
                    self._apply([grads], [buffers])
                else:
                    await asyncio.to_thread(self._apply, [grads], [buffers])
                self._apply_seconds += time.perf_counter() - began
            finally:
                self._applying = False
            self._applied.add(batch_id)
            self._records.append(
                StepRecord(
                    self.version,
                    self.generation,
                    (batch_id,),
                    {batch_id: worker},
                    {batch_id: loss},
                    time.time(),
                    computed_on,
                    staleness,
                )
            )
            self.version += 1
            self._published = None
        await self._announce_version()
        return "applied", staleness

    async def _current_for_answer(self, generation: int) -> tuple[int, Tensors]:
        """`current`, for a frame's answer: without a copy where every apply runs on this event loop
        (`_apply_inline`). No apply can then change the tensors between here and the answer's write, and
        `ShardServer` sends an answer's bytes, or copies them, before it awaits anything. (The mlp's
        2.7 MB copy per apply cost the compute worker beside it more than the copy itself: memory
        bandwidth on a shared machine.)"""
        if not self._apply_inline:
            return await self.current(generation)
        self._check(generation, "pull")
        return self.version, {**self._params, **self._buffers}

    async def current(self, generation: int) -> tuple[int, Tensors]:
        """Async mode: the version and a copy of the parameters and buffers as they are now. A copy, made
        once per version: an apply may change the live tensors while the answer is still being sent."""
        self._check(generation, "pull")
        published = self._published
        if published is None or published[0] != self.version:
            if self._apply_lock is None:
                self._apply_lock = asyncio.Lock()
            async with self._apply_lock:
                state = {n: t.detach().clone() for n, t in {**self._params, **self._buffers}.items()}
                published = self._published = (self.version, state)
        return published

    async def get_batch(self, generation: int, batch_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(generation, "get_batch")
        if self._schedule.server_of(batch_id) != self.index:
            raise FatalError(f"batch {batch_id} lives on data server {self._schedule.server_of(batch_id)}")
        idx = torch.tensor(self._schedule.sample_indices(batch_id))  # (a copy: the order is read-only)
        return self._x[idx], self._y[idx]

    async def pull(self, generation: int, step: int, wait: float = 0.0) -> Tensors:
        """The shard's parameters and buffers as of `step` (before it is applied).

        A worker asks for the next step's parameters right after pushing this step's gradients; the call
        waits (up to `wait` seconds) until the shard has applied the step before, so the answer leaves the
        moment the parameters exist. It fails when the generation changes or the wait runs out.
        """
        self._check(generation, "pull")
        if (self.version < step or self._applying) and not self._held(step):
            await self._wait_for_version(generation, step, wait)
        if self._held(step):  # (also a hold that came while this pull waited)
            raise RecoverableError(f"shard {self.index} holds at step {self._hold} (a static worker retires)")
        if self._applying or self.version != step:
            raise RecoverableError(f"pull for step {step}, but shard {self.index} is at step {self.version}")
        # No copy: the tensors are serialized as this reply is sent, or read in place by a loop on this
        # machine while it computes (`published.py`). The shard changes them only when it applies this
        # step, which needs the gradient of every worker that computes with them (a worker computes a
        # step only when its share of it is not empty, and is done with them before its push). A reply
        # still on the wire to a worker declared dead, or a loop of that worker reading in place, may see
        # a restore; that worker's generation is refused anyway.
        return {**self._params, **self._buffers}

    async def _wait_for_version(self, generation: int, step: int, wait: float) -> None:
        if self._version_changed is None:
            self._version_changed = asyncio.Condition()
        changed = self._version_changed
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        async with changed:
            while (self.version < step or self._applying) and self.generation == generation:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        self._check(generation, "pull")

    async def _announce_version(self) -> None:
        if self._version_changed is not None:
            async with self._version_changed:
                self._version_changed.notify_all()

    async def push(
        self,
        generation: int,
        step: int,
        worker: str,
        grads: dict[int, Gradient],
        buffers: dict[int, Tensors],
        losses: dict[int, float],
    ) -> None:
        """The gradients (of this shard's parameters), updated buffers and losses of the batch ids in
        `losses`; the push that completes step `step` applies it."""
        self._check(generation, "push")
        if step < self.version or (step == self.version and self._applying):
            raise RecoverableError(f"push for step {step}, but shard {self.index} is at step {self.version}")
        if step > self.version and not self.stateless:
            # (Cannot happen: a loop pushes a step only with its parameters, pulled from every shard
            # that holds state once it got there.)
            raise RecoverableError(f"push for step {step}, but shard {self.index} is at step {self.version}")
        opened = self._open if step == self.version else self._later.setdefault(step, _OpenStep())
        for batch_id in losses:
            if self._schedule.step_of(batch_id) != step:
                raise FatalError(f"gradient of batch {batch_id} pushed for step {step}")
            opened.grads[batch_id] = grads.get(batch_id, {})
            opened.buffers[batch_id] = buffers.get(batch_id, {})
            opened.losses[batch_id] = losses[batch_id]
            opened.workers[batch_id] = worker
        await self._apply_complete_steps()

    @property
    def stateless(self) -> bool:
        """Holds no parameters and no buffers (`plan_shards` left it none): it only serves batches and
        counts the steps' batch ids, and a compute loop does not wait for its answer to a push."""
        return self._optimizer is None and not self._buffers

    async def _apply_complete_steps(self) -> None:
        """Apply the open step if every gradient of it is here and no hold keeps it; then the next one,
        from the pushes kept for later (`_later`), as far as they go."""
        if self._advancing:
            return  # the call under way checks again after each step it applies
        self._advancing = True
        try:
            # One at a time: a push that completes the next step while `_apply_step` awaits (its version
            # announced, a snapshot due) leaves the apply to this loop, so each step's own ends run first.
            while not self._applying and self._open_step_complete() and not self._held(self.version):
                await self._apply_step(self.version)
        finally:
            self._advancing = False

    def _open_step_complete(self) -> bool:
        step = self.version
        return (
            step < self._schedule.total_steps
            and bool(self._open.grads)
            and len(self._open.grads) == len(self._schedule.step_batches(step))
        )

    def _held(self, step: int) -> bool:
        """Whether a hand-over's hold (`hold_at`) keeps step `step` from starting or being applied."""
        return self._hold is not None and step >= self._hold

    async def _apply_step(self, step: int) -> None:
        opened, self._open = self._open, _OpenStep()
        ordered = sorted(opened.grads)
        grads = [opened.grads[b] for b in ordered]
        buffers = [opened.buffers[b] for b in ordered]
        self._applying = True
        done = self._step_applied = asyncio.get_running_loop().create_future()
        try:
            if self._snapshotting is not None:
                await self._snapshotting  # a snapshot of this version still reads the tensors
            began = time.perf_counter()
            if self._apply_inline:
                self._apply(grads, buffers)
            else:
                await asyncio.to_thread(self._apply, grads, buffers)
            self._apply_seconds += time.perf_counter() - began
        finally:
            self._applying = False
            done.set_result(None)
        self.version += 1
        # (Before any await: a push of the new step may come in at the next one.)
        self._open = self._later.pop(self.version, self._open)
        self._records.append(
            StepRecord(
                step, self.generation, tuple(ordered), dict(opened.workers), dict(opened.losses), time.time()
            )
        )
        await self._announce_version()
        if self._snapshot_wanted == self.version:
            self._start_snapshot()

    def _apply(self, grads: Sequence[Gradient], buffers: list[Tensors]) -> None:
        # Summed in batch-id order whatever order they arrived in: this is what makes the result bitwise
        # independent of which worker computed which micro-batch.
        if self._optimizer is not None:
            self._optimizer.step(grads)
        self._buffer_runs.update(buffers)

    # -- the coordinator -------------------------------------------------------------------------

    async def status(self, since: int, keep_from: int = 0, generation: int | None = None) -> ShardStatus:
        """Where the shard is, with the records of the steps it applied from step `since` on. The records
        of steps before `keep_from` are dropped if the caller is of this shard's generation: the
        controller's copy of the record holds those steps (`CoordinatorState.records_kept_from`), and a
        long run would otherwise keep one per step. A coordinator of an older generation (one the
        scheduler dropped while its process went on, and rebuilt elsewhere) may still read the shards:
        its `keep_from` is not the new coordinator's, which may be training those steps again."""
        # (By key, not over a list of every step: the coordinator asks up to 20 times a second.)
        if keep_from > 0 and generation == self.generation:
            del self._records[: bisect.bisect_left(self._records, keep_from, key=attrgetter("step"))]
        first = bisect.bisect_left(self._records, since, key=attrgetter("step"))
        return ShardStatus(
            index=self.index,
            generation=self.generation,
            version=self.version,
            records=tuple(self._records[first:]),
            snapshots=tuple(
                SnapshotInfo(s.version, s.time, s.seconds, self._replicated.get(s.version, 0.0))
                for s in self._snapshots.values()
                if s.version in self._replicated or not self._replicas_on
            ),
            pending=len(self._open.grads),
            refused=self._refused,
            replicas=tuple(sorted(self._replicas)),
            stateless=self.stateless,
        )

    async def hold_at(self, generation: int, version: int, wait: float) -> int:
        """Apply no step from step `version` on and serve none of its parameters, and wait (up to `wait`
        seconds) until the steps before it are applied here. Pushes are still taken, held steps kept
        unapplied: a hold that reaches one shard after it applied a step and another before leaves them
        a version apart, and the coordinator then holds every shard at the newer version, which the other
        reaches from the pushes it kept (the shards take the same pushes: a worker pushes a step only with
        the parameters of that step from every shard). Shards held at one version stay there until the
        fence, which finds them equal, so nothing is undone (a hand-over). Returns the version reached; the
        next fence lifts the hold."""
        self._check(generation, "hold")
        delay = _plugin_seconds(HAND_OVER_DELAY)
        if delay:
            await asyncio.sleep(delay)  # a slowed hand-over (test hook, see local/slow.py)
            self._check(generation, "hold")  # a fence may have come meanwhile
        self._hold = version
        if self.version < version:
            await self._apply_complete_steps()  # kept by a lower hold, which this one lifts
        if self.version < version:
            with contextlib.suppress(RecoverableError, StaleGenerationError):
                await self._wait_for_version(generation, version, wait)
        return self.version

    async def fence(self, generation: int, since: int = 0, applied_from: int | None = None) -> ShardStatus:
        """Enter `generation`: refuse every older message from now on, drop the gradients of the open
        step and any snapshot asked for; returns where the shard is, with the records from step `since`
        on (the coordinator asks from the steps it has not committed: a long run holds a record per
        step, 7.7 MB and half a second of pickling for 50,000 of them, on the path of every recovery).
        Async mode, with `applied_from` (a rebuilt coordinator): also every batch id applied from that
        id on (`ShardStatus.applied`), recorded or not."""
        if generation < self.generation:
            raise StaleGenerationError(generation, self.generation, "fence")
        if _plugin_seconds(FENCE_DEATH):
            # A standby that dies in the middle of its promotion, whose first call is this fence (test hook,
            # see local/slow.py): the worker's process group, its nanny with it, as `kill_worker` does.
            os.killpg(os.getpgrp(), signal.SIGKILL)
        self.generation = generation
        self._hold = None
        if self._apply_lock is not None:
            # Async mode: an apply under way ends before the answer says where the shard stands; the ones
            # waiting for the lock are refused (their generation is old now).
            async with self._apply_lock:
                pass
        if self._step_applied is not None:
            # Sync mode: a step being applied in a thread (a shard too big to apply on the event loop)
            # ends before the answer says where the shard stands; else a restore would copy the snapshot
            # into tensors the thread is still changing, and the version would move after the answer.
            await asyncio.shield(self._step_applied)
        pending = len(self._open.grads)
        self._open = _OpenStep()
        self._later.clear()
        self._snapshot_wanted = None
        if self._snapshotting is not None:
            await self._snapshotting
        await self._announce_version()
        status = await self.status(since)
        if applied_from is not None and self._async:
            # (Async commits run close to the lowest open id: few ids lie above it.)
            status = replace(status, applied=tuple(sorted(b for b in self._applied if b >= applied_from)))
        return replace(status, pending=pending)

    async def restore(self, generation: int, version: int) -> int:
        """Reload the snapshot of `version`; the records of the steps after it are dropped."""
        self._check(generation, "restore")
        if self._snapshotting is not None:
            await self._snapshotting  # (just promoted: its first snapshot is still being copied)
        snap = self._snapshots.get(version)
        if snap is None:
            held = sorted(self._snapshots)
            raise FatalError(f"shard {self.index} holds no snapshot of version {version} (it holds {held})")
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(snap.params[name])
            for name, b in self._buffers.items():
                b.copy_(snap.buffers[name])
        if self._optimizer is not None:
            self._optimizer.load_state_dict(snap.optimizer)
        self.version = snap.version
        self._records = [r for r in self._records if r.step < version]
        self._open = _OpenStep()
        self._later.clear()
        await self._announce_version()
        return self.version

    async def snapshot_at(self, generation: int, version: int, keep: int) -> ShardStatus:
        """Take a snapshot of `version`: now if the shard is there, else right after it applies the step
        before. Snapshots other than `keep` (the last one every shard holds) are dropped. A shard already
        past `version` does not take it; the coordinator asks again later."""
        self._check(generation, "snapshot")
        self._keep = keep
        for v in [v for v in self._snapshots if v not in (keep, version)]:
            del self._snapshots[v]
        self._replicated = {v: t for v, t in self._replicated.items() if v in self._snapshots}
        self._prune_replicas()
        self._snapshot_wanted = version
        if self.version == version and not self._applying and version not in self._snapshots:
            self._start_snapshot()
        if self._snapshotting is not None and self.version == version:
            await self._snapshotting
        if (
            self._replicas_on
            and version in self._snapshots
            and version not in self._replicated
            and version not in self._replicating
        ):
            # Taken, but its copy was refused: it was started in the generation a fence just ended (the
            # step before the fence asked for it), and the peer, fenced too, refused that generation.
            self._replicate(self._snapshots[version])
        copying = self._replicating.get(version)
        if copying is not None and self.version == version:
            # The shard stands at this version (the job waits or ends): answer once the copy is whole, so
            # that the snapshot counts at once. A running shard's copy is reported by a later status.
            await asyncio.shield(copying)
        return await self.status(self.version)

    def _start_snapshot(self) -> None:
        # Started once the waiting pulls have their answer; the next apply waits for it (it only reads).
        self._snapshot_wanted = None

        async def take() -> None:
            snap = await asyncio.to_thread(self._copy_state) if not self._apply_inline else self._copy_state()
            self._snapshots[snap.version] = snap
            self._snapshotting = None
            self._replicate(snap)

        self._snapshotting = asyncio.ensure_future(take())

    # -- peer replicas (seed 001) ------------------------------------------------------------------

    async def set_peer(self, generation: int, peer: Any) -> None:
        """Copy this shard's snapshots to `peer` from now on (the coordinator names it at the start and
        after a promotion); the snapshots held now are copied at once, since the old peer's copies may
        be gone with it."""
        if generation < self.generation:  # a newer one is fine: a resumed job's shards start at 0
            self._refused += 1
            raise StaleGenerationError(generation, self.generation, "set_peer")
        if not self._replicas_on:
            return
        self._peer = direct(peer)
        self._replicated.clear()
        for snap in list(self._snapshots.values()):
            self._replicate(snap)

    def _replicate(self, snap: _Snapshot) -> None:
        """Send `snap` to the peer in the background: the step path never waits for it, and the snapshot
        is reported (can become the one a rollback or a promotion goes back to) only once it is whole
        there."""
        peer = self._peer
        if peer is None:
            return
        generation = self.generation

        async def send() -> None:
            try:
                await peer.hold_replica(generation, self.index, _replica_of(snap))
            except Exception as exc:
                # The peer is gone or was fenced: the snapshot is not reported, and the next one (or the
                # peer named after a promotion) is copied instead.
                log.warning(
                    "shard %d: copy of snapshot %d to its peer failed: %s", self.index, snap.version, exc
                )
                return
            if self._peer is peer and snap.version in self._snapshots:
                self._replicated[snap.version] = time.time()

        task = asyncio.ensure_future(send())
        self._replicating[snap.version] = task

        def done(_: asyncio.Task[None], version: int = snap.version) -> None:
            if self._replicating.get(version) is task:
                del self._replicating[version]

        task.add_done_callback(done)

    async def hold_replica(self, generation: int, source: int, replica: dict[str, Any]) -> None:
        """Keep a copy of shard `source`'s snapshot, whole (it is stored only once all of it arrived)."""
        if generation < self.generation:
            self._refused += 1
            raise StaleGenerationError(generation, self.generation, "hold_replica")
        if source != (self.index - 1) % self._schedule.data_servers:
            raise FatalError(f"shard {self.index} got a replica of shard {source}, which is not its peer's")
        self._replicas[int(replica["version"])] = replica
        self._prune_replicas()

    def _prune_replicas(self) -> None:
        # The snapshot every shard holds (the one a promotion goes back to) and the two newest: the peer
        # may learn of a newer `keep` after the copy of the next snapshot arrived.
        if self._async:
            # (Async mode: every shard snapshots at its own version, so the source's versions and this
            # shard's `keep` are not comparable; the newest two are kept.)
            for v in sorted(self._replicas)[:-2]:
                del self._replicas[v]
            return
        newest = sorted(v for v in self._replicas if v > self._keep)[-2:]
        for v in [v for v in self._replicas if v != self._keep and v not in newest]:
            del self._replicas[v]

    async def replica(self, source: int, version: int) -> dict[str, Any]:
        """The copy of shard `source`'s snapshot of `version`, for the standby that takes its role."""
        held = self._replicas.get(version)
        if held is None:
            raise FatalError(
                f"shard {self.index} holds no replica of shard {source} at version {version} "
                f"(it holds {sorted(self._replicas)})"
            )
        return held

    async def replica_outline(self, source: int, version: int) -> Any:
        """The replica of shard `source`'s snapshot of `version` with its tensors left out (`_split_tensors`:
        their places numbered); the tensors come over the channel, op `replica`."""
        return _split_tensors(await self.replica(source, version))[0]

    async def adopt(self, peer: Any, version: int) -> int:
        """Take this shard's state from the replica its peer holds (a promotion: this data server starts
        empty on a standby, with its data partition only). Returns the version taken.

        The tensors come over the peer's channel (one frame, written from the replica's own memory into
        one buffer here), the rest of the replica (names, the optimizer's settings) through Dask. A 200 MB
        shard takes 0.03 to 0.04 s this way against 0.09 s in one Dask actor call, and its tensors lie back
        to back, so that the optimizer takes them as they came (SGD's momentum: no 0.035 s copy)."""
        began = time.perf_counter()
        address, outline = await asyncio.gather(
            peer.open_channel(), peer.replica_outline(self.index, version)
        )
        ask = Frame(
            {"op": "replica", "generation": self.generation, "source": self.index, "version": version}
        )
        timeout = self._job.call_timeout

        def fetch() -> Frame:
            link = ShardLink(address, timeout, worker_tls("connect"))
            try:
                link.send(ask)
                # (A one-off buffer of the whole replica: no wait for the kernel to compact memory into
                # huge pages, which a fresh process's first 200 MB can take 0.4 s for.)
                return link.receive(timeout, huge_pages=False)
            finally:
                link.close()

        frame = await asyncio.to_thread(fetch)
        replica = _join_tensors(outline, {entry.batch_id: t for entry, t in frame.tensors})
        copied = time.perf_counter() - began
        # The replica arrived as tensors of this process alone: they become the live state as they are, and
        # the snapshot of their version is copied from them in the background, while the promotion goes on
        # (a 200 MB shard: 0.2 s of copies off the promotion's path); the first step waits for it.
        self._load(replica["params"], replica["buffers"], replica["optimizer"], int(replica["version"]), True)
        self._applied = set(replica.get("applied", ()))  # async mode: the applies the snapshot holds
        self._published = None
        self._start_snapshot()
        self._records = []
        self._open = _OpenStep()
        self._later.clear()
        self._replicated.clear()
        self._keep = self.version
        log.info(
            "data server %d of job %s: took version %d from its peer (copy %.3f s, load %.3f s)",
            self.index, self.job_id, self.version, copied, time.perf_counter() - began - copied,
        )  # fmt: skip
        return self.version

    async def applied_ids(self) -> list[int]:
        """Async mode: the batch ids applied here (a promoted shard's, from its snapshot)."""
        return sorted(self._applied)

    # -- the controller ----------------------------------------------------------------------------

    async def export_snapshot(self, version: int) -> dict[str, Any]:
        """The snapshot of `version`, for a persistent checkpoint."""
        snap = self._snapshots.get(version)
        if snap is None:
            raise FatalError(f"shard {self.index} holds no snapshot of version {version}")
        return {
            "version": snap.version,
            "tensors": {**snap.params, **snap.buffers},
            "optimizer": snap.optimizer,
            "applied": sorted(snap.applied),
        }

    async def state(self) -> Tensors:
        return {n: t.detach().clone() for n, t in {**self._params, **self._buffers}.items()}

    async def describe(self) -> dict[str, Any]:
        def nbytes(ts: Tensors) -> int:
            return sum(t.numel() * t.element_size() for t in ts.values())

        return {
            "index": self.index,
            "generation": self.generation,
            "version": self.version,
            "snapshot_versions": sorted(self._snapshots),
            "samples": len(self._y),
            "data_bytes": self._x.numel() * self._x.element_size() + self._y.numel() * self._y.element_size(),
            "param_bytes": nbytes(self._params) + nbytes(self._buffers),
        }

    def _copy_state(self) -> _Snapshot:
        began = time.perf_counter()
        params = {n: t.detach().clone() for n, t in self._params.items()}
        buffers = {n: t.clone() for n, t in self._buffers.items()}
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else {}
        applied = frozenset(self._applied)
        return _Snapshot(
            self.version, params, buffers, optimizer, time.time(), time.perf_counter() - began, applied
        )


def warm_standby(job: ElasticJob) -> None:
    """Runs on a standby static worker, once: pay what a data server's first start pays in a fresh
    process (building the job's optimizer the first time imports half of torch: about 1 s here) before it
    is promoted, not while training waits for it."""
    tune_allocator()
    job.initial_model()
    job.build_optimizer([torch.zeros(1, requires_grad=True)])
    freeze_startup_objects()


def _replica_of(snap: _Snapshot) -> dict[str, Any]:
    # The snapshot's own tensors, not copies: a snapshot is never changed once taken (a restore copies
    # out of it), and the peer keeps what it was sent.
    return {
        "version": snap.version,
        "params": snap.params,
        "buffers": snap.buffers,
        "optimizer": snap.optimizer,
        "applied": sorted(snap.applied),  # async mode: what a standby taking it has applied
    }


@dataclass(frozen=True)
class _TensorPlace:
    """Where a tensor stood in a structure sent without its tensors (`_split_tensors`)."""

    index: int


def _split_tensors(value: Any) -> tuple[Any, list[tuple[int, torch.Tensor]]]:
    """`value` (dicts, lists and tuples of tensors and plain values: a replica) with every tensor replaced
    by its place (its number in the walk), and the tensors with their places, in the order to send them.

    That order is the walk's, except for an optimizer's per-parameter state (`["optimizer"]["state"][i]
    [key]`), which goes key by key: every parameter's `exp_avg`, then every `exp_avg_sq`. Each then lies
    back to back in the frame, in the parameters' order, as the parameters themselves do, and a shard takes
    each as one flat run without a copy (`ShardOptimizer.load_state_dict`)."""
    found: list[tuple[tuple[Any, ...], torch.Tensor]] = []

    def replace(v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            found.append((path, v))
            return _TensorPlace(len(found) - 1)
        if isinstance(v, dict):
            return {k: replace(x, (*path, k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return _same_kind(v, [replace(x, (*path, k)) for k, x in enumerate(v)])
        return v

    def rank(place: int) -> tuple[int, str, int]:
        path = found[place][0]
        if len(path) == 4 and path[:2] == ("optimizer", "state"):
            return (1, str(path[3]), place)
        return (0, "", place)

    outline = replace(value, ())
    return outline, [(place, found[place][1]) for place in sorted(range(len(found)), key=rank)]


def _join_tensors(outline: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of `_split_tensors`: `tensors` by their places."""
    if isinstance(outline, _TensorPlace):
        return tensors[outline.index]
    if isinstance(outline, dict):
        return {k: _join_tensors(x, tensors) for k, x in outline.items()}
    if isinstance(outline, (list, tuple)):
        return _same_kind(outline, [_join_tensors(x, tensors) for x in outline])
    return outline


def _same_kind(like: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a named tuple takes its fields one by one
        return type(like)(*items)
    return type(like)(items)


SHARD_DELAY = "prefect-elastic-shard-delay"
HAND_OVER_DELAY = "prefect-elastic-hand-over-delay"
START_DELAY = "prefect-elastic-start-delay"
FENCE_DEATH = "prefect-elastic-fence-death"


def _plugin_seconds(name: str) -> float:
    """The test hooks' delays (`prefect_elastic.local.slow`): the `seconds` of the worker plugin named
    `name` where this worker has one (`SHARD_DELAY`: before each async apply; `HAND_OVER_DELAY`: in a
    hand-over's `hold_at`; `START_DELAY`: as a data server starts; `FENCE_DEATH`, non-zero: the worker
    dies at a data server's fence); 0 elsewhere."""
    try:
        from distributed import get_worker

        plugin = get_worker().plugins.get(name)
    except Exception:
        return 0.0  # made outside a worker (unit tests)
    return float(getattr(plugin, "seconds", 0.0)) if plugin is not None else 0.0


def _worker_host() -> str:
    """The host this shard's Dask worker listens on: compute loops reach it there as they reach Dask."""
    try:
        from distributed import get_worker
        from distributed.comm import get_address_host

        return str(get_address_host(get_worker().address))
    except Exception:
        return "127.0.0.1"  # made outside a worker (unit tests)


def _weak_handler(server: DataServer) -> Any:
    """The shard's frame handler without a strong reference: the listener must not keep a released actor
    (and its data partition) alive."""
    ref = weakref.ref(server)

    async def handle(frame: Frame) -> Frame:
        target = ref()
        if target is None:
            raise ConnectionError("this data server was released")
        return await target.on_frame(frame)

    return handle
