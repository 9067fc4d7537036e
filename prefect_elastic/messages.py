"""Every message that crosses a process, and the typed handles of the actors that send and take them.

Frozen dataclasses: they are pickled between the controller, the coordinator, the data servers and the
compute loops, so nothing here holds a lock, a tensor that can change, or a reference to a role. The actor
handles are `typing.Protocol`s that say what each role answers; Dask's `Actor` proxies satisfy them at run
time (every method returns a future whose `result(timeout)` gives the value).

Who sends what (docs/architecture.md has the picture):
- coordinator -> compute loop: `Role` (its rank in a generation's member list; the answer to `role`);
- compute loop <-> data server: one frame each way per step on the step path's own connection
  (`wire/channel.py`: the gradients, buffers and losses of one share, then the next step's parameters and
  batches); JSON headers and raw tensor bytes, not these dataclasses;
- data server -> coordinator: `ShardStatus` with `StepRecord`s (what each shard applied), read by the
  coordinator off the step path;
- coordinator -> controller: `Progress`, `MembershipEvent`, `Outcome`, and `Journal` (the controller's
  copy of the ledger and history, from which a coordinator is rebuilt on another static worker);
  controller -> coordinator: `Resume` (a persistent checkpoint to start from), a `Journal` to rebuild from.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import torch

from .ledger import LedgerEntry
from .wire import ChannelAddress

Tensors = dict[str, torch.Tensor]
T_co = TypeVar("T_co", covariant=True)


class EventKind(StrEnum):
    """What survival detection (or the end of a job) did; a `StrEnum`, so it compares equal to its name."""

    START = "start"  # the first members were admitted (not a failure: nothing was undone)
    SNAPSHOT = "snapshot"
    ROLLBACK = "rollback"  # membership changed: every shard went back to the last snapshot
    REASSIGN = "reassign"  # membership changed: only the step in flight was dropped
    WAITING = "waiting"  # fewer live workers than min_workers: no work until more join
    SHARD_LOST = "shard-lost"  # a data server's static worker died: training suspended until promotion
    PROMOTED = "promoted"  # a standby static worker took the lost data server's role, from its peer's replica
    KEPT = "kept"  # a data server taken for lost while silent answered, and keeps its role (not a promotion)
    COORDINATOR_REBUILT = "coordinator-rebuilt"  # its worker died: rebuilt from the journal and the shards
    RESTORED = "restored"  # data servers lost with their replicas: every shard back to the last checkpoint
    EXCLUDED = "excluded"  # a compute worker's model failed on a batch: it trains no more for this job
    # The controller could not write a persistent checkpoint: training goes on from the in-memory snapshots
    # and the next checkpoint tries again (more failures in a row than `checkpoint_failures_allowed` stop it).
    CHECKPOINT_FAILED = "checkpoint-failed"
    FAILED = "failed"
    DONE = "done"


MEMBERSHIP_KINDS = (EventKind.START, EventKind.ROLLBACK, EventKind.REASSIGN)


@dataclass(frozen=True)
class Role:
    """A compute worker's place in one generation: rank `rank` of `members` (roles by rank).

    Fixed until the next generation: the worker trains its share of every step from `start_step` on
    (`Schedule.share(step, rank, len(members))`) without asking the coordinator again.
    """

    generation: int
    rank: int
    members: tuple[str, ...]
    start_step: int
    stop: bool = False  # the job is over: the loop ends
    # Where each shard listens for compute loops (wire/channel.py) in this generation: a data server promoted
    # onto a standby listens elsewhere, and the generation that follows its promotion says where.
    channels: tuple[ChannelAddress, ...] = ()

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class StepRecord:
    """What a shard applied as one step: the batch ids, who computed each, their losses, and when.

    In async mode a shard applies one micro-batch at a time: `step` is then the shard's own version
    before it applied it (shards apply in different orders), `batch_ids` the one batch id, `computed_on`
    the version of the shard's parameters its gradient was computed on, and `staleness` how many versions
    the shard had moved on since."""

    step: int
    generation: int
    batch_ids: tuple[int, ...]
    workers: dict[int, str]
    losses: dict[int, float]
    time: float
    computed_on: int = -1
    staleness: int = 0


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot a shard holds: the version it is of, when it was taken and how long the copy took, and
    when its copy became whole on the peer (0 without peer replicas)."""

    version: int
    time: float
    seconds: float
    replicated: float = 0.0


