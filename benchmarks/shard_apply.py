"""What a shard's update costs when its memory went cold during the loop's compute, beside the same update
warm and the plain loop's own `optimizer.step()`.

`python -m benchmarks.shard_apply [--workloads mlp,mlp-50] [--repeats 300]`: for each workload, SGD with
the benchmarks' momentum over one flat tensor of the model's parameter count (a shard holds its
parameters so: `data_server/optimizer.py`), timed (a) warm, step after step as in a tight loop, and (b)
cold, after writing a buffer larger than the machine's last-level cache, as a shard meets its
parameters, momentum and the pushed gradient after a compute step of the loop's; and the plain loop's
step (forward, backward, `optimizer.step()`) with the step alone timed. One thread, as the steady
benchmarks run. Medians, ms.

Why it is here: on a 2-core machine the update of a small model is on the critical path of every step (the
loop waits for the shard's answer) and costs what its memory traffic costs from DRAM; this is the floor
under the mlp's fixed cost (docs/benchmarks.md, "The mlp's step, piece by piece").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .workloads import LR, MOMENTUM, WORKLOADS

FLUSH_BYTES = 256 * 2**20  # larger than any last-level cache this runs on


def timed(step: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timings of `step` (ms), `before` run untimed ahead of each."""
    took: list[float] = []
    for _ in range(repeats + 10):
        before()
        began = time.perf_counter()
        step()
        took.append(time.perf_counter() - began)
    return 1000 * statistics.median(took[10:])


def measure(workload: str, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = WORKLOADS[workload].make()
    count = sum(p.numel() for p in model.parameters())
    flat = torch.nn.Parameter(torch.randn(count))
    flat.grad = torch.randn(count)
    shard = torch.optim.SGD([flat], lr=LR, momentum=MOMENTUM)
    shard.step()  # (the momentum buffer exists from the first step on)
    flush = torch.empty(FLUSH_BYTES // 4)
    warm = timed(shard.step, lambda: None, repeats)
    cold = timed(shard.step, lambda: flush.fill_(1.0), repeats)

    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    spec = WORKLOADS[workload]
    x = (
        torch.randint(1, 1000, (spec.batch, *spec.shape))  # (token ids, where the model reads them)
        if spec.tokens
        else torch.randn(spec.batch, *spec.shape)
    )
    y = torch.randint(0, 10, (spec.batch,))

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    plain = timed(optimizer.step, backward, repeats)
    return {"parameters": count, "warm": warm, "cold": cold, "plain": plain}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,mlp-50")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: {unknown} unknown; give some of {sorted(WORKLOADS)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    print("| workload | parameters | shard's update, warm (ms) | shard's update, cold (ms) | cold over warm "
          "| plain loop's optimizer.step() (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in names:
        r = measure(name, args.repeats)
        print(
            f"| {name} | {r['parameters']:,} | {r['warm']:.3f} | {r['cold']:.3f} "
            f"| {r['cold'] / r['warm']:.1f} | {r['plain']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
