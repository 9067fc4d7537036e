"""Peer replicas and adoption: every snapshot a shard takes is copied whole to its peer's memory, and a
standby promoted to a lost shard's role takes the shard from there.

Shard `i`'s peer is shard `(i + 1) % D`, named by the coordinator (`set_peer`). A snapshot counts (is
reported to the coordinator, can become the one a rollback or a promotion goes back to) once its copy is
whole on the peer. The peer keeps the copy every shard's rollback goes back to and the newest ones
(`StepApplies.replicas_kept`). A standby's data server starts empty and `adopt`s the state over the peer's
channel (`fetch_replica`), the tensors in one frame, the rest (`replica_outline`) through Dask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..allocator import freeze_startup_objects, tune_allocator
from ..errors import FatalError
from ..job import ShardSpec
from ..messages import direct
from ..wire import ChannelAddress, Frame, ReplicaAsk, ShardLink, worker_tls
from .state import ShardState, Snapshot
from .step_applies import StepApplies

log = logging.getLogger(__name__)


class Replicas:
    """The copies this shard sends to its peer, and the copies of its other neighbour's it keeps."""

    def __init__(self, state: ShardState, applies: StepApplies, data_servers: int, enabled: bool) -> None:
        self._state = state
        self._applies = applies
        self._data_servers = data_servers
        self.enabled = data_servers > 1 and enabled
        self._peer: Any = None  # the peer's actor handle, once the coordinator names it (`set_peer`)
        # Versions of this shard's snapshots whole on the peer, with when each became whole (wall clock).
        self.replicated: dict[int, float] = {}
        self.replicating: dict[int, asyncio.Task[None]] = {}  # copies to the peer in flight, by version
        self.keep = state.version  # the snapshot every shard holds (from `snapshot_at`): kept, and its copy
        self.held: dict[int, dict[str, Any]] = {}  # version -> a snapshot of shard (index - 1) % D
        state.tell_snapshots_to(self.replicate)

    def set_peer(self, generation: int, peer: Any) -> None:
        """Copy this shard's snapshots to `peer` from now on; the snapshots held now are copied at once,
        since the old peer's copies may be gone with it."""
        self._state.check_not_older(generation, "set_peer")
        if not self.enabled:
            return
        self._peer = direct(peer)
        self.replicated.clear()
        for snap in list(self._state.snapshots.values()):
            self.replicate(snap)

    def replicate(self, snap: Snapshot) -> None:
        """Send `snap` to the peer in the background: the step path never waits for it."""
        peer = self._peer
        if peer is None:
            return
        state = self._state
        generation = state.generation

        async def send() -> None:
            try:
                await peer.hold_replica(generation, state.index, replica_of(snap))
            except Exception as exc:
                # The peer is gone or was fenced: the snapshot is not reported, and the next one (or the
                # peer named after a promotion) is copied instead.
                log.warning(
                    "shard %d: copy of snapshot %d to its peer failed: %s", state.index, snap.version, exc
                )
                return
            # (This very snapshot: after a step back, another of its version may have been taken since.)
            if self._peer is peer and state.snapshots.get(snap.version) is snap:
                self.replicated[snap.version] = time.time()

        task = asyncio.ensure_future(send())
        self.replicating[snap.version] = task

        def done(_: asyncio.Task[None], version: int = snap.version) -> None:
            if self.replicating.get(version) is task:
                del self.replicating[version]

        task.add_done_callback(done)

    def counts(self, version: int) -> bool:
        """Whether this shard's snapshot of `version` counts: its copy is whole on the peer, or there
        are no replicas."""
        return version in self.replicated or not self.enabled

    def snapshots_kept(self, keep: int) -> None:
        """`snapshot_at` dropped the snapshots other than `keep` and the one asked for: so are their
        copies' marks, and the copies of the peer's snapshots this shard keeps follow the new `keep`."""
        self.keep = keep
        self.replicated = {v: t for v, t in self.replicated.items() if v in self._state.snapshots}
        self.prune()

    def stepped_back(self, version: int) -> None:
        """The shard stepped back to `version` (`ShardState.step_back`): its snapshots after it are gone,
        and so are their marks; a copy of one still in flight marks nothing when it ends."""
        self.replicated = {v: t for v, t in self.replicated.items() if v <= version}

    async def recopy(self, version: int) -> None:
        """After `snapshot_at(version)`: copy the snapshot again if it is taken but its copy was refused
        (started in the generation a fence just ended, the step before the fence asked for it, and the
        peer, fenced too, refused that generation); answer once the copy is whole where the shard stands
        at this version (the job waits or ends), so that the snapshot counts at once."""
        state = self._state
        # Twice at most: a copy still in flight may be the one the fence's generation will refuse (taken
        # just before the fence), and only once it has failed can the copy of this generation start.
        for _ in range(2):
            if not self.enabled or version not in state.snapshots or version in self.replicated:
                return
            if version not in self.replicating:
                self.replicate(state.snapshots[version])
            copying = self.replicating.get(version)
            if copying is None or state.version != version:
                return
            await asyncio.shield(copying)

    def hold(self, generation: int, source: int, replica: dict[str, Any]) -> None:
        """Keep a copy of shard `source`'s snapshot, whole (it is stored only once all of it arrived)."""
        state = self._state
        state.check_not_older(generation, "hold_replica")
        if source != (state.index - 1) % self._data_servers:
            raise FatalError(f"shard {state.index} got a replica of shard {source}, which is not its peer's")
        self.held[int(replica["version"])] = replica
        self.prune()

    def prune(self) -> None:
        kept = self._applies.replicas_kept(list(self.held), self.keep)
        for v in [v for v in self.held if v not in kept]:
            del self.held[v]

    def replica(self, source: int, version: int) -> dict[str, Any]:
        """The copy of shard `source`'s snapshot of `version`, for the standby that takes its role."""
        found = self.held.get(version)
        if found is None:
            raise FatalError(
                f"shard {self._state.index} holds no replica of shard {source} at version {version} "
                f"(it holds {sorted(self.held)})"
            )
        return found

    def adopted(self) -> None:
        """The shard took a replica's state: none of its own snapshots is on the peer yet."""
        self.replicated.clear()
        self.keep = self._state.version