@dataclass(frozen=True)
class ShardStatus:
    """A shard's answer to the coordinator: its generation and version, the steps it applied from a step
    the coordinator asked for on, the snapshots it holds, and how many messages it refused."""

    index: int
    generation: int
    version: int
    records: tuple[StepRecord, ...]
    snapshots: tuple[SnapshotInfo, ...]
    pending: int  # micro-batches of the open step whose gradients it holds
    refused: int  # messages of another generation refused since the shard started
    # Versions of the snapshots of shard `(index - 1) % D` this shard holds a whole copy of (its replicas).
    replicas: tuple[int, ...] = ()
    # Holds no parameters and no buffers: no loop waits for its answer to a push, so it may lag the others
    # by more than a version when the membership changes (see `CoordinatorState.reconcile`).
    stateless: bool = False
    # Async mode, in a fence's answer to a rebuilt coordinator: every batch id this shard applied from the
    # id the caller named on, recorded or not. A shard that took its peer's replica of a snapshot holds
    # the applies of that snapshot and no record of them (its records start at the snapshot's version).
    applied: tuple[int, ...] = ()
    # Sync mode with gradients in parts: the version this shard can step back to (the one before its own,
    # still whole in its other copy), None where it cannot (`data_server/other_copy.py`).
    kept: int | None = None


@dataclass(frozen=True)
class MembershipEvent:
    """One thing survival detection did, for `result.events` and the logs."""

    time: float
    kind: EventKind
    generation: int
    # Committed steps (the parameter version) after the event; for a snapshot, the version it holds (the
    # ledger may have committed further by the time every shard confirmed it).
    step: int
    workers: tuple[str, ...]
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    steps_lost: int = 0  # committed steps undone (rollback)
    batches_dropped: int = 0  # micro-batches of the step in flight that were dropped and trained again
    reason: str = ""
    # How long survival detection took to get here, from the moment the coordinator took the check up:
    # what the event held the training up, and for a snapshot the window in which it could slow a step.
    seconds: float = 0.0


@dataclass(frozen=True)
class Promotion:
    """A lost data server's role taken by a standby, as the controller carried it out, with how long each
    part took (seconds): `suspend` (the coordinator fenced the other shards), `start` (the data server
    started on the standby: its data partition read), `adopt` (its shard copied from the peer's replica),
    `promote` (every shard fenced and brought to the snapshot, peers named again)."""

    index: int
    lost_worker: str
    standby: str
    step: int  # the snapshot every shard went back to
    seen: float  # wall time the controller saw the loss
    suspend: float
    start: float
    adopt: float
    promote: float
    source: str  # "replica" (the peer's memory) or "start" (the state the run started from)

    @property
    def seconds(self) -> float:
        return self.suspend + self.start + self.adopt + self.promote


