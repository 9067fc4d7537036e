"""What a shard keeps of the steps it applies, and the decisions of an apply, as pure parts.

- `OpenStep`: the gradients, buffers, losses and workers of a step not applied yet (sync mode).
- `StepRecords`: the record of every step applied, in order, for the coordinator's ledger (`status`).
- `push_refusal` and `async_verdict`: whether a push or a gradient goes in, from the shard's position;
  `replicas_kept_sync` and `replicas_kept_async`: which copies of a peer's snapshots a shard keeps.

No tensors are touched here and nothing awaits: the apply itself (`apply.py`) acts on these.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from operator import attrgetter

from ..messages import StepRecord, Tensors
from .optimizer import Gradient


@dataclass
class OpenStep:
    """What the shard holds of a step it has not applied yet."""

    grads: dict[int, Gradient] = field(default_factory=dict)  # batch id -> gradient of this shard's params
    buffers: dict[int, Tensors] = field(default_factory=dict)  # batch id -> buffers after its forward
    losses: dict[int, float] = field(default_factory=dict)
    workers: dict[int, str] = field(default_factory=dict)
    opened: float | None = None  # (monotonic) when its first push came in
    backed_up: set[int] = field(default_factory=set)  # batch ids whose gradient came from a backup
    told: dict[str, float] = field(default_factory=dict)  # worker -> when it was asked for a backup of it
    duplicates: int = 0  # later copies of a batch id's gradient, dropped
    bucketed: bool = False  # its gradients came in parts, during the senders' backward (`bucketed.py`)
    # The batch ids this shard asked a backup of (`BackupWanted`), and a member's own copy of one of them
    # that came after: held aside until its member confirms it (`confirm`), or dropped for a backup's.
    wanted: set[int] = field(default_factory=set)
    aside: dict[int, tuple[str, Gradient, Tensors, float]] = field(default_factory=dict)

    def take(
        self, batch_id: int, worker: str, grads: Gradient, buffers: Tensors, loss: float, backup: bool = False
    ) -> None:
        """The gradient of `batch_id`, unless one is held already: a backup and the straggler it stood in
        for computed the same bits (`stragglers.py`), and the first copy is the one kept. Except where this
        shard asked for a backup of it: its member's own copy then may have been computed on parameters
        that moved under it (a peer applied the step from the backup, in place, while the member read them
        in place), so it is held aside, and only a backup's copy goes in (or that one, confirmed)."""
        if batch_id in self.grads:
            self.duplicates += 1
            return
        if not backup and batch_id in self.wanted:
            self.duplicates += batch_id in self.aside
            self.aside[batch_id] = (worker, grads, buffers, loss)
            return
        if self.aside.pop(batch_id, None) is not None:
            self.duplicates += 1
        self.grads[batch_id] = grads
        self.buffers[batch_id] = buffers
        self.losses[batch_id] = loss
        self.workers[batch_id] = worker
        if backup:
            self.backed_up.add(batch_id)

    def confirm(self, worker: str, batch_ids: list[int]) -> list[int]:
        """`worker` says every shard took its push of `batch_ids` before applying the step (none refused
        it), so no parameter it read had moved: its copies held aside go in. Returns the ids that did
        (where the step came in parts, theirs held aside go in too: `OpenBuckets.confirm`)."""
        taken = []
        for batch_id in batch_ids:
            held = self.aside.get(batch_id)
            if held is not None and held[0] == worker and batch_id not in self.grads:
                del self.aside[batch_id]
                self.wanted.discard(batch_id)
                self.take(batch_id, *held)
                taken.append(batch_id)
        return taken

    def missing(self, batches: range) -> list[int]:
        """Of the step's `batches`, the batch ids whose gradient is not here."""
        return [b for b in batches if b not in self.grads]

    def complete(self, batches: int) -> bool:
        """Whether it holds the gradient of each of the step's `batches` batch ids."""
        return bool(self.grads) and len(self.grads) == batches

    def in_order(self) -> tuple[list[int], list[Gradient], list[Tensors]]:
        """The batch ids in order, with their gradients and buffers in that order: summed in batch-id order
        whatever order they arrived in, the result is bitwise independent of which worker computed which."""
        ordered = sorted(self.grads)
        return ordered, [self.grads[b] for b in ordered], [self.buffers[b] for b in ordered]

    def record(self, step: int, generation: int, time: float) -> StepRecord:
        return StepRecord(
            step, generation, tuple(sorted(self.grads)), dict(self.workers), dict(self.losses), time
        )


class StepRecords:
    """The records of the steps a shard applied, in order of their step (their version before, in async
    mode), until the controller's copy of the record holds them."""

    def __init__(self) -> None:
        self._records: list[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        self._records.append(record)

    def since(self, step: int) -> tuple[StepRecord, ...]:
        # (By key, not over a list of every step: the coordinator asks up to 20 times a second.)
        return tuple(self._records[bisect.bisect_left(self._records, step, key=attrgetter("step")) :])

    def drop_before(self, step: int) -> None:
        del self._records[: bisect.bisect_left(self._records, step, key=attrgetter("step"))]

    def drop_from(self, step: int) -> None:
        """A restore to version `step`: the steps after it were undone."""
        self._records = [r for r in self._records if r.step < step]

    def clear(self) -> None:
        self._records = []

    def __len__(self) -> int:
        return len(self._records)


def push_refusal(index: int, step: int, version: int, applying: bool, stateless: bool) -> str | None:
    """Why a push of step `step` cannot go in at shard `index`, at `version` (None: it goes in). A push of
    a step already applied (or being applied) comes from a worker that was too slow; a push of a later
    step only reaches a shard that holds no state, whose answer no loop waits for (a loop pushes a step
    only with its parameters, pulled from every shard that holds state once it got there)."""
    if step < version or (step == version and applying) or (step > version and not stateless):
        return f"push for step {step}, but shard {index} is at step {version}"
    return None


def async_verdict(
    batch_id: int, computed_on: int, version: int, applied: set[int] | frozenset[int], max_staleness: int
) -> tuple[str | None, int]:
    """Async mode: what becomes of one micro-batch's gradient at a shard at `version`, and its staleness.
    "duplicate": the shard applied that batch id already (its worker died after pushing here, and the
    batch was trained again); "stale": the parameters it was computed on are more than `max_staleness`
    versions old (the worker trains it again on fresh parameters); None: it is applied."""
    staleness = version - computed_on
    if batch_id in applied:
        return "duplicate", staleness
    if staleness > max_staleness or staleness < 0:
        return "stale", staleness
    return None, staleness


def replicas_kept_sync(versions: list[int], keep: int) -> set[int]:
    """Sync mode: of the replicas of a peer's snapshots, the one every shard holds (`keep`, the one a
    promotion goes back to) and the two newest after it (the peer may learn of a newer `keep` after the
    copy of the next snapshot arrived)."""
    newest = sorted(v for v in versions if v > keep)[-2:]
    return {v for v in versions if v == keep or v in newest}


def replicas_kept_async(versions: list[int], keep: int) -> set[int]:
    """Async mode: the two newest. Every shard snapshots at its own version, so the peer's versions and
    this shard's `keep` are not comparable."""
    return set(sorted(versions)[-2:])
