"""A shard's book of the overlapped step: the gradient buckets of its open step, summed in batch-id order
as they arrive, and when the step commits (docs/design/overlapped-step.md).

- `BucketBook`: one shard's open step in one generation. Parts (one micro-batch's gradient of one bucket)
  come in any order from any worker; each bucket's parts are summed in the order of the step's batch ids
  as far as the ids that came allow, later ones held until the ids before them are in, so the sum is bit
  for bit today's `_mean` over the whole step, whoever sent what. A bucket is whole when every id's part
  of it is in: it may then be applied, into the copy the shard does not publish (`TwoCopies`). The step
  commits when every id is sealed (its worker's last frame of the step, sent to every shard only after all
  of that worker's buckets of the step left), not when the last bucket is whole: a worker killed between
  its buckets leaves no shard committed, and the window in which a kill leaves shards a version apart is
  the seals', as it was one frame per shard before. A member's own part of an id the shard asked a
  backup of is held aside (`take(aside=True)`): it goes into no sum until its member confirms it
  (`confirm`), and a backup's part of the same id and bucket replaces it.
- `TwoCopies`: the shard's version, which of its two copies of its parameters and optimizer state the
  loops read, and whether the other still holds the version before (a shard one version ahead of a peer
  steps back); a data server keeps its version in one (`ShardState.copies`).
- `pull_verdict`: what a pull of a bucket gets, from the shard's generation and version.

Tensors are summed here, in the one order the bit-for-bit guarantee needs; nothing awaits and nothing
touches a connection: the data server's shell acts on what the book says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import FatalError
from ..messages import StepRecord, Tensors
from ..wire.signals import RecoverableError, StaleGenerationError

Taken = Literal["held", "folded", "duplicate", "aside"]


@dataclass
class _BucketSum:
    total: torch.Tensor | None = None
    folded: int = 0  # how many of the step's ids, from the first in order, `total` holds
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # parts of ids past those, by id
    taken: set[int] = field(default_factory=set)  # every id whose part came (folded or held)
    applied: bool = False
    out: torch.Tensor | None = None  # where the sum goes, if the shell gave the book a flat tensor


@dataclass(frozen=True)
class Seal:
    """A micro-batch's end at this shard: who sent it, its loss, its buffers after its forward."""

    worker: str
    loss: float
    buffers: Tensors


@dataclass(frozen=True)
class Undone:
    """What a fence or a restore drops of an open step: the buckets applied into the unpublished copy (the
    published one was never written, so nothing is restored), the parts held, the ids sealed."""

    generation: int
    step: int
    applied: tuple[int, ...]
    parts: int
    sealed: tuple[int, ...]


