"""The compute side of the overlapped step (`compute/buckets.py`) on a real torch model, without a
cluster: each bucket handed over the moment backward has its last gradient, in backward's order, its run
bit for bit the gradients' (after `backward()` and through `torch.autograd.grad`), and a forward whose
modules wait for their own parameters only."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from prefect_elastic.compute.buckets import BucketHooks, ForwardGate, key, module_needs, unguarded
from prefect_elastic.data_server.bucket_plan import Bucket, needed_order, plan_buckets, ready_order
from prefect_elastic.sharding import part, plan_pieces


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 300),  # 86,400 weights: split across two shards
        nn.ReLU(),
        nn.Linear(300, 10),
    )


def setup(
    shards: int = 2, cap: int = 8192
) -> tuple[nn.Module, list[list[Bucket]], torch.Tensor, torch.Tensor]:
    model = net()
    plan = plan_pieces(dict(model.state_dict()), shards)
    assert any(not p.whole for pieces in plan for p in pieces) or shards == 1
    buckets = plan_buckets(plan, dict(model.named_parameters()), cap=cap, first_cap=2048)
    generator = torch.Generator().manual_seed(1)
    return (
        model,
        buckets,
        torch.randn(4, 3, 8, 8, generator=generator),
        torch.randint(0, 10, (4,), generator=generator),
    )


def shard_runs(buckets: list[list[Bucket]], grads: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each shard's gradient as it is pushed today: its pieces' gradients back to back, in its order."""
    return [
        torch.cat([part(grads[p.name], p).reshape(-1) for b in held for p in b.pieces]) for held in buckets
    ]


def joined(sent: list[tuple[Bucket, torch.Tensor]], shards: int) -> list[torch.Tensor]:
    """What each shard holds once every bucket came: the runs in its order."""
    return [
        torch.cat([run for b, run in sorted(sent, key=lambda s: s[0].index) if b.shard == i])
        for i in range(shards)
    ]


@pytest.mark.parametrize("shards", [1, 2])
def test_buckets_after_backward_are_the_grads_bit_for_bit_in_backward_order(shards: int) -> None:
    model, buckets, x, y = setup(shards)
    params = dict(model.named_parameters())
    finished: list[str] = []
    for name, p in params.items():  # (registered first: runs before the bucket hook of the same leaf)
        p.register_post_accumulate_grad_hook(lambda t, name=name: finished.append(name))
    sent: list[tuple[Bucket, torch.Tensor]] = []
    hooks = BucketHooks(buckets, params, lambda b, run: sent.append((b, run)), accumulate=True)
    F.cross_entropy(model(x), y).backward()
    assert hooks.finish() == [b for b, _ in sent]
    everything = [b for held in buckets for b in held]
    assert len(sent) == len(everything) > 4
    # In the order backward finished them, each as soon as its last gradient was in.
    assert [b for b, _ in sent] == ready_order(everything, finished)
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    for got, expected in zip(joined(sent, shards), shard_runs(buckets, grads), strict=True):
        assert torch.equal(got, expected)
    for bucket, run in sent:
        assert run.numel() == bucket.numel and run.dtype == bucket.dtype
    hooks.remove()


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = net()
        self.unused = nn.Linear(2, 2)  # never called: autograd hands back no gradient for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def test_through_autograd_grad_as_the_trainer_computes_with_an_unused_parameter() -> None:
    _, _, x, y = setup(2)
    real = WithUnused()
    meta = WithUnused().to("meta")
    params = {n: p.detach().clone().requires_grad_(True) for n, p in real.named_parameters()}
    buffers = {n: b.clone() for n, b in real.named_buffers()}
    buckets = plan_buckets(plan_pieces({**params, **buffers}, 2), params, cap=8192, first_cap=2048)
    sent: list[tuple[Bucket, torch.Tensor]] = []
    hooks = BucketHooks(buckets, params, lambda b, run: sent.append((b, run)))
    loss = F.cross_entropy(functional_call(meta, {**params, **buffers}, (x,)), y)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
    during = len(sent)
    hooks.finish()
    unused = [b for b, _ in sent[during:]]
    assert unused and all(set(b.names) & {"unused.weight", "unused.bias"} for b in unused)
    by_name = dict(zip(params, grads, strict=True))
    for got, expected in zip(joined(sent, 2), shard_runs(buckets, by_name), strict=True):
        assert torch.equal(got, expected)
    # Armed again: a second micro-batch hands over every bucket once more.
    count = len(sent)
    loss = F.cross_entropy(functional_call(meta, {**params, **buffers}, (x[:2],)), y[:2])
    torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
    assert len(hooks.finish()) == count == len(sent) - count
    hooks.remove()


