"""The overlapped step's pure parts together, without a cluster: two workers' micro-batches computed on a
real model, their buckets handed over by the backward hooks in backward order, summed by two shards'
books, each bucket applied when whole into the copy not published, the step committed at the seals; the
parameters each shard publishes are bit for bit those of today's step (`ShardOptimizer.step` over whole
gradients in batch-id order), step after step, with a tensor split across the two shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from prefect_elastic.compute.buckets import BucketHooks
from prefect_elastic.data_server.bucket_apply import sgd_into
from prefect_elastic.data_server.bucket_book import BucketBook, Seal, TwoCopies
from prefect_elastic.data_server.bucket_plan import Bucket, plan_buckets
from prefect_elastic.data_server.optimizer import ShardOptimizer
from prefect_elastic.job import ElasticJob
from prefect_elastic.sharding import Piece, cut, join, part, plan_pieces

LR, MOMENTUM = 0.05, 0.9
IDS_PER_STEP = 4


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 300), nn.ReLU(), nn.Linear(300, 10)
    )  # fmt: skip


class Shard:
    """One data server's side of the overlapped step: two copies of its flat parameters and momentum."""

    def __init__(self, index: int, flat: torch.Tensor, buckets: list[Bucket]) -> None:
        self.index = index
        self.buckets = buckets
        self.params = [flat.clone(), torch.zeros_like(flat)]
        self.momentum = [torch.zeros_like(flat), torch.zeros_like(flat)]
        self.copies = TwoCopies(version=0)
        self.book = BucketBook(index, [b.numel for b in buckets], 1, 0, range(IDS_PER_STEP))
        self.committed = 0

    def published(self) -> torch.Tensor:
        return self.params[self.copies.published]

    def apply_whole_buckets(self) -> None:
        src, dst = self.copies.published, self.copies.writing
        for k in self.book.to_apply():
            self.copies.apply_started()
            a, z = self.buckets[k].start, self.buckets[k].stop
            sgd_into(
                self.params[src][a:z],
                self.momentum[src][a:z] if self.copies.version > 0 else None,  # (torch's first step)
                self.book.gradient(k),
                self.params[dst][a:z],
                self.momentum[dst][a:z],
                lr=LR,
                momentum_factor=MOMENTUM,
            )
            self.book.applied(k)

    def commit_if_sealed(self, next_ids: range) -> None:
        if self.book.committable:
            self.copies.commit()
            self.committed += 1
            self.book = BucketBook(
                self.index, [b.numel for b in self.buckets], 1, self.copies.version, next_ids
            )


Batch = tuple[torch.Tensor, torch.Tensor]


def gradient(meta: nn.Module, params: dict[str, torch.Tensor], batch: Batch) -> list[torch.Tensor]:
    """A micro-batch's gradient as a compute loop computes it."""
    x, y = batch
    loss = F.cross_entropy(functional_call(meta, params, (x,)), y)
    return list(torch.autograd.grad(loss, list(params.values())))


def backward_into(
    shards: list[Shard],
    buckets: list[list[Bucket]],
    leaves: dict[str, torch.Tensor],
    meta: nn.Module,
    batches: dict[int, Batch],
    workers: list[list[int]],
    step: int,
) -> None:
    """Each worker's share computed in turn, every bucket taken by its shard's book the moment backward
    hands it over, and applied as soon as it is whole."""
    current: list[int] = []

    def take(bucket: Bucket, run: torch.Tensor) -> None:
        shard = shards[bucket.shard]
        shard.book.take(1, step, current[0], bucket.index, run)
        shard.apply_whole_buckets()

    hooks = BucketHooks(buckets, leaves, take)
    for share in workers:
        for b in share:
            current[:] = [b]
            gradient(meta, leaves, batches[b])
            hooks.finish()
    hooks.remove()


def param_pieces(plan: list[list[Piece]], params: dict[str, torch.Tensor]) -> list[list[Piece]]:
    return [[p for p in pieces if p.name in params] for pieces in plan]


@pytest.mark.parametrize("order", ["in id order", "the second worker first"])
def test_two_workers_overlapped_steps_give_todays_parameters_bit_for_bit(order: str) -> None:
    model = net()
    meta = net().to("meta")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = param_pieces(plan_pieces(dict(start), 2), start)
    assert any(not p.whole for pieces in plan for p in pieces), "a tensor should be split across the shards"
    buckets = plan_buckets(plan, start, cap=4096, first_cap=1024)
    assert all(len(held) >= 2 for held in buckets) and sum(map(len, buckets)) > 5
    job = ElasticJob(
        job_id="o",
        model="tests.models:mlp",
        dataset="file:///x.npz",
        optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM},
    )
    today = [ShardOptimizer(job.model_spec, cut(start, pieces)) for pieces in plan]
    shards = [
        Shard(i, torch.cat([t.reshape(-1) for t in cut(start, pieces).values()]), held)
        for i, (pieces, held) in enumerate(zip(plan, buckets, strict=True))
    ]
    shapes = {n: t.shape for n, t in start.items()}
    generator = torch.Generator().manual_seed(5)
    for step in range(3):
        ids = range(step * IDS_PER_STEP, (step + 1) * IDS_PER_STEP)
        batches = {b: (torch.randn(2, 3, 8, 8, generator=generator), torch.randint(0, 10, (2,))) for b in ids}

        # Today: each shard takes every id's whole gradient and steps once, in id order.
        whole = {
            n: t.clone().requires_grad_(True)
            for n, t in join([o.params for o in today], plan, shapes).items()
        }
        per_id = [dict(zip(whole, gradient(meta, whole, batches[b]), strict=True)) for b in ids]
        for shard, pieces in zip(today, plan, strict=True):
            grads = [torch.cat([part(g[p.name], p).reshape(-1) for p in pieces]) for g in per_id]
            shard.step(grads)

        # Overlapped: each worker computes its ids (rank r: ids j % 2 == r), its hooks hand each bucket to
        # its shard's book as backward completes it, and every whole bucket is applied at once.
        published = join(
            [
                dict(
                    zip([p.name for p in pieces], s.published().split([p.numel for p in pieces]), strict=True)
                )
                for s, pieces in zip(shards, plan, strict=True)
            ],
            plan,
            shapes,
        )
        leaves = {n: t.view(shapes[n]).clone().requires_grad_(True) for n, t in published.items()}
        workers = [[b for j, b in enumerate(ids) if j % 2 == rank] for rank in (0, 1)]
        if order != "in id order":
            workers.reverse()
        backward_into(shards, buckets, leaves, meta, batches, workers, step)
        for shard in shards:
            assert shard.committed == step  # every bucket is in, none sealed: nothing published yet
            for share in workers:
                for b in share:
                    shard.book.seal(1, step, b, Seal(f"w{b % 2}", 0.0, {}))
            shard.commit_if_sealed(range((step + 1) * IDS_PER_STEP, (step + 2) * IDS_PER_STEP))
            assert shard.committed == step + 1
        for shard, reference in zip(shards, today, strict=True):
            assert reference.flat is not None
            assert torch.equal(shard.published(), reference.flat), (order, step, shard.index)