@dataclass(frozen=True)
class Progress:
    generation: int
    committed_steps: int
    total_steps: int
    workers: tuple[str, ...]
    state: str  # running | waiting | done | failed | controller-lost (`registry.read_progress`)
    loss: float | None
    failure: str | None = None
    failure_kind: str | None = None
    failure_step: int | None = None
    failure_batch: int | None = None
    holding: tuple[tuple[str, int], ...] = ()  # (worker, micro-batches of the open step in its share)
    lost_shards: tuple[int, ...] = ()  # data servers lost with their static worker, not yet replaced
    snapshot_step: int = (
        0  # the last snapshot every shard holds (and its peer a copy of): where a rollback goes
    )
    # Where the job's roles live (set by the controller): the static worker of each data server, of the
    # coordinator, and the static workers that hold nothing of this job (standbys).
    data_servers: tuple[str, ...] = ()
    coordinator_at: str | None = None
    standbys: tuple[str, ...] = ()
    # "sync" or "async" (then a step is one batch id, committed once every shard applied it).
    mode: str = "sync"
    # Events the coordinator has recorded: the controller copies its record when it holds fewer.
    events: int = 0

    def holds(self, worker: str) -> int:
        return dict(self.holding).get(worker, 0)


@dataclass(frozen=True)
class Resume:
    """Where a job restarts from (a persistent checkpoint)."""

    generation: int
    committed_steps: int
    ledger: list[LedgerEntry]
    history: list[float]
    # Async mode: each shard's version in the snapshot (they differ), and the batch ids each had applied
    # (a batch id some shards applied and others did not is trained again, and applied where it lacks).
    versions: tuple[int, ...] = ()
    applied: tuple[tuple[int, ...], ...] = ()


@dataclass
class Journal:
    """The coordinator's record as the controller keeps a copy of it: the ledger's entries in step order,
    the mean loss and commit time of every committed step, the events, the counters. A part of it
    (`Coordinator.journal`) starts at `base_step` and `base_event`: whatever the copy holds from there on
    is replaced (a rollback since the last part changed the steps after its snapshot).

    When the coordinator's static worker dies, a new coordinator is rebuilt from the copy and from what
    the shards still hold (`CoordinatorState.rebuild`)."""

    generation: int = 0
    committed_steps: int = 0
    entries: list[LedgerEntry] = field(default_factory=list)  # of steps base_step..committed_steps-1
    history: list[float] = field(default_factory=list)
    commit_times: list[float] = field(default_factory=list)
    events: list[MembershipEvent] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    base_step: int = 0
    base_event: int = 0
    # Where the last snapshot every shard holds stands in the ledger (async mode: a rebuilt coordinator
    # retracts the commits after it that a shard promoted from its replica lacks).
    snapshot_step: int = 0

    def first_open_batch(self) -> int:
        """The lowest batch id this copy holds no commit of (async mode commits them in any order)."""
        committed = {e.batch_id for e in self.entries}
        return next(b for b in range(len(committed) + 1) if b not in committed)

    def extend(self, part: Journal) -> None:
        """Take in a part of the coordinator's journal (this copy starts at step 0 and event 0)."""
        if part.base_step > self.committed_steps or part.base_event > len(self.events):
            raise ValueError(
                f"journal part starts at step {part.base_step}, event {part.base_event}; the copy holds "
                f"{self.committed_steps} steps and {len(self.events)} events"
            )
        self.entries = [e for e in self.entries if e.step < part.base_step] + part.entries
        del self.history[part.base_step :], self.commit_times[part.base_step :]
        self.history += part.history
        self.commit_times += part.commit_times
        del self.events[part.base_event :]
        self.events += part.events
        self.generation, self.committed_steps = part.generation, part.committed_steps
        self.snapshot_step = part.snapshot_step
        self.counters = dict(part.counters)


@dataclass
class Outcome:
    ledger: list[LedgerEntry]
    events: list[MembershipEvent]
    history: list[float]
    generation: int
    counters: dict[str, int] = field(default_factory=dict)
    commit_times: list[float] = field(default_factory=list)  # wall time each committed step committed


# -- typed actor handles --------------------------------------------------------------------------------


class Call(Protocol[T_co]):
    """What a Dask actor method returns to a synchronous caller."""

    def result(self, timeout: float | None = None) -> T_co: ...


