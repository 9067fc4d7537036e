"""A shard's parts of the open step (`data_server/bucketed.py`): the buckets' ranges checked against the
shard, parts summed into the mean `ShardOptimizer.step` would take from whole gradients (same bits, in any
order of arrival), a seal without its parts refused, and a part that does not fit kept for the next push."""

from __future__ import annotations

import random

import pytest
import torch

from prefect_elastic.data_server.bucketed import OpenBuckets, bucket_sizes
from prefect_elastic.data_server.optimizer import _mean
from prefect_elastic.errors import FatalError

BOUNDS = [[0, 3], [3, 10], [10, 11]]
IDS = range(8, 12)


def test_bucket_ranges_must_tile_the_shards_parameters() -> None:
    assert bucket_sizes(BOUNDS, 11, 0) == [3, 7, 1]
    with pytest.raises(FatalError, match="cover 11 of the 12 elements of shard 1"):
        bucket_sizes(BOUNDS, 12, 1)
    with pytest.raises(FatalError, match="do not tile"):
        bucket_sizes([[0, 3], [4, 11]], 11, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parts_in_any_order_give_the_mean_of_the_whole_gradients_bit_for_bit(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Values whose sum in another order gives other bits.
    whole = {b: torch.randn(11, generator=generator) * 10.0 ** torch.randint(-6, 6, (11,)) for b in IDS}
    arrivals = [(b, k) for b in IDS for k in range(len(BOUNDS))]
    random.Random(seed).shuffle(arrivals)
    parts = OpenBuckets(shard=0)
    for b, k in arrivals:
        start, stop = BOUNDS[k]
        parts.take(1, 2, IDS, b, k, BOUNDS, 11, whole[b][start:stop].clone())
    parts.check_sealed(1, 2, list(IDS))
    assert parts.whole(1, 2) and not parts.whole(1, 3) and parts.error is None
    assert torch.equal(parts.mean(), _mean([whole[b] for b in IDS]))
    assert parts.book is None, "the mean empties the book"


def test_a_seal_without_its_parts_and_a_part_that_does_not_fit() -> None:
    parts = OpenBuckets(shard=3)
    with pytest.raises(FatalError, match="step 2 sealed at shard 3 before any of its parts came"):
        parts.check_sealed(1, 2, [8])
    parts.take(1, 2, IDS, 8, 0, BOUNDS, 11, torch.zeros(3))
    with pytest.raises(FatalError, match=r"batch 8 sealed at shard 3 without its buckets \[1, 2\]"):
        parts.check_sealed(1, 2, [8])
    assert not parts.whole(1, 2)
    parts.take(1, 2, IDS, 9, 1, BOUNDS, 11, torch.zeros(6))  # (a bucket of 7 elements)
    assert isinstance(parts.error, FatalError) and "came with 6 elements, not 7" in str(parts.error)
    parts.take(1, 2, IDS, 9, 0, [[0, 11]], 11, torch.zeros(11))
    assert "came with 6 elements" in str(parts.error), "the first error is the one kept"
    other = OpenBuckets(shard=0)
    other.take(1, 2, IDS, 8, 0, BOUNDS, None, torch.zeros(3))
    assert "holds no parameters" in str(other.error)


def test_a_part_held_for_the_ids_before_it_is_a_copy_and_the_first_goes_into_the_sum() -> None:
    """A part may be a view of memory its sender waits to reuse (an inbox slot): the shard keeps none."""
    parts = OpenBuckets(shard=0)
    later = torch.full((3,), 2.0)
    parts.take(1, 2, IDS, 9, 0, BOUNDS, 11, later)  # held: id 8 has not come
    assert parts.book is not None
    held = parts.book._sums[0].held[9]
    assert held is not later and held.data_ptr() != later.data_ptr() and torch.equal(held, later)
    first = torch.full((3,), 4.0)
    parts.take(1, 2, IDS, 8, 0, BOUNDS, 11, first)
    total = parts.book._sums[0].total
    assert total is not None and total.data_ptr() != first.data_ptr(), "copied into the shard's sum"
    assert torch.equal(total, torch.full((3,), 6.0)) and not parts.book._sums[0].held
