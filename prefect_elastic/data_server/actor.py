"""The data server: a Dask actor on a static worker, one per data partition, with its parameter shard.

Owns, for one job:
- one partition of the training data, read from the job's fsspec URL when the actor starts, served by
  batch id (`get_batch`);
- one shard of the model state (a fixed set of parameter and buffer tensors, whole or a contiguous range
  of a tensor split across data servers held as a flat tensor under its name, see `plan_pieces`) and
  the optimizer state for those parameters (`state.py`), applied in the job's mode (`apply.py`): the shard
  is a commit point of its own, with no round trip to the coordinator on the step path;
- a record of every step it applied (batch ids, workers, losses), which the coordinator reads off the
  step path to keep the ledger (`status`);
- its snapshots, in memory: the last one every shard holds, and a newer one being taken
  (`snapshot_at`); `restore` reloads one; each is copied to the peer shard (`replicas.py`).

Does not own: the generation (the coordinator raises it with `fence`), which snapshot is the committed
one, or what happens when shards disagree (the coordinator decides; see docs/design/commit-point.md).
Called by compute workers over its own connection (`wire/channel.py`: one frame each way per step, carrying
`push`, then `pull` and `get_batch` of the step the worker trains next), and by the coordinator as a Dask
actor (`fence`, `restore`, `snapshot_at`, `status`). Every call carries the generation and a call from
another generation raises `StaleGenerationError` (and is counted), so a message of a worker that was
declared dead can never touch the parameters. This class receives the calls and hands them on.

All methods are `async def`: Dask runs them on the worker's event loop, where actor-to-actor calls cannot
deadlock, and the channel's frames are handled on that same loop, so the shard's state is only ever
touched from one thread; the optimizer step of a big shard runs in a thread so heartbeats go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..allocator import freeze_startup_objects, tune_allocator
from ..data.batches import BatchSpec
from ..data.fields import Batch
from ..errors import FatalError
from ..job import ShardSpec
from ..messages import ShardStatus, SnapshotInfo, Tensors
from ..schedule import Schedule
from ..wire import Apply, ChannelAddress, Frame, Push, ShardServer, worker_tls
from ..wire.signals import RecoverableError, StaleGenerationError
from .frames import ShardFrames
from .hooks import hooks_of_this_worker
from .optimizer import Gradient, ShardOptimizer
from .partition import Partition
from .replicas import Replicas, fetch_replica, split_tensors
from .state import ShardState
from .step_applies import ApplyMode

log = logging.getLogger(__name__)


class DataServer:
    def __init__(
        self,
        index: int,
        spec: ShardSpec,
        dataset: BatchSpec,
        schedule: Schedule,
        params: Tensors,
        buffers: Tensors,
        optimizer_state: dict[str, Any] | None = None,
        version: int = 0,
        applied: Sequence[int] = (),
        mode: ApplyMode | None = None,
    ) -> None:
        """`spec`: the job's settings a data server reads; `mode`: how the shard applies (`SyncApplies` or
        `AsyncApplies`, the job's mode's: `modes.py`)."""
        began = time.perf_counter()
        tune_allocator()  # pulls, pushes and snapshots allocate megabytes every step; see allocator.py
        self._hooks = hooks_of_this_worker()
        self._hooks.on_start()  # (this runs in a task's thread)
        self.index = index
        self.job_id = spec.job_id
        self._spec = spec
        self._schedule = schedule
        self.shard = ShardState(index, spec.model_spec, params, buffers, optimizer_state, version, applied)
        self.partition = Partition(index, dataset, self.shard)
        if mode is None:
            raise TypeError("DataServer needs the apply of the job's mode (mode=, see prefect_elastic.modes)")
        self.applies = mode(self.shard, schedule, self._hooks, spec.max_staleness)
        self.replicas = Replicas(self.shard, self.applies, schedule.data_servers, spec.peer_replicas)
        # (None of these holds the actor: released, it is freed at once, and stops listening.)
        self._frames = ShardFrames(self.shard, self.applies, self.replicas, self.partition.get_batch)
        self._host = _worker_host()
        self._server: ShardServer | None = None
        freeze_startup_objects()  # see allocator.py: no full collection pauses a step for 0.1 s or more
        log.info(
            "data server %d of job %s: samples [%d, %d), %d params, %d buffers, version %d; %.3f s to start",
            index, self.job_id, self.partition.start, self.partition.stop, len(self.shard.params),
            len(self.shard.buffers), self.version, time.perf_counter() - began,
        )  # fmt: skip

    @property
    def version(self) -> int:
        """The number of steps applied."""
        return self.shard.version

    @property
    def generation(self) -> int:
        return self.shard.generation

    @property
    def stateless(self) -> bool:
        return self.shard.stateless

    # (Read by tests that drive a data server in their own process.)
    @property
    def _params(self) -> Tensors:
        return self.shard.params

    @property
    def _optimizer(self) -> ShardOptimizer | None:
        return self.shard.optimizer

    # -- compute workers -------------------------------------------------------------------------

    async def open_channel(self) -> ChannelAddress:
        """Start listening for compute loops (`wire/channel.py`) on this host; returns the address."""
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
        `bodies_shared` and `bodies_socket` the frames with tensors by the way they came (`wire/inbox.py`),
        `params_in_place` the answers whose parameters a loop read in this shard's memory
        (`wire/published.py`); `parts` the buckets of gradients taken during the senders' backward, and
        `parts_dropped` those a fence dropped with the open step (`bucketed.py`), `buckets_applied` and
        `apply_buckets` the buckets applied into the other copy before their step committed, and the
        seconds (within `handle`, or in a thread) that took, `buckets_undone` those dropped with their
        step (`other_copy.py`)."""
        server = self._server
        return {
            **(server.phases if server is not None else {}),
            "apply": self.shard.apply_seconds,
            "frames": float(server.frames if server is not None else 0),
            "bodies_shared": float(server.bodies["shared"] if server is not None else 0),
            "bodies_socket": float(server.bodies["socket"] if server is not None else 0),
            "params_in_place": float(server.bodies.get("referenced", 0) if server is not None else 0),
            **self.applies.parts_phases,
        }

    async def close_channel(self) -> None:
        if self._server is not None:
            await self._server.aclose()

    async def on_frame(self, frame: Frame) -> Frame:
        """One frame of a compute loop (`frames.py`)."""
        return await self._frames.answer(frame)

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
        """Async mode: apply the gradient of one micro-batch now (`AsyncApplies.apply_one`)."""
        apply = Apply(generation, worker, batch_id, computed_on, loss)
        return await self.applies.apply_one(apply, grads, buffers)

    async def current(self, generation: int) -> tuple[int, Tensors]:
        """Async mode: the version and a copy of the parameters and buffers as they are now."""
        return await self.applies.current(generation)

    async def get_batch(self, generation: int, batch_id: int) -> Batch:
        return await self.partition.get_batch(generation, batch_id)

    async def pull(self, generation: int, step: int, wait: float = 0.0) -> Tensors:
        """The shard's parameters and buffers as of `step` (before it is applied), once they exist."""
        return await self.applies.pull(generation, step, wait)

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
        await self.applies.push(Push(generation, step, worker, losses), grads, buffers)

    # -- the coordinator -------------------------------------------------------------------------

    async def status(self, since: int, keep_from: int = 0, generation: int | None = None) -> ShardStatus:
        """Where the shard is, with the records of the steps it applied from step `since` on. The records
        of steps before `keep_from` are dropped if the caller is of this shard's generation: the
        controller's copy of the record holds those steps (`CoordinatorState.records_kept_from`), and a
        long run would otherwise keep one per step. A coordinator of an older generation (one the
        scheduler dropped while its process went on, and rebuilt elsewhere) may still read the shards:
        its `keep_from` is not the new coordinator's, which may be training those steps again."""
        shard, replicas = self.shard, self.replicas
        if keep_from > 0 and generation == shard.generation:
            shard.records.drop_before(keep_from)
        return ShardStatus(
            index=self.index,
            generation=shard.generation,
            version=shard.version,
            records=shard.records.since(since),
            snapshots=tuple(
                SnapshotInfo(s.version, s.time, s.seconds, replicas.replicated.get(s.version, 0.0))
                for s in shard.snapshots.values()
                if replicas.counts(s.version)
            ),
            pending=self.applies.pending,
            refused=shard.refused,
            replicas=tuple(sorted(replicas.held)),
            stateless=shard.stateless,
            kept=shard.kept,
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
        shard = self.shard
        shard.check(generation, "hold")
        await self._hooks.on_hold()
        shard.check(generation, "hold")  # a fence may have come while a hook held it
        shard.hold = version
        if shard.version < version:
            await self.applies.advance()  # kept by a lower hold, which this one lifts
        if shard.version < version:
            with contextlib.suppress(RecoverableError, StaleGenerationError):
                await shard.wait_for_version(generation, version, wait)
        return shard.version

    async def fence(self, generation: int, since: int = 0, applied_from: int | None = None) -> ShardStatus:
        """Enter `generation`: refuse every older message from now on, drop the gradients of the open
        step and any snapshot asked for; returns where the shard is, with the records from step `since`
        on (the coordinator asks from the steps it has not committed: a long run holds a record per
        step, 7.7 MB and half a second of pickling for 50,000 of them, on the path of every recovery).
        Async mode, with `applied_from` (a rebuilt coordinator): also every batch id applied from that
        id on (`ShardStatus.applied`), recorded or not."""
        shard = self.shard
        if generation < shard.generation:
            raise StaleGenerationError(generation, shard.generation, "fence")
        self._hooks.on_fence()
        shard.generation = generation
        shard.hold = None
        # An apply under way ends before the answer says where the shard stands.
        await shard.wait_turns()
        pending = await self.applies.settle()
        shard.snapshot_wanted = None
        await shard.snapshot_taken()
        await shard.announce_version()
        status = await self.status(since)
        applied = self.applies.applied_from(applied_from) if applied_from is not None else None
        if applied is not None:
            status = replace(status, applied=applied)
        return replace(status, pending=pending)

    async def step_back(self, generation: int, version: int) -> int:
        """Come back to `version`: a shard there stays; one a step ahead steps back where its other copy
        still holds that version (`SyncApplies.step_back`), else RecoverableError. Returns the version."""
        self.shard.check(generation, "step back")
        if self.shard.version == version:
            return version
        await self.applies.settle()  # (nothing is open after a fence; a restore waits the same way)
        version = await self.applies.step_back(version)
        self.replicas.stepped_back(version)
        return version

    async def restore(self, generation: int, version: int) -> int:
        """Reload the snapshot of `version`; the records of the steps after it are dropped."""
        self.shard.check(generation, "restore")
        await self.applies.settle()  # (an apply under way reads the tensors the restore writes)
        await self.shard.restore(version)
        self.applies.drop_open()
        await self.shard.announce_version()
        return self.shard.version

    async def snapshot_at(self, generation: int, version: int, keep: int) -> ShardStatus:
        """Take a snapshot of `version`: now if the shard is there, else right after it applies the step
        before. Snapshots other than `keep` (the last one every shard holds) are dropped. A shard already
        past `version` does not take it; the coordinator asks again later."""
        shard = self.shard
        shard.check(generation, "snapshot")
        for v in [v for v in shard.snapshots if v not in (keep, version)]:
            del shard.snapshots[v]
        self.replicas.snapshots_kept(keep)
        shard.snapshot_wanted = version
        if shard.version == version and not shard.applying and version not in shard.snapshots:
            shard.start_snapshot()
        if shard.snapshotting is not None and shard.version == version:
            await shard.snapshotting
        await self.replicas.recopy(version)
        return await self.status(shard.version)

    # -- peer replicas -----------------------------------------------------------------------------

    async def set_peer(self, generation: int, peer: Any) -> None:
        """Copy this shard's snapshots to `peer` from now on (the coordinator names it at the start and
        after a promotion)."""
        self.replicas.set_peer(generation, peer)

    async def hold_replica(self, generation: int, source: int, replica: dict[str, Any]) -> None:
        """Keep a copy of shard `source`'s snapshot, whole."""
        self.replicas.hold(generation, source, replica)

    async def replica(self, source: int, version: int) -> dict[str, Any]:
        """The copy of shard `source`'s snapshot of `version`, for the standby that takes its role."""
        return self.replicas.replica(source, version)

    async def replica_outline(self, source: int, version: int) -> Any:
        """The replica of shard `source`'s snapshot of `version` with its tensors left out (`split_tensors`:
        their places numbered); the tensors come over the channel, op `replica`."""
        return split_tensors(self.replicas.replica(source, version))[0]

    async def adopt(self, peer: Any, version: int) -> int:
        """Take this shard's state from the replica its peer holds (a promotion: this data server starts
        empty on a standby, with its data partition only). Returns the version taken."""
        began = time.perf_counter()
        shard = self.shard
        replica = await fetch_replica(peer, self.index, shard.generation, version, self._spec.call_timeout)
        copied = time.perf_counter() - began
        # The replica arrived as tensors of this process alone: they become the live state as they are, and
        # the snapshot of their version is copied from them in the background, while the promotion goes on
        # (a 200 MB shard: 0.2 s of copies off the promotion's path); the first step waits for it. The load
        # builds the shard's optimizer, in a thread: the first optimizer a process builds imports
        # torch._dynamo (5 to 11 s on the chaos soak's 2 cores, where the standby was not warmed yet:
        # `warm_standby`), which on the event loop silenced the worker's heartbeats all that time.
        # (Nothing else touches the shard meanwhile: it has no role and no channel yet.)
        tensors = replica["params"], replica["buffers"], replica["optimizer"]
        await asyncio.to_thread(shard.load, *tensors, int(replica["version"]), True)
        shard.applied = set(replica.get("applied", ()))  # async mode: the applies the snapshot holds
        self.applies.reset()
        shard.start_snapshot()
        shard.records.clear()
        self.replicas.adopted()
        log.info(
            "data server %d of job %s: took version %d from its peer (copy %.3f s, load %.3f s)",
            self.index, self.job_id, shard.version, copied, time.perf_counter() - began - copied,
        )  # fmt: skip
        return shard.version

    async def applied_ids(self) -> list[int]:
        """Async mode: the batch ids applied here (a promoted shard's, from its snapshot)."""
        return sorted(self.shard.applied)

    # -- the controller ----------------------------------------------------------------------------

    async def export_snapshot(self, version: int) -> dict[str, Any]:
        """The snapshot of `version`, for a persistent checkpoint."""
        snap = self.shard.snapshots.get(version)
        if snap is None:
            raise FatalError(f"shard {self.index} holds no snapshot of version {version}")
        return {
            "version": snap.version,
            "tensors": {**snap.params, **snap.buffers},
            "optimizer": snap.optimizer,
            "applied": sorted(snap.applied),
        }

    async def state(self) -> Tensors:
        return {n: t.detach().clone() for n, t in self.shard.live().items()}

    async def describe(self) -> dict[str, Any]:
        def nbytes(ts: Tensors) -> int:
            return sum(t.numel() * t.element_size() for t in ts.values())

        return {
            "index": self.index,
            "generation": self.shard.generation,
            "version": self.shard.version,
            "snapshot_versions": sorted(self.shard.snapshots),
            "samples": self.partition.samples,
            # (The batches made ahead and not yet served, at their most: the data is read as it is needed.)
            "data_bytes": self.partition.peak_bytes,
            "batches_made": self.partition.made,
            "param_bytes": nbytes(self.shard.params) + nbytes(self.shard.buffers),
        }


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
