"""The plain PyTorch baseline: one process, no framework, the loop everyone writes first."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .workloads import LR, MOMENTUM, THREADS, WORKLOADS, load_dataset


def plain_process(
    workload: str, data: str, steps: int, tuned: bool = False, deterministic: bool = False
) -> dict[str, Any]:
    """`plain_loop` in a new Python process, as a user runs a script: nothing of the benchmark's process
    (its Dask client, its heap after earlier runs) weighs on it.

    `tuned`: with the allocator settings prefect-elastic gives its workers (`allocator.tune_allocator`),
    to show how much of a comparison is the allocator's; glibc's defaults otherwise. `deterministic`: with
    the kernels a compute worker on a GPU is held to (`compute.training_device`), to show what bitwise
    reproducibility costs there.
    """
    allocator = "tuned" if tuned else "default"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.plain", workload, data, str(steps), allocator, str(deterministic)],
        capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"plain loop ({workload}) exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["allocator"] = allocator
    result["deterministic"] = deterministic
    return result


def plain_loop(workload: str, data: str, steps: int, warmup: int = 5) -> dict[str, Any]:
    """Train `steps` steps of the workload's batch (128 unless it says otherwise) in this process; samples/s
    over the steps after `warmup`."""
    torch.set_num_threads(THREADS)
    # The device a compute worker picks (`compute.training_device`'s rule), as a user's script would:
    # the batches stay in host memory and go to the GPU one at a time, as a compute worker's do.
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    x, y = load_dataset(data)
    model = WORKLOADS[workload].make().to(device)
    batch = WORKLOADS[workload].batch
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    per_epoch = len(y) // batch
    times: list[float] = []
    losses: list[float] = []
    for step in range(steps + warmup):
        idx = order[(step % per_epoch) * batch : (step % per_epoch + 1) * batch]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter())
    elapsed = times[-1] - times[warmup - 1]
    return {
        "system": "plain-pytorch",
        "workload": workload,
        "steps": steps,
        "samples_per_s": steps * batch / elapsed,
        "step_ms": 1000 * elapsed / steps,
        "device": str(device),
        "final_loss": losses[-1],
    }


if __name__ == "__main__":
    name, path, count, allocator, deterministic = sys.argv[1:6]
    if allocator == "tuned":
        from prefect_elastic.allocator import tune_allocator

        tune_allocator()
    if deterministic == "True":
        from prefect_elastic.compute import training_device

        training_device()
    print(json.dumps(plain_loop(name, path, int(count))))
