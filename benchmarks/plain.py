"""The plain PyTorch baseline: one process, no framework, the loop everyone writes first."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from .workloads import BATCH, LR, MOMENTUM, THREADS, WORKLOADS, load_dataset


def plain_loop(workload: str, data: str, steps: int, warmup: int = 5) -> dict[str, Any]:
    """Train `steps` steps of batch 128 in this process; samples/s over the steps after `warmup`."""
    torch.set_num_threads(THREADS)
    x, y = load_dataset(data)
    model = WORKLOADS[workload].make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    per_epoch = len(y) // BATCH
    times: list[float] = []
    losses: list[float] = []
    for step in range(steps + warmup):
        idx = order[(step % per_epoch) * BATCH : (step % per_epoch + 1) * BATCH]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter())
    elapsed = times[-1] - times[warmup - 1]
    return {
        "system": "plain-pytorch",
        "workload": workload,
        "steps": steps,
        "samples_per_s": steps * BATCH / elapsed,
        "step_ms": 1000 * elapsed / steps,
        "final_loss": losses[-1],
    }
