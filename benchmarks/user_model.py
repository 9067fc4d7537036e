"""Your own model and data: a plain PyTorch loop against one compute worker, side by side in one run.

    python -m benchmarks.user_model --model mymodels:net --dataset /data/train.npz \\
        [--path DIR] [--loss cross_entropy|mse|module:fn] [--batch 128] [--epochs 2] [--pairs 3]

`--model` is a factory (`module:function`, called with no argument), importable from `--path` (put on
the cluster's workers' `PYTHONPATH`, and the plain loop's) or from this environment. `--dataset` is an
`.npz` of arrays `x` and `y`, as `prefect_elastic.dataset` reads. Both sides train with one torch thread,
SGD with momentum, batches of `--batch`, the same order of samples per epoch; the plain loop runs in a
process of its own. A warm-up pair is not counted, then `--pairs` alternating pairs. Prints each pair
(samples/s, the plain step, the worker's compute phase and a step's fixed cost) and the median ratio.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from prefect_elastic import ElasticJob
from prefect_elastic.local.cluster import LocalElasticCluster

from . import elastic

LR, MOMENTUM = 0.02, 0.9
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
}  # (the names `ElasticJob.loss` knows)
REPOSITORY = Path(__file__).resolve().parent.parent


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def plain_loop(
    model: str, dataset: str, loss: str, batch: int, steps: int, warmup: int = 5
) -> dict[str, float]:
    """`steps` steps of the user's model in this process, as a user's own script trains it."""
    torch.set_num_threads(1)
    with np.load(dataset) as data:
        x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    net = _load(model)()
    loss_fn = LOSSES[loss] if loss in LOSSES else _load(loss)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    per_epoch = len(y) // batch
    times: list[float] = []
    for step in range(steps + warmup):
        idx = order[(step % per_epoch) * batch : (step % per_epoch + 1) * batch]
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net(x[idx]), y[idx]).backward()
        optimizer.step()
        times.append(time.perf_counter())
    elapsed = times[-1] - times[warmup - 1]
    return {"samples_per_s": steps * batch / elapsed, "step_ms": 1000 * elapsed / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.user_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="module:function making the model")
    parser.add_argument("--dataset", required=True, type=Path, help=".npz with arrays x and y")
    parser.add_argument("--path", type=Path, help="a folder to import the model from")
    parser.add_argument("--loss", default="cross_entropy", help="cross_entropy, mse or module:function")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # (the plain loop's process)
    args = parser.parse_args(argv)
    if not args.dataset.is_file():
        parser.error(f"--dataset {args.dataset}: no such file (an .npz with arrays x and y)")
    if args.path is not None and not args.path.is_dir():
        parser.error(f"--path {args.path}: no such folder")
    if args.loss not in LOSSES and ":" not in args.loss:
        parser.error(f"--loss {args.loss}: give {' or '.join(LOSSES)}, or module:function")
    if args.pairs < 1 or args.epochs < 1 or args.batch < 1:
        parser.error("--pairs, --epochs and --batch must be 1 or more")
    if args.path is not None:
        sys.path.insert(0, str(args.path.resolve()))
    with np.load(args.dataset) as data:
        samples = len(data["y"])
    steps = args.epochs * (samples // args.batch)
    if args.plain:
        print(json.dumps(plain_loop(args.model, str(args.dataset), args.loss, args.batch, steps)))
        return 0
    env = {"PYTHONPATH": str(args.path.resolve())} if args.path is not None else {}
    ratios: list[float] = []
    plain_args = [
        "--plain",
        "--model",
        args.model,
        "--dataset",
        str(args.dataset.resolve()),
        "--loss",
        args.loss,
    ]
    plain_args += ["--batch", str(args.batch), "--epochs", str(args.epochs)]
    plain_args += ["--path", str(args.path.resolve())] if args.path is not None else []
    with LocalElasticCluster(static_workers=2, elastic_workers=1, env=env) as cluster:
        for i in range(args.pairs + 1):  # (pair 0 warms both up)
            got: dict[str, dict[str, Any]] = {}
            for side in ("plain", "elastic") if i % 2 else ("elastic", "plain"):
                if side == "plain":
                    done = subprocess.run(
                        [sys.executable, "-m", "benchmarks.user_model", *plain_args],
                        capture_output=True, text=True, check=False, cwd=REPOSITORY,
                        env={**os.environ, **env},
                    )  # fmt: skip
                    if done.returncode != 0:
                        raise RuntimeError(f"the plain loop exited {done.returncode}: {done.stderr[-2000:]}")
                    got["plain"] = json.loads(done.stdout.strip().splitlines()[-1])
                    continue
                job = ElasticJob(
                    job_id=f"user-model-{i}", model=args.model, dataset=f"file://{args.dataset.resolve()}",
                    loss=args.loss, optimizer={"name": "sgd", "lr": LR, "momentum": MOMENTUM},
                    batch_size=args.batch, micro_batches=1, epochs=args.epochs, data_servers=2,
                    liveness_interval=1.0, threads_per_worker=1, min_workers=1,
                )  # fmt: skip
                result, _ = elastic.run(cluster, job)
                cost = elastic.fixed_cost(result)
                got["elastic"] = {"samples_per_s": elastic.steady_throughput(result), **cost}
            plain, ours = got["plain"], got["elastic"]
            ratio = ours["samples_per_s"] / plain["samples_per_s"]
            print(
                f"pair {i}{' (warm-up)' if i == 0 else ''}: plain {plain['samples_per_s']:.0f} samples/s "
                f"(step {plain['step_ms']:.2f} ms), prefect-elastic {ours['samples_per_s']:.0f} (compute "
                f"{ours['compute_ms']:.2f} ms + fixed {ours['fixed_ms']:.2f} ms): {ratio:.3f}",
                flush=True,
            )
            if i:
                ratios.append(ratio)
    pairs = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"{args.model}: {statistics.median(ratios):.3f} of plain (pairs {pairs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
