"""When a compute loop sends its gradients during backward (`compute.bucket_push.bucket_push_for`): where the
job asks, or left to the engine for a model of `OVERLAP_MIN_BYTES` or more; never for a shard of mixed
dtypes, whose sums could not be one flat run."""

from __future__ import annotations

import torch

from prefect_elastic.compute.bucket_push import OVERLAP_MIN_BYTES, BucketPush, bucket_push_for, cores_short
from prefect_elastic.sharding import Piece


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


def test_the_overlap_is_left_off_only_where_loops_and_data_servers_share_too_few_cores() -> None:
    """`cores_short`: a machine counts where it runs compute loops (their torch threads each) and data
    servers holding parameters (one each) together, on fewer cores than that."""
    hosts = {"tcp://a:1": "a", "tcp://a:2": "a", "tcp://a:3": "a", "tcp://b:1": "b", "tcp://b:2": "b"}
    servers, on_a = ["tcp://a:1", "tcp://a:2"], ["tcp://a:3"]
    # 2 data servers and a loop of 1 thread on 2 cores (this repository's test machine): short.
    assert cores_short(hosts, {"a": 2, "b": 2}, servers, on_a, 1) == ["a"]
    # The same on 16 cores: each has a core of its own.
    assert cores_short(hosts, {"a": 16, "b": 2}, servers, on_a, 1) == []
    # ... unless the loop's threads take them: 2 data servers and 15 torch threads on 16 cores.
    assert cores_short(hosts, {"a": 16}, servers, on_a, 15) == ["a"]
    # Loops on another machine than the data servers: the shards' work is on cores of their own.
    assert cores_short(hosts, {"a": 2, "b": 1}, servers, ["tcp://b:1", "tcp://b:2"], 1) == []
    # A machine whose cores are not known is not counted; no loop at all, nothing is short.
    assert cores_short(hosts, {"b": 2}, servers, on_a, 1) == []
    assert cores_short(hosts, {"a": 1}, servers, [], 1) == []
