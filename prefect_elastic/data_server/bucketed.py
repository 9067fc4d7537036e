"""A shard's parts of the open step when gradients leave during backward (`overlap_push`): each micro-batch's
gradient of each bucket comes as a quiet frame of its own (op `part`), before the push that seals that
micro-batch (docs/design/overlapped-step.md).

`OpenBuckets` keeps the open step's `BucketBook`, which sums every bucket's parts in batch-id order as they
come, whoever sent them; at the commit the shard applies the mean those sums make, one flat run in the
shard's order: the very bits `ShardOptimizer.step` gives from whole gradients (each operation of the mean
is elementwise). The commit itself is unchanged: the shard applies the step when every micro-batch of it is
sealed (`SyncApplies`), and the seals leave a loop only after all its parts did.

Where the shard's optimizer has an out-of-place update (`other_copy.py`), each bucket is applied as soon
as it is whole, from the published copy into the other one, while the senders' backward still runs; the
commit then only applies what is left (the last bucket, usually) and publishes that copy (`finish`).
Small shards apply on the event loop; big ones in a thread, one bucket at a time, so the event loop goes
on reading parts meanwhile.

A member's own part of an id the shard asked a backup of is held aside (`take(aside=True)`, `BucketBook`):
it may have been computed on parameters a peer applied the step to from that backup, in place. It goes
into the sums only once its member confirms it (`confirm`); a backup's part (flagged so) replaces it.

Nothing is answered to a part: one of another generation, or of a step the shard applied without it (a
backup's copy came first), is dropped, and the seal after it on the same connection is refused for the
same reason. A part that does not fit the shard is a bug of the sender, kept and raised at the next push.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from ..errors import FatalError
from .bucket_book import BucketBook
from .optimizer import ShardOptimizer
from .other_copy import OtherCopy, copy_kind


def bucket_sizes(bounds: Sequence[Sequence[int]], numel: int, shard: int) -> list[int]:
    """The sizes of the buckets `bounds` names (`[start, stop)` of the shard's flat parameters, in order),
    which must tile the shard's `numel` elements."""
    at = 0
    sizes = []
    for bound in bounds:
        start, stop = (int(v) for v in bound)
        if start != at or stop <= start:
            raise FatalError(f"buckets {list(bounds)} do not tile the {numel} elements of shard {shard}")
        sizes.append(stop - start)
        at = stop
    if at != numel:
        raise FatalError(f"buckets {list(bounds)} cover {at} of the {numel} elements of shard {shard}")
    return sizes


class OpenBuckets:
    """The parts of the open step of shard `shard`."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.book: BucketBook | None = None
        self._bounds: list[list[int]] = []
        self.error: FatalError | None = None  # a part that did not fit, raised at the next push
        # The sums of every open step, one after the other: a step's parts come only once the step before
        # is applied (they need its parameters), so its gradient is never read after that.
        self._out: torch.Tensor | None = None
        self.taken = 0  # parts taken into a step's sums (duplicates and parts held aside left out)
        self.dropped = 0  # parts dropped with an open step (a fence, a restore)
        self.undone = 0  # buckets applied into the other copy, then dropped with their open step
        # The other copy of the shard's parameters the buckets are applied into, and the optimizer it
        # belongs to (a promotion makes a new one); None where that optimizer has no out-of-place update.
        self._copy: OtherCopy | None = None
        self._copy_of: ShardOptimizer | None = None
        self._applying: asyncio.Future[None] | None = None  # buckets applied in a thread, one by one
        self.apply_seconds = 0.0  # spent applying buckets before their step's commit

    def take(
        self,
        generation: int,
        step: int,
        batch_ids: Sequence[int],
        batch_id: int,
        bucket: int,
        bounds: list[list[int]],
        numel: int | None,
        run: torch.Tensor,
        aside: bool = False,
    ) -> None:
        """One micro-batch's gradient of one bucket of the open step `step` (its `batch_ids`), for the
        shard's `numel` parameter elements (None: it holds none); `aside`: a member's own part of an id the
        shard asked a backup of, held out of the sums (`BucketBook.take`)."""
        try:
            if numel is None:
                raise FatalError(f"a gradient in parts for shard {self.shard}, which holds no parameters")
            if self.book is None or (self.book.generation, self.book.step) != (generation, step):
                sizes = bucket_sizes(bounds, numel, self.shard)
                if self._out is None or self._out.dtype != run.dtype or self._out.numel() != numel:
                    self._out = torch.empty(numel, dtype=run.dtype)
                self.book = BucketBook(self.shard, sizes, generation, step, batch_ids, self._out)
                self._bounds = bounds
            elif bounds != self._bounds:
                raise FatalError(f"a part of shard {self.shard} with buckets {bounds}, not {self._bounds}")
            if self.book.take(generation, step, batch_id, bucket, run, aside) in ("held", "folded"):
                self.taken += 1
        except FatalError as exc:
            self.error = self.error or exc
        except Exception as exc:  # (nothing answers a part: what went wrong is told at the next push)
            self.error = self.error or FatalError(
                f"a part of batch {batch_id} failed at shard {self.shard}: {type(exc).__name__}: {exc}"
            )

    def confirm(self, generation: int, step: int, batch_ids: Sequence[int]) -> None:
        """The parts held aside of `batch_ids` go into the sums of `step` (their member confirmed them:
        `SyncApplies.confirm`)."""
        book = self.book
        if book is not None and (book.generation, book.step) == (generation, step):
            self.taken += book.confirm(batch_ids)

    def check_sealed(self, generation: int, step: int, batch_ids: Sequence[int]) -> None:
        """A push seals `batch_ids`: every part of each came before it on the same connection (or from
        another member, for an id a backup trained too). A part missing is a bug: it would hold the step
        open for good."""
        book = self.book
        if book is None or (book.generation, book.step) != (generation, step):
            raise FatalError(f"step {step} sealed at shard {self.shard} before any of its parts came")
        for b in batch_ids:
            if missing := book.missing_parts(b):
                raise FatalError(f"batch {b} sealed at shard {self.shard} without its buckets {missing}")

    def whole(self, generation: int, step: int) -> bool:
        """Whether every bucket of `step` holds every micro-batch's part."""
        book = self.book
        return (
            book is not None
            and (book.generation, book.step) == (generation, step)
            and all(book.whole(k) for k in range(len(book.sizes)))
        )

    def mean(self) -> torch.Tensor:
        """The open step's gradient, the mean over its micro-batches, as one flat run in the shard's order;
        the book is emptied."""
        book, self.book = self.book, None
        if book is None:
            raise FatalError(f"shard {self.shard} applies a step whose gradients came in parts, but has none")
        for k in range(len(book.sizes)):
            book.gradient(k)  # (raises unless every bucket is whole)
        assert self._out is not None  # (every book is made with it: the sums lie back to back there)
        return self._out

    def other_copy(self, optimizer: ShardOptimizer | None) -> OtherCopy | None:
        """The copy the open step's buckets are applied into, made on first use for `optimizer`; None where
        it has no out-of-place update (its steps are applied whole at the commit: `mean`)."""
        if optimizer is not self._copy_of:
            kind = copy_kind(optimizer) if optimizer is not None else None
            self._copy = OtherCopy(optimizer, kind) if optimizer is not None and kind is not None else None
            self._copy_of = optimizer
        return self._copy

    def made_copy(self, optimizer: ShardOptimizer | None) -> OtherCopy | None:
        """The other copy made for `optimizer` so far, if any (none is made here: a job that never sent
        parts pays nothing for it)."""
        return self._copy if optimizer is not None and optimizer is self._copy_of else None

    def ready(self) -> bool:
        """Whether a bucket of the open step is whole and not applied yet."""
        return self.book is not None and bool(self.book.to_apply())

    def apply_whole(self, copy: OtherCopy, inline: bool) -> None:
        """Apply every bucket of the open step that is whole into `copy`: now (`inline`), or in a thread,
        one bucket after another, while the event loop goes on (`applies_done` waits for them)."""
        if self.book is None or not self.book.to_apply():
            return
        if inline:
            self._apply_ready(self.book, copy)
        elif self._applying is None or self._applying.done():
            self._applying = asyncio.ensure_future(self._apply_in_thread(self.book, copy))

    def _apply_ready(self, book: BucketBook, copy: OtherCopy) -> None:
        began = time.perf_counter()
        for k in book.to_apply():
            start, stop = self._bounds[k]
            copy.apply(int(start), int(stop), book.gradient(k))
            book.applied(k)
        self.apply_seconds += time.perf_counter() - began

    async def _apply_in_thread(self, book: BucketBook, copy: OtherCopy) -> None:
        # (Until the book is dropped: `settle` waits for this before a fence drops it.)
        while self.book is book and (ready := book.to_apply()):
            start, stop = (int(v) for v in self._bounds[ready[0]])
            began = time.perf_counter()
            await asyncio.to_thread(copy.apply, start, stop, book.gradient(ready[0]))
            self.apply_seconds += time.perf_counter() - began
            book.applied(ready[0])

    async def applies_done(self) -> None:
        """Until the buckets being applied in a thread are (what went wrong there is raised here)."""
        applying, self._applying = self._applying, None
        if applying is not None:
            await applying

    async def finish(self, copy: OtherCopy, inline: bool) -> None:
        """The open step commits: its buckets not applied yet are (they are all whole), and the book is
        emptied; the caller then publishes `copy` (`OtherCopy.flip`)."""
        await self.applies_done()
        book = self.book
        if book is None:
            raise FatalError(f"shard {self.shard} commits a step whose gradients came in parts, but has none")
        if inline:
            self._apply_ready(book, copy)
        else:
            await asyncio.to_thread(self._apply_ready, book, copy)
        if not book.all_applied:
            raise FatalError(f"shard {self.shard} commits step {book.step} with buckets not applied")
        self.book = None

    def drop(self) -> None:
        """A fence or a restore: the open step's parts are dropped (its seals, if any, with it). A bucket
        applied into the other copy is dropped with them: that copy is not published. (The caller waited
        for the applies under way: `applies_done`.)"""
        if self.book is not None:
            self.dropped += self.book.parts_held
            self.undone += len(self.book.drop().applied)
        self.book = None
