"""What the overlapped step (issue 37) can buy on this machine, measured before it is wired in.

    python -m benchmarks.overlap [--workload resnet18] [--steps 8] [--shards 1] [--cap BYTES]

One process, one torch thread, no cluster: the workload's model and a batch of its shape, the gradient
computed as a compute loop computes it (`functional_call` on the meta model, `torch.autograd.grad`), with
the bucket hooks of `compute/buckets.py` armed over the bucket plan (`bucket_plan.py`) of `--shards` data
servers. Per step: forward, backward, and for each bucket the time from its hand-over (its last gradient
in) to the end of backward: the window in which its push and its shard's apply can hide. Then the
shard's side, per bucket: the sum of one more micro-batch's part (`add_`), the SGD-with-momentum update
over the bucket's one flat run (as `ShardOptimizer` applies it) against torch's loop over one tensor per
parameter and `foreach` over them, the same update out of place (into the other of
`bucket_book.TwoCopies`: a copy then the update, or `bucket_apply.sgd_into`), and a copy of its bytes (what
a transfer through shared memory costs at least). Medians over the measured steps, in this thread's CPU time
unless `--clock wall`; the load averages before and after say how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.optim.sgd import sgd

from prefect_elastic.compute.buckets import BucketHooks
from prefect_elastic.data_server.bucket_apply import sgd_into
from prefect_elastic.data_server.bucket_plan import Bucket, bucket_bytes, plan_buckets
from prefect_elastic.sharding import plan_pieces

from .workloads import LR, MOMENTUM, WORKLOADS

# What the figures count: this thread's CPU time by default (`--clock cpu`: on a machine that others load,
# wall time measures them too; one torch thread and CPU autograd run every phase in this thread), or wall
# time (`--clock wall`).
_clock = time.thread_time


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _timed(run: Callable[[], Any], repeats: int) -> float:
    """The median of `repeats` runs of `run`, in seconds (after one not counted)."""
    run()
    times = []
    for _ in range(repeats):
        began = _clock()
        run()
        times.append(_clock() - began)
    return statistics.median(times)


def step_phases(workload: str, steps: int, shards: int, cap: int | None) -> dict[str, Any]:
    """Forward, backward and each bucket's window before the end of backward, per step (medians)."""
    spec = WORKLOADS[workload]
    model = spec.make()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    meta = spec.make().to("meta")
    plan = plan_buckets(plan_pieces({**params, **buffers}, shards), params, cap=cap)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(spec.batch, *spec.shape, generator=generator)
    y = torch.randint(0, 10, (spec.batch,), generator=generator)
    handed: list[tuple[Bucket, float]] = []
    hooks = BucketHooks(plan, params, lambda b, run: handed.append((b, _clock())))

    def one(armed: bool) -> tuple[float, float, list[tuple[Bucket, float]]]:
        handed.clear()
        began = _clock()
        tensors = {**params, **{n: b.clone() for n, b in buffers.items()}}
        loss = F.cross_entropy(functional_call(meta, tensors, (x,)), y)
        forward_end = _clock()
        torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
        backward_end = _clock()
        hooks.finish()
        windows = [(b, backward_end - at) for b, at in handed]
        return forward_end - began, backward_end - forward_end, windows if armed else []

    rows: list[tuple[float, float, list[tuple[Bucket, float]]]] = []
    bare: list[float] = []
    for i in range(steps + 2):
        # Armed and bare steps alternate: the hooks' cost (a copy of every gradient into its bucket) is
        # the difference of their backwards.
        armed = one(True)
        hooks.remove()
        unarmed = one(False)
        hooks = BucketHooks(plan, params, lambda b, run: handed.append((b, _clock())))
        if i >= 2:
            rows.append(armed)
            bare.append(unarmed[1])
    hooks.remove()
    # The plain loop's step on the same model and batch, as a user's own script trains it.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def plain_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    plain = _timed(plain_step, steps)
    order = [b for b, _ in rows[-1][2]]
    per_bucket = []
    for bucket in order:
        windows = [w for _, _, ws in rows for b, w in ws if b == bucket]
        per_bucket.append(
            {
                "shard": bucket.shard,
                "bucket": bucket.index,
                "MB": round(bucket.nbytes / 1e6, 3),
                "tensors": len(bucket.pieces),
                "ms_before_backward_ends": _ms(statistics.median(windows)),
            }
        )
    shard_bytes = [sum(b.nbytes for b in held) for held in plan]
    return {
        "workload": workload,
        "shards": shards,
        "cap_bytes": cap if cap is not None else [bucket_bytes(s) for s in shard_bytes],
        "buckets": sum(len(held) for held in plan),
        "plain_step_ms": _ms(plain),
        "forward_ms": _ms(statistics.median(r[0] for r in rows)),
        "backward_ms": _ms(statistics.median(r[1] for r in rows)),
        "backward_without_hooks_ms": _ms(statistics.median(bare)),
        "per_bucket_in_backward_order": per_bucket,
    }