def test_a_tied_weight_goes_once_with_both_uses_summed() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 6)
            self.head = nn.Linear(6, 20, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.embed(x))
            return out

    torch.manual_seed(0)
    model = Tied()
    params = dict(model.named_parameters())  # (one entry: the tie)
    buckets = plan_buckets(plan_pieces(dict(params), 1), params)
    sent: list[tuple[Bucket, torch.Tensor]] = []
    hooks = BucketHooks(buckets, params, lambda b, run: sent.append((b, run)), accumulate=True)
    x = torch.randint(0, 20, (5,))
    F.cross_entropy(model(x), x).backward()
    hooks.finish()
    assert len(sent) == 1
    assert torch.equal(sent[0][1], model.embed.weight.grad.reshape(-1))


def test_a_gated_forward_waits_for_each_modules_own_buckets_and_computes_what_an_ungated_one_does() -> None:
    model, buckets, x, _ = setup(2, cap=4096)
    truth = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = model(x)
    # The step's parameters, empty until their bucket arrives (the loop writes a bucket's bytes into place).
    leaves = {n: torch.zeros_like(t).requires_grad_(True) for n, t in truth.items()}
    answers = needed_order([b for held in buckets for b in held], list(truth))
    # Each shard sends its buckets in forward order; the gate reads from the shard it needs next.
    supply = {s: iter([b for b in answers if b.shard == s]) for s in range(len(buckets))}
    when: dict[str, int] = {}

    def receive(wanted: tuple[int, int]) -> Bucket:
        bucket = next(supply[wanted[0]])
        with torch.no_grad():
            for p in bucket.pieces:
                part(leaves[p.name].detach(), p).copy_(
                    part(truth[p.name], p).reshape(-1).view_as(part(leaves[p.name], p))
                )
        return bucket

    gate = ForwardGate(model, buckets, receive)

    def note(name: str) -> None:
        when.setdefault(name, len(gate.arrived))

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, o, name=name: note(name))
    got = functional_call(model, {**leaves, **dict(model.named_buffers())}, (x,))
    assert torch.equal(got, expected)
    needs = module_needs(model, buckets)
    assert sorted(map(key, gate.arrived)) == sorted(map(key, answers))  # each once
    for shard in range(len(buckets)):  # ... each shard's in the order it sent them
        assert [b for b in gate.arrived if b.shard == shard] == [b for b in answers if b.shard == shard]
    answers = gate.arrived
    # The first layer ran with its own buckets in and the rest still on the wire.
    assert when["0"] < len(answers)
    assert all(
        when[m] >= max(answers.index(next(b for b in answers if key(b) == k)) + 1 for k in ks)
        for m, ks in needs.items()
    )
    gate.remove()


def test_parameters_used_outside_their_own_module_are_found_with_the_module_that_reads_them() -> None:
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # b's weight read by the parent, before b's own forward ran
            return self.b(F.linear(x, self.b.weight) + self.a(x))

    torch.manual_seed(0)
    for model, early in ((Reads(), {"b.weight": ""}), (net(), {})):
        params = dict(model.named_parameters())
        buckets = plan_buckets(plan_pieces(dict(model.state_dict()), 1), params, cap=256, first_cap=256)
        state = {**params, **dict(model.named_buffers())}
        x = torch.randn(2, 4) if early else torch.randn(2, 3, 8, 8)
        found = unguarded(model, buckets, lambda p, m=model, x=x: functional_call(m, dict(p), (x,)), state)
        assert found == early
