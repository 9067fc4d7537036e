"""A shard's parts of the open step when gradients leave during backward (`overlap_push`): each micro-batch's
gradient of each bucket comes as a quiet frame of its own (op `part`), before the push that seals that
micro-batch (docs/design/overlapped-step.md).

`OpenBuckets` keeps the open step's `BucketBook`, which sums every bucket's parts in batch-id order as they
come, whoever sent them; at the commit the shard applies the mean those sums make, one flat run in the
shard's order: the very bits `ShardOptimizer.step` gives from whole gradients (each operation of the mean
is elementwise). The commit itself is unchanged: the shard applies the step when every micro-batch of it is
sealed (`SyncCommits`), and the seals leave a loop only after all its parts did.

Nothing is answered to a part: one of another generation, or of a step the shard applied without it (a
backup's copy came first), is dropped, and the seal after it on the same connection is refused for the
same reason. A part that does not fit the shard is a bug of the sender, kept and raised at the next push.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import FatalError
from .bucket_book import BucketBook


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
        self.taken = 0  # parts taken into a step's sums (duplicates left out)
        self.dropped = 0  # parts dropped with an open step (a fence, a restore)

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
    ) -> None:
        """One micro-batch's gradient of one bucket of the open step `step` (its `batch_ids`), for the
        shard's `numel` parameter elements (None: it holds none)."""
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
            if self.book.take(generation, step, batch_id, bucket, run) != "duplicate":
                self.taken += 1
        except FatalError as exc:
            self.error = self.error or exc
        except Exception as exc:  # (nothing answers a part: what went wrong is told at the next push)
            self.error = self.error or FatalError(
                f"a part of batch {batch_id} failed at shard {self.shard}: {type(exc).__name__}: {exc}"
            )

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

    def drop(self) -> None:
        """A fence or a restore: the open step's parts are dropped (its seals, if any, with it)."""
        if self.book is not None:
            self.dropped += self.book.parts_held
        self.book = None