class BucketBook:
    """Shard `shard`'s open step `step` of generation `generation`: buckets of `sizes` elements, the
    step's `batch_ids`."""

    def __init__(
        self,
        shard: int,
        sizes: Sequence[int],
        generation: int,
        step: int,
        batch_ids: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> None:
        """`out`: a flat tensor of all the buckets' elements, in order, that the sums are written into
        (the first part of each bucket copied there rather than cloned): the buckets' means then lie
        back to back in it, and a part is let go of as soon as it is summed (a part may be a view of
        memory its sender waits to reuse: `wire/inbox.py`)."""
        if not batch_ids or len(set(batch_ids)) != len(batch_ids):
            raise FatalError(f"step {step} of batch ids {list(batch_ids)}")
        if out is not None and (out.dim() != 1 or out.numel() != sum(sizes)):
            raise FatalError(f"a sum of {tuple(out.shape)} elements for buckets of {sum(sizes)}")
        self.shard = shard
        self.sizes = tuple(sizes)
        self.generation = generation
        self.step = step
        self.ids = tuple(sorted(batch_ids))
        runs = out.split(self.sizes) if out is not None else [None] * len(self.sizes)
        self._sums = [_BucketSum(out=run) for run in runs]
        self.sealed: dict[int, Seal] = {}
        self.duplicates = 0  # parts and seals of an id that came already (another member's copy of it)
        # (batch id, bucket) -> a member's own part of an id the shard asked a backup of, in no sum yet.
        self.aside: dict[tuple[int, int], torch.Tensor] = {}

    def _check(self, generation: int, step: int, batch_id: int, what: str) -> None:
        if generation != self.generation:
            raise StaleGenerationError(generation, self.generation, what)
        if step != self.step:
            raise RecoverableError(f"{what} of step {step}, but shard {self.shard} is at step {self.step}")
        if batch_id not in self.ids:
            raise FatalError(f"{what} of batch {batch_id} for step {step} of batch ids {list(self.ids)}")

    def take(
        self, generation: int, step: int, batch_id: int, bucket: int, part: torch.Tensor, aside: bool = False
    ) -> Taken:
        """One micro-batch's gradient of bucket `bucket` (a flat run of its elements). "duplicate": that
        id's part of it came already (a straggler's, whose id another member trained too: the parts are
        the same bits, the first is kept); "folded": it, and any held ids after it, went into the sum;
        "held": an id before it is missing. `aside`: a member's own part of an id this shard asked a
        backup of, which may have been computed on parameters a peer moved (docs/design/overlapped-step.md,
        "A straggler reading in place"): "aside", held out of the sums until `confirm`, or until a
        backup's part of it (taken without `aside`) replaces it."""
        self._check(generation, step, batch_id, "bucket")
        if not 0 <= bucket < len(self.sizes):
            raise FatalError(f"bucket {bucket} of shard {self.shard}, which has {len(self.sizes)}")
        if part.dim() != 1 or part.numel() != self.sizes[bucket]:
            raise FatalError(
                f"bucket {bucket} of shard {self.shard} came with {part.numel()} elements, not "
                f"{self.sizes[bucket]}"
            )
        entry = self._sums[bucket]
        if batch_id in entry.taken:
            self.duplicates += 1
            return "duplicate"
        if aside:
            self.duplicates += (batch_id, bucket) in self.aside
            # (A copy of its own, as a part held below: its sender's memory is let go of at once.)
            self.aside[batch_id, bucket] = part.clone() if entry.out is not None else part
            return "aside"
        if self.aside.pop((batch_id, bucket), None) is not None:
            self.duplicates += 1  # (the member's own, held aside, dropped for the backup's)
        entry.taken.add(batch_id)
        entry.held[batch_id] = part
        if self._fold(entry):
            return "folded"
        if entry.out is not None:
            # Held until the ids before it come: a copy of its own, so that memory its sender waits to
            # reuse (an inbox slot: `wire/inbox.py`) is let go of at once. (A book without `out` keeps
            # what it is given, as the pure tests hand it.)
            entry.held[batch_id] = part.clone()
        return "held"

    def confirm(self, batch_ids: Sequence[int]) -> int:
        """The parts held aside of `batch_ids` go in: their member says every shard took its push of them
        before applying the step, so nothing it read had moved. Each folds where the ids' order allows, as
        a part that just came (the sums stay in batch-id order: the same bits). Returns how many did."""
        wanted = set(batch_ids)
        taken = 0
        for key in sorted(k for k in self.aside if k[0] in wanted):
            batch_id, bucket = key
            taken += (
                self.take(self.generation, self.step, batch_id, bucket, self.aside.pop(key)) != "duplicate"
            )
        return taken

    def _fold(self, entry: _BucketSum) -> int:
        """Sum the held parts that continue the ids' order; the mean once the last is in. The very
        operations of `ShardOptimizer.step`'s mean over whole gradients (a clone of the first, `add_` of
        each in id order, one `div_`; one micro-batch's part as it came), on a slice of them: elementwise,
        so the same bits."""
        count = len(self.ids)
        folded = 0
        while entry.folded < count and self.ids[entry.folded] in entry.held:
            part = entry.held.pop(self.ids[entry.folded])
            if entry.total is None:
                if entry.out is not None:
                    entry.total = entry.out.copy_(part)
                else:
                    entry.total = part if count == 1 else part.clone()
            else:
                entry.total.add_(part)
            entry.folded += 1
            folded += 1
        if folded and entry.folded == count and count > 1:
            assert entry.total is not None
            entry.total.div_(count)
        return folded

    def whole(self, bucket: int) -> bool:
        """Whether every id's part of `bucket` is in (and summed)."""
        return self._sums[bucket].folded == len(self.ids)

    def to_apply(self) -> list[int]:
        """The buckets that are whole and not applied yet, in the shard's order."""
        return [
            b for b, entry in enumerate(self._sums) if entry.folded == len(self.ids) and not entry.applied
        ]

    def gradient(self, bucket: int) -> torch.Tensor:
        """The step's gradient of a whole bucket: the mean of its parts, summed in batch-id order."""
        entry = self._sums[bucket]
        if entry.total is None or not self.whole(bucket):
            raise FatalError(f"bucket {bucket} of shard {self.shard} is not whole at step {self.step}")
        return entry.total

    def applied(self, bucket: int) -> None:
        """The shell applied `bucket` (into the copy it does not publish); its sum is no longer needed."""
        entry = self._sums[bucket]
        if not self.whole(bucket) or entry.applied:
            raise FatalError(f"bucket {bucket} of shard {self.shard} applied twice or before it was whole")
        entry.applied = True
        entry.total = None

    def missing_parts(self, batch_id: int) -> list[int]:
        """The buckets of which no part of `batch_id` came (taken, or held aside)."""
        return [
            b
            for b, entry in enumerate(self._sums)
            if batch_id not in entry.taken and (batch_id, b) not in self.aside
        ]

    def seal(self, generation: int, step: int, batch_id: int, seal: Seal) -> bool:
        """A micro-batch's last frame here: every part of it came before it on the same connection (or
        from another member, for a duplicate id). False: that id was sealed already (a duplicate)."""
        self._check(generation, step, batch_id, "seal")
        if batch_id in self.sealed:
            self.duplicates += 1
            return False
        missing = self.missing_parts(batch_id)
        if missing:
            raise FatalError(f"batch {batch_id} sealed at shard {self.shard} without its buckets {missing}")
        self.sealed[batch_id] = seal
        return True

    @property
    def all_applied(self) -> bool:
        """Every bucket applied (into the copy not published)."""
        return all(entry.applied for entry in self._sums)

    @property
    def committable(self) -> bool:
        """Every id sealed, every bucket applied: the shard may publish the step's result."""
        return len(self.sealed) == len(self.ids) and self.all_applied

    @property
    def parts_held(self) -> int:
        """Parts held (or aside) or in a sum not applied yet: what this book keeps in memory, in micro-batch
        parts."""
        return len(self.aside) + sum(len(e.held) + (e.folded if not e.applied else 0) for e in self._sums)

    def buffers_in_order(self) -> list[Tensors]:
        """Every id's buffers in batch-id order (`ShardBuffers.update` takes them so), once all are in."""
        return [self.sealed[b].buffers for b in self.ids]

    def record(self, time: float) -> StepRecord:
        return StepRecord(
            self.step,
            self.generation,
            self.ids,
            {b: s.worker for b, s in self.sealed.items()},
            {b: s.loss for b, s in self.sealed.items()},
            time,
        )

    def drop(self) -> Undone:
        """A fence or a restore: what this open step held, for the shell to discard; the book is empty."""
        undone = Undone(
            self.generation,
            self.step,
            tuple(b for b, entry in enumerate(self._sums) if entry.applied),
            self.parts_held,
            tuple(sorted(self.sealed)),
        )
        self._sums = [_BucketSum(out=entry.out) for entry in self._sums]
        self.sealed = {}
        self.aside = {}
        return undone


@dataclass
class TwoCopies:
    """Which of a shard's two copies of its parameters, buffers and optimizer state loops read
    (`published`, at `version`), and which version the other copy still holds intact (`kept`; None once
    an apply of the open step wrote into it). The shard's own record of its version (`ShardState.copies`).

    The open step's buckets are applied out of place, from the published copy into the other one, so the
    published parameters stay those of `version` until the step commits, and a shard whose step is
    dropped has nothing to undo. Committing flips the copies, and the old one keeps the version before
    until the next step's first apply writes into it: a shard found one version ahead of a peer at a
    fence steps back by flipping again. That is always possible then: the next step's first bucket is
    whole only once gradients computed from every shard's new parameters came, which a peer still a
    version behind never published. A step applied in place (an optimizer with no out-of-place update,
    a step pushed whole, async mode), or a snapshot restored, leaves nothing to step back to."""

    version: int
    published: int = 0
    kept: int | None = None

    @property
    def writing(self) -> int:
        """The copy the open step's applies write into."""
        return 1 - self.published

    def apply_started(self) -> None:
        self.kept = None

    def commit(self) -> None:
        self.published, self.kept = self.writing, self.version
        self.version += 1

    def applied_in_place(self) -> None:
        """A step applied into the published copy itself."""
        self.version, self.kept = self.version + 1, None

    def restored(self, version: int) -> None:
        """A snapshot of `version` copied into the published copy."""
        self.version, self.kept = version, None

    def can_step_back_to(self, version: int) -> bool:
        """Whether the other copy holds `version` whole, the one before the published copy's."""
        return self.kept is not None and self.kept == version == self.version - 1

    def step_back(self) -> bool:
        """Back to the version before, where the other copy still holds it; False (nothing changed)
        where it does not."""
        if not self.can_step_back_to(self.version - 1):
            return False
        self.published, self.version, self.kept = self.writing, self.version - 1, None
        return True

    def counted_back(self) -> None:
        """A shard that holds no state (no copies) steps back by its count of steps alone."""
        self.version, self.kept = self.version - 1, None


Verdict = Literal["answer", "wait"]


def pull_verdict(generation: int, version: int, asked_generation: int, step: int) -> Verdict:
    """What a pull of a bucket of `step` gets from a shard of `generation` at `version`: "answer" (the
    published copy holds that step's parameters) or "wait" (the step before is open: the answer leaves
    when it commits). A pull of another generation is refused whatever its step: a loop of a generation
    fenced off, or one computed before a rollback, never reads parameters it could push gradients of; a
    pull of a step the shard is past, or two ahead, is the loop's to retry."""
    if asked_generation != generation:
        raise StaleGenerationError(asked_generation, generation, "pull")
    if step == version:
        return "answer"
    if step == version + 1:
        return "wait"
    raise RecoverableError(f"pull of a bucket of step {step}, but the shard is at step {version}")