class ShardHandle(Protocol):
    """A data server with its parameter shard (`data_server.DataServer`), as callers see it."""

    def open_channel(self) -> Call[ChannelAddress]: ...

    def close_channel(self) -> Call[None]: ...

    def phases(self) -> Call[dict[str, float]]: ...

    def status(self, since: int, keep_from: int = 0, generation: int | None = None) -> Call[ShardStatus]: ...

    def state(self) -> Call[Tensors]: ...

    def fence(
        self, generation: int, since: int = 0, applied_from: int | None = None
    ) -> Call[ShardStatus]: ...

    def hold_at(self, generation: int, version: int, wait: float) -> Call[int]: ...

    def restore(self, generation: int, version: int) -> Call[int]: ...

    def snapshot_at(self, generation: int, version: int, keep: int) -> Call[ShardStatus]: ...

    def export_snapshot(self, version: int) -> Call[dict[str, Any]]: ...

    def set_peer(self, generation: int, peer: Any) -> Call[None]: ...

    def adopt(self, peer: Any, version: int) -> Call[int]: ...

    def applied_ids(self) -> Call[list[int]]: ...

    def describe(self) -> Call[dict[str, Any]]: ...


class CoordinatorHandle(Protocol):
    """The coordinator (`coordinator.Coordinator`), as compute loops and the controller see it."""

    def role(self, worker: str, generation: int) -> Call[Role | None]: ...

    def lease(
        self, worker: str, generation: int, count: int, renew: bool = False
    ) -> Call[list[int] | None]: ...

    def report_failure(
        self, generation: int, worker: str, step: int, batch_id: int | None, kind: str, message: str
    ) -> Call[None]: ...

    def survival_check(
        self, live_workers: list[str], trigger: str, renew: bool = False, graceful: list[str] | None = None
    ) -> Call[list[MembershipEvent]]: ...

    def progress(self) -> Call[Progress]: ...

    def outcome(self) -> Call[Outcome]: ...

    def stop(self, reason: str) -> Call[int]: ...

    def snapshot_now(self) -> Call[int]: ...

    def snapshot_record(self) -> Call[Resume]: ...

    def shards_lost(self, indices: list[int], reason: str, keys: list[str] | None = None) -> Call[int]: ...

    def snapshot_version(self, index: int) -> Call[int]: ...

    def hand_over(self, indices: list[int], reason: str) -> Call[int]: ...

    def journal(self, known_steps: int, known_events: int) -> Call[Journal]: ...

    def rebuild(
        self,
        journal: Journal,
        shards: list[Any],
        channels: list[ChannelAddress],
        lost: list[int],
        where: str,
        reason: str,
        began: float,
        kind: EventKind,
    ) -> Call[MembershipEvent]: ...

    def promote(
        self, index: int, shard: Any, channel: ChannelAddress, worker: str
    ) -> Call[MembershipEvent]: ...


Handle = TypeVar("Handle")


def direct(handle: Handle) -> Handle:
    """`handle`, a Dask `Actor` held in a worker (a coordinator's handle in a compute loop, the shards'
    in the coordinator, a peer's in a data server), with its calls going straight to the actor's worker
    whatever the state of this worker's Dask client.

    Dask binds each handle to a future of the worker's client, and the client cancels all its futures
    when it loses the scheduler for a moment (a network cut shorter than Dask's removal of the worker):
    from then on every call through the handle raised "Worker holding Actor was lost" although the actor
    lived. A worker also keeps the handle it fetched for a task's argument and gives that same object to
    every later task, so in the chaos soak every compute loop on such a worker failed at once, and the
    job ended after `MAX_LOOP_RESTARTS`. Calls do not need the future: an actor that is really gone fails
    them itself (its worker refuses the connection), and survival detection replaces it."""
    if not hasattr(handle, "_future"):
        return handle  # not a Dask actor (a test's stand-in)
    # A new handle (Actor.__reduce__), made here, binds this worker and its client now rather than at its
    # first call (which would make a future again); the object it came from is left as it is.
    handle = copy.copy(handle)
    handle._future = None
    return handle
