"""The bucket plan of the overlapped step (`bucket_plan.py`), without a cluster: every parameter element in
one bucket of the shard that holds it, each bucket a contiguous run of that shard's flat parameters, sized
from the shard's bytes, and the order a backward makes them whole in."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from prefect_elastic.data_server.bucket_plan import (
    DDP_BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    SMALLEST_BUCKET_BYTES,
    bucket_bytes,
    needed_order,
    plan_buckets,
    ready_order,
)
from prefect_elastic.sharding import Piece, part, plan_pieces


def model() -> nn.Module:
    # A small stem, a layer far larger than a share (split across shards), BatchNorm buffers, a head.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3),
        nn.BatchNorm2d(16),
        nn.Flatten(),
        nn.Linear(16 * 6 * 6, 400),
        nn.ReLU(),
        nn.Linear(400, 300),
        nn.Linear(300, 10),
    )


def state_and_params(net: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return dict(net.state_dict()), dict(net.named_parameters())


def shard_flat(pieces: list[Piece], params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A shard's flat parameters as `ShardOptimizer` holds them: its parameter pieces in the plan's order."""
    return torch.cat([part(params[p.name].detach(), p).reshape(-1) for p in pieces if p.name in params])


def joined(pieces: list[Piece]) -> list[Piece]:
    """Runs of one tensor that follow each other, joined back into one piece."""
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].name == p.name and out[-1].stop == p.start:
            out[-1] = Piece(p.name, out[-1].start, p.stop, p.size)
        else:
            out.append(p)
    return out


def test_the_piece_that_opens_a_shard_goes_in_runs_where_it_is_larger_than_the_first_buckets_cap() -> None:
    params = {"first.weight": torch.zeros(2000), "first.bias": torch.zeros(10), "last": torch.zeros(2500)}
    plan = [[Piece(n, 0, t.numel(), t.numel()) for n, t in params.items()]]
    (held,) = plan_buckets(plan, params, cap=4000, first_cap=1200)
    assert [[(p.name, p.start, p.stop) for p in b.pieces] for b in held] == [
        [("first.weight", 0, 300)],  # (1200 bytes: the first bucket's cap)
        [("first.weight", 300, 1300)],  # (4000 bytes: the cap)
        [("first.weight", 1300, 2000), ("first.bias", 0, 10)],
        [("last", 0, 2500)],  # (larger than the cap, but backward has it early: one bucket)
    ]


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("cap", [None, 4096, 64 * 1024])
def test_buckets_cut_each_shards_flat_parameters_into_contiguous_runs(shards: int, cap: int | None) -> None:
    state, params = state_and_params(model())
    plan = plan_pieces(state, shards)
    buckets = plan_buckets(plan, params, cap=cap, first_cap=2048)
    assert len(buckets) == shards
    for shard, (pieces, held) in enumerate(zip(plan, buckets, strict=True)):
        flat = shard_flat(pieces, params)
        # Contiguous, in order, covering the shard's flat parameters once; buffers are in none.
        assert [b.index for b in held] == list(range(len(held)))
        assert all(b.shard == shard for b in held)
        assert [b.start for b in held] == [0, *[b.stop for b in held[:-1]]]
        assert (held[-1].stop if held else 0) == flat.numel()
        # The shard's pieces, in order; one larger than the cap cut into runs of it, which join back.
        assert joined([p for b in held for p in b.pieces]) == [p for p in pieces if p.name in params]
        assert not {n for b in held for n in b.names} & {n for n in state if n not in params}
        for b in held:
            # A bucket's run is the slice of the flat parameters, bit for bit.
            run = torch.cat([part(params[p.name].detach(), p).reshape(-1) for p in b.pieces])
            assert torch.equal(run, flat[b.start : b.stop])
            limit = cap if cap is not None else bucket_bytes(flat.numel() * 4)
            if b.index == 0:
                limit = min(limit, 2048)
            assert b.nbytes <= limit or (len(b.pieces) == 1 and b.index > 0), (b.names, b.nbytes, limit)
    # Every element of every parameter lies in exactly one bucket.
    for name, p in params.items():
        runs = sorted((q.start, q.stop) for held in buckets for b in held for q in b.pieces if q.name == name)
        assert runs[0][0] == 0 and runs[-1][1] == p.numel()
        assert all(a[1] == c[0] for a, c in itertools.pairwise(runs))


def test_a_split_tensor_lies_in_buckets_of_two_shards() -> None:
    state, params = state_and_params(model())
    plan = plan_pieces(state, 2)
    split = {p.name for pieces in plan for p in pieces if not p.whole}
    assert split, "the plan should split the large layer (else this test shows nothing)"
    buckets = plan_buckets(plan, params)
    for name in split:
        assert len({b.shard for held in buckets for b in held if name in b.names}) == 2


def test_the_cap_scales_ddp_s_default_down_to_the_shard() -> None:
    assert bucket_bytes(45 * 10**6) == -(-45 * 10**6 // 8)  # a ResNet-18 on one shard: about 5.6 MB
    assert bucket_bytes(10**9) == DDP_BUCKET_BYTES  # a large shard: DDP's 25 MiB
    assert bucket_bytes(100_000) == SMALLEST_BUCKET_BYTES  # a small one: one or two buckets
    assert bucket_bytes(45 * 10**6) > FIRST_BUCKET_BYTES


def test_a_bucket_holds_one_dtype() -> None:
    params = {"a": torch.zeros(10), "b": torch.zeros(10, dtype=torch.float64), "c": torch.zeros(10)}
    plan = [[Piece(n, 0, 10, 10) for n in params]]
    (held,) = plan_buckets(plan, params, cap=10**6, first_cap=10**6)
    assert [(b.names, b.dtype) for b in held] == [
        (("a",), torch.float32),
        (("b",), torch.float64),
        (("c",), torch.float32),
    ]


def test_backward_makes_the_first_layers_bucket_whole_last_and_forward_needs_it_first() -> None:
    state, params = state_and_params(model())
    buckets = [b for held in plan_buckets(plan_pieces(state, 2), params, cap=8192) for b in held]
    names = list(params)
    backward = ready_order(buckets, list(reversed(names)))
    forward = needed_order(buckets, names)
    first = next(b for b in buckets if names[0] in b.names)
    assert backward[-1] == first and forward[0] == first
    assert sorted(backward, key=lambda b: (b.shard, b.index)) == sorted(
        buckets, key=lambda b: (b.shard, b.index)
    )
    # A bucket is whole once its last tensor is: with one name left out (unused), its bucket comes last.
    unused = names[-1]
    late = ready_order(buckets, [n for n in reversed(names) if n != unused])
    assert unused in late[-1].names


def test_a_shard_without_parameters_has_no_buckets() -> None:
    # (A shard that holds only buffers, or nothing: it still seals every id of a step.)
    assert plan_buckets([[Piece("running", 0, 4, 4)], []], {}) == [[], []]
