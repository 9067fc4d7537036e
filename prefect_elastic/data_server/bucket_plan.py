"""The bucket plan of the overlapped step: which pieces of each shard's parameters travel together.

Pure: every process computes it from the sharding plan (`plan.plan_pieces`) and the parameters' sizes and
dtypes, the same way, so a bucket's number means the same on a compute loop and on its shard; nothing here
touches a cluster (docs/design/overlapped-step.md).

A bucket belongs to one shard and is a contiguous range `[start, stop)` of that shard's flat parameters
(`ShardOptimizer.flat`, the shard's pieces in the plan's order), cut at piece edges: so a shard sums, applies
and answers a bucket as one run of elements, views of the tensors it already holds, and the sum of a
bucket's parts is bit for bit the slice of the whole step's sum (every operation of it is elementwise).
Which bucket is ready first during backward is not part of the plan: a loop sees it (the hooks of
`compute/buckets.py`); `ready_order` gives the order a plain backward makes them in, DDP's first guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..sharding import Piece

# DDP's default bucket (`bucket_cap_mb=25`) and its first bucket (`_DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB).
DDP_BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20
# A shard's parameters come in about this many buckets where DDP's 25 MiB would give too few to overlap
# anything: a 45 MB ResNet-18 on one shard would travel in two, the second leaving after backward ends.
# Fewer and bigger buckets cost fewer frames (about 0.1-0.3 ms of Python each, step-channel.md); the
# tail that cannot overlap is the last bucket backward finishes, the one holding the model's first layers,
# which the first-bucket cap keeps small anyway.
BUCKETS_PER_SHARD = 8
# Not smaller than this: below it a frame's fixed cost outweighs what overlapping its bytes saves.
SMALLEST_BUCKET_BYTES = 256 * 2**10


@dataclass(frozen=True)
class Bucket:
    """Bucket `index` of shard `shard` (numbered in the shard's order): its `pieces`, in the shard's order,
    the elements `[start, stop)` of the shard's flat parameters, all of `dtype`."""

    shard: int
    index: int
    pieces: tuple[Piece, ...]
    start: int
    stop: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)


def bucket_bytes(shard_bytes: int, per_shard: int = BUCKETS_PER_SHARD) -> int:
    """The cap of a shard's buckets: DDP's 25 MiB, scaled down to about `per_shard` buckets of the
    shard's `shard_bytes`, and not under `SMALLEST_BUCKET_BYTES`."""
    return min(DDP_BUCKET_BYTES, max(SMALLEST_BUCKET_BYTES, -(-shard_bytes // per_shard)))


def plan_buckets(
    plan: Sequence[Sequence[Piece]],
    params: Mapping[str, torch.Tensor],
    cap: int | None = None,
    first_cap: int = FIRST_BUCKET_BYTES,
) -> list[list[Bucket]]:
    """Each shard's buckets, in the shard's order. `plan`: every shard's pieces (`plan_pieces`; buffers
    among them are left out: only `params` have gradients); `params`: the model's parameters by name (meta
    tensors will do: only dtype and size are read); `cap`: the most bytes of a bucket (by default
    `bucket_bytes` of the shard's parameter bytes).

    Pieces are dealt in the shard's order into the open bucket until the next would take it past the cap,
    or is of another dtype; a piece larger than the cap is a bucket of its own (its gradient is ready all
    at once: cut, it would only cost more frames while backward still runs). The shard's first bucket is
    capped at `first_cap` too (DDP's first bucket): it holds the parameters forward needs first and
    backward finishes last, so it is the tail of the push after backward and the head of the pull before
    forward. So a piece that opens the shard larger than that cap (the 10 MB first weight of a 51 MB MLP)
    is cut: a first run of `first_cap`, then runs of the cap, a bucket each. They pipeline what follows
    backward: the shard sums and applies one while the next is on its way, where one bucket would cross,
    then be summed, then be applied."""
    shards: list[list[Bucket]] = []
    for shard, pieces in enumerate(plan):
        held = [p for p in pieces if p.name in params]
        total = sum(p.numel * params[p.name].dtype.itemsize for p in held)
        limit = cap if cap is not None else bucket_bytes(total)
        shards.append(_cut(shard, held, params, limit, first_cap))
    return shards


def _cut(
    shard: int, held: list[Piece], params: Mapping[str, torch.Tensor], limit: int, first_cap: int
) -> list[Bucket]:
    groups: list[list[Piece]] = []
    size = 0
    for whole in held:
        itemsize = params[whole.name].dtype.itemsize
        for p in _runs(whole, itemsize, limit, first_cap) if not groups else [whole]:
            nbytes = p.numel * itemsize
            room = min(limit, first_cap) if len(groups) <= 1 else limit
            current = groups[-1] if groups else None
            if current is None or (
                size + nbytes > room or params[p.name].dtype != params[current[0].name].dtype
            ):
                groups.append([p])
                size = nbytes
            else:
                current.append(p)
                size += nbytes
    buckets: list[Bucket] = []
    start = 0
    for index, group in enumerate(groups):
        stop = start + sum(p.numel for p in group)
        buckets.append(Bucket(shard, index, tuple(group), start, stop, params[group[0].name].dtype))
        start = stop
    return buckets


def _runs(piece: Piece, itemsize: int, limit: int, first: int) -> list[Piece]:
    """The piece that opens a shard: as it is where it fits in `first` bytes, else cut into a run of
    `first` and runs of `limit`."""
    if piece.numel * itemsize <= first:
        return [piece]
    runs: list[Piece] = []
    at = piece.start
    while at < piece.stop:
        room = max(1, (first if not runs else limit) // itemsize)
        stop = min(piece.stop, at + room)
        runs.append(Piece(piece.name, at, stop, piece.size))
        at = stop
    return runs


def ready_order(buckets: Iterable[Bucket], order: Sequence[str]) -> list[Bucket]:
    """`buckets` in the order a backward that finishes the tensors' gradients in `order` (names) makes
    them whole: each when the last of its tensors is done. A tensor `order` does not name (a parameter the
    step did not use) counts as done at the end, as a loop sends it then (`compute.buckets.finish`). For
    DDP's first guess, `order` is the model's parameters reversed."""
    place = {name: i for i, name in enumerate(order)}
    end = len(place)
    return sorted(buckets, key=lambda b: (max(place.get(n, end) for n in b.names), b.shard, b.index))


def needed_order(buckets: Iterable[Bucket], order: Sequence[str]) -> list[Bucket]:
    """`buckets` in the order a forward that first uses the tensors in `order` (names; by default the
    model's order) needs them: each when the first of its tensors is used. The order a shard answers a
    pull in, bucket by bucket."""
    place = {name: i for i, name in enumerate(order)}
    end = len(place)
    return sorted(buckets, key=lambda b: (min(place.get(n, end) for n in b.names), b.shard, b.index))


def bucket_of_tensor(plan: Sequence[Sequence[Bucket]]) -> dict[str, list[tuple[Bucket, Piece]]]:
    """Every parameter's name with the buckets that hold a piece of it (several for a tensor split across
    shards), in shard order."""
    found: dict[str, list[tuple[Bucket, Piece]]] = {}
    for buckets in plan:
        for bucket in buckets:
            for p in bucket.pieces:
                found.setdefault(p.name, []).append((bucket, p))
    return found