def shard_apply(workload: str, shards: int, cap: int | None, repeats: int) -> dict[str, Any]:
    """The shard's work per bucket and for the whole shard: sum, update (flat, loop, foreach), the update
    out of place (a copy then the update, or `sgd_into`), a copy of the bytes."""
    spec = WORKLOADS[workload]
    model = spec.make()
    params = dict(model.named_parameters())
    plan = plan_buckets(plan_pieces(dict(model.state_dict()), shards), params, cap=cap)
    held = plan[-1]  # the last shard's: the end of the model (its largest layers) where it is split
    names = list(dict.fromkeys(n for b in held for n in b.names))
    per_tensor = [params[n].detach().clone() for n in names]  # (whole tensors: a split one counts whole)
    flat = torch.cat([t.reshape(-1) for t in per_tensor])
    momentum = torch.randn_like(flat) * 1e-3
    grad = torch.randn_like(flat) * 1e-3
    part = torch.randn_like(flat) * 1e-3
    other_p, other_m = flat.clone(), momentum.clone()

    def update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        sgd([p], [g], [m], weight_decay=0.0, momentum=MOMENTUM, lr=LR, dampening=0.0, nesterov=False,
            maximize=False, has_sparse_grad=False, foreach=False, fused=False)  # fmt: skip

    def bucket_row(b: Bucket) -> dict[str, float]:
        a, z = b.start, b.stop

        def copy_then_update() -> None:
            other_p[a:z].copy_(flat[a:z])
            other_m[a:z].copy_(momentum[a:z])
            update(other_p[a:z], grad[a:z], other_m[a:z])

        def into_other() -> None:
            sgd_into(
                flat[a:z],
                momentum[a:z],
                grad[a:z],
                other_p[a:z],
                other_m[a:z],
                lr=LR,
                momentum_factor=MOMENTUM,
            )

        return {
            "bucket": b.index,
            "MB": round(b.nbytes / 1e6, 3),
            "sum_one_part_ms": _ms(_timed(lambda: grad[a:z].add_(part[a:z]), repeats)),
            "update_flat_ms": _ms(_timed(lambda: update(flat[a:z], grad[a:z], momentum[a:z]), repeats)),
            "update_copy_then_in_place_ms": _ms(_timed(copy_then_update, repeats)),
            "update_into_other_copy_ms": _ms(_timed(into_other, repeats)),
            "copy_bytes_ms": _ms(_timed(lambda: other_p[a:z].copy_(grad[a:z]), repeats)),
        }

    rows = [bucket_row(b) for b in held]
    grads = [torch.randn_like(t) * 1e-3 for t in per_tensor]

    def per_tensor_update(foreach: bool) -> float:
        bufs: list[torch.Tensor | None] = [torch.randn_like(t) * 1e-3 for t in per_tensor]
        copies = [t.clone() for t in per_tensor]

        def run() -> None:
            sgd(copies, grads, bufs, weight_decay=0.0, momentum=MOMENTUM, lr=LR, dampening=0.0,
                nesterov=False, maximize=False, has_sparse_grad=False, foreach=foreach,
                fused=False)  # fmt: skip

        return _ms(_timed(run, repeats))

    whole: dict[str, float] = {"tensors": len(per_tensor), "MB": round(flat.numel() * 4 / 1e6, 3)}
    whole["loop_per_tensor_ms"] = per_tensor_update(False)
    whole["foreach_per_tensor_ms"] = per_tensor_update(True)
    whole["flat_ms"] = _ms(_timed(lambda: update(flat, grad, momentum), repeats))
    whole["into_other_copy_flat_ms"] = _ms(
        _timed(
            lambda: sgd_into(flat, momentum, grad, other_p, other_m, lr=LR, momentum_factor=MOMENTUM), repeats
        )
    )
    optimizer = torch.optim.SGD(per_tensor, lr=LR, momentum=MOMENTUM)
    for t, g in zip(per_tensor, grads, strict=True):
        t.grad = g
    whole["torch_optim_step_ms"] = _ms(_timed(optimizer.step, repeats))
    return {"shard": len(plan) - 1, "per_bucket": rows, "whole_shard": whole}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0]
    )
    images = sorted(name for name, w in WORKLOADS.items() if not w.tokens)  # (its batches are random images)
    parser.add_argument("--workload", default="resnet18", choices=images)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--cap", type=int, default=None, help="bucket cap in bytes (default: the plan's)")
    parser.add_argument("--repeats", type=int, default=15, help="repeats of each shard-side timing")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="this thread's CPU time, or wall"
    )
    args = parser.parse_args(argv)
    global _clock
    _clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    report = {
        "clock": args.clock,
        "load": os.getloadavg(),
        "steps": step_phases(args.workload, args.steps, args.shards, args.cap),
        "shard": shard_apply(args.workload, args.shards, args.cap, args.repeats),
    }
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