def replica_of(snap: Snapshot) -> dict[str, Any]:
    # The snapshot's own tensors, not copies: a snapshot is never changed once taken (a restore copies
    # out of it), and the peer keeps what it was sent.
    return {
        "version": snap.version,
        "params": snap.params,
        "buffers": snap.buffers,
        "optimizer": snap.optimizer,
        "applied": sorted(snap.applied),  # async mode: what a standby taking it has applied
    }


async def fetch_replica(
    peer: Any, index: int, generation: int, version: int, timeout: float
) -> dict[str, Any]:
    """The peer's copy of shard `index`'s snapshot of `version`. The tensors come over the peer's channel
    (one frame, written from the replica's own memory into one buffer here), the rest of the replica
    (names, the optimizer's settings) through Dask. A 200 MB shard takes 0.03 to 0.04 s this way against
    0.09 s in one Dask actor call, and its tensors lie back to back, so that the optimizer takes them as
    they came (SGD's momentum: no 0.035 s copy)."""
    began = time.perf_counter()
    address, outline = await asyncio.gather(peer.open_channel(), peer.replica_outline(index, version))
    asked = time.perf_counter() - began
    ask = ReplicaAsk(generation, index, version).frame()

    def fetch(address: ChannelAddress) -> Frame:
        link = ShardLink(address, timeout, worker_tls("connect"))
        try:
            link.send(ask)
            # (A one-off buffer of the whole replica: no wait for the kernel to compact memory into
            # huge pages, which a fresh process's first 200 MB can take 0.4 s for.)
            return link.receive(timeout, huge_pages=False)
        finally:
            link.close()

    frame = await asyncio.to_thread(fetch, address)
    log.info(
        "shard %d: replica of version %d from the peer: its channel and outline %.3f s, the frame %.3f s",
        index, version, asked, time.perf_counter() - began - asked,
    )  # fmt: skip
    return join_tensors(outline, {entry.batch_id: t for entry, t in frame.tensors})


def warm_standby(spec: ShardSpec) -> None:
    """Runs on a standby static worker, once: pay what a data server's first start pays in a fresh
    process (building the job's optimizer the first time imports half of torch: about 1 s here) before it
    is promoted, not while training waits for it."""
    began = time.perf_counter()
    tune_allocator()
    spec.model_spec.initial_model()
    spec.model_spec.build_optimizer([torch.zeros(1, requires_grad=True)])
    freeze_startup_objects()
    log.info("job %s: standby warmed in %.3f s", spec.job_id, time.perf_counter() - began)


@dataclass(frozen=True)
class TensorPlace:
    """Where a tensor stood in a structure sent without its tensors (`split_tensors`)."""

    index: int


def split_tensors(value: Any) -> tuple[Any, list[tuple[int, torch.Tensor]]]:
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
            return TensorPlace(len(found) - 1)
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


def join_tensors(outline: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of `split_tensors`: `tensors` by their places."""
    if isinstance(outline, TensorPlace):
        return tensors[outline.index]
    if isinstance(outline, dict):
        return {k: join_tensors(x, tensors) for k, x in outline.items()}
    if isinstance(outline, (list, tuple)):
        return _same_kind(outline, [join_tensors(x, tensors) for x in outline])
    return outline


def _same_kind(like: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a named tuple takes its fields one by one
        return type(like)(*items)
    return type(like)(items)
