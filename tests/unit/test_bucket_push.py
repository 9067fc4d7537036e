"""When a compute loop sends its gradients during backward (`compute.bucket_push.bucket_push_for`): where the
job asks, or left to the engine for a model of `OVERLAP_MIN_BYTES` or more; never for a shard of mixed
dtypes, whose sums could not be one flat run."""

from __future__ import annotations

import torch

from prefect_elastic.compute.bucket_push import OVERLAP_MIN_BYTES, BucketPush, bucket_push_for
from prefect_elastic.data_server.plan import Piece


def meta(*sizes: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.empty(n, device="meta", dtype=dtype) for i, n in enumerate(sizes)}


def whole(params: dict[str, torch.Tensor]) -> list[list[Piece]]:
    """Every tensor whole, alternating between two shards."""
    plan: list[list[Piece]] = [[], []]
    for i, (name, t) in enumerate(params.items()):
        plan[i % 2].append(Piece(name, 0, t.numel(), t.numel()))
    return plan


def test_left_to_the_engine_a_big_model_sends_during_backward_and_a_small_one_after() -> None:
    big = meta(OVERLAP_MIN_BYTES // 4 // 2, OVERLAP_MIN_BYTES // 4 // 2)  # 16 MiB of float32
    small = meta(1000, 2000)
    assert isinstance(bucket_push_for(None, whole(big), big), BucketPush)
    assert bucket_push_for(None, whole(small), small) is None
    pushed = bucket_push_for(True, whole(small), small)
    assert isinstance(pushed, BucketPush) and pushed.gets_parts == [True, True]
    assert pushed.bounds == [[[0, 1000]], [[0, 2000]]], "each shard's buckets as ranges of its flat run"
    assert bucket_push_for(False, whole(big), big) is None


def test_a_shard_of_mixed_dtypes_pushes_whole() -> None:
    mixed = {**meta(1000), "p1": torch.empty(10, device="meta", dtype=torch.float64), **{"p2": meta(5)["p0"]}}
    plan = [[Piece("p0", 0, 1000, 1000), Piece("p1", 0, 10, 10)], [Piece("p2", 0, 5, 5)]]
    assert bucket_push_for(True, plan, mixed) is None
