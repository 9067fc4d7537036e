"""The training script torchrun launches for the baseline: the standard torchrun-elastic pattern.

    python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=2 ... benchmarks/torchrun_worker.py \\
        --workload cnn --data DATA.npz --log-file LOG.jsonl --checkpoint CKPT.pt --steps N

Every rank trains the workload's batch of each global step (128 samples, 32 for the ResNet-18: a global batch
of that times world) under DDP on gloo. Rank 0
checkpoints every `--checkpoint-every` steps; every (re)started rank resumes from that checkpoint, which is
the only way a torchrun job recovers: a failure restarts all workers, and the steps since the last
checkpoint are done again. Each rank appends JSON lines to `--log-file` so the driver can time steps and find
worker pids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

# Run as a script by torchrun: make `benchmarks` importable from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import BATCH, LR, MOMENTUM, THREADS, WORKLOADS, load_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--data", required=True, help=".npz written by workloads.write_dataset")
    # Not `--log`: torchrun's own parser (Python 3.11 argparse) rejects it as an ambiguous prefix of
    # --log-dir/--logs-specs, even after the script name.
    parser.add_argument("--log-file", required=True, help="JSON-lines file every rank appends to")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--steps", type=int, required=True, help="global steps to train in all")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    # gloo's default collective timeout is 30 minutes; a bounded one turns a hung peer into an error the
    # agent sees (and restarts on) instead of a silent stall.
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="seconds")
    return parser.parse_args(argv)


def batch_indices(step: int, rank: int, world: int, samples: int, batch: int = BATCH) -> torch.Tensor:
    """This rank's share of global step `step`: a seeded permutation per epoch, cut into global batches
    of `batch` * world and strided by rank, so any restart re-reads exactly the same samples."""
    per_epoch = samples // (batch * world)
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
    global_batch = order[offset * batch * world : (offset + 1) * batch * world]
    return global_batch[rank::world]


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write then rename, so a worker killed mid-save never leaves a torn checkpoint behind."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def write_line(log: TextIO, record: dict[str, Any]) -> None:
    log.write(json.dumps(record) + "\n")
    log.flush()  # the driver tails the file while we train; a killed rank must not lose lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(THREADS)
    # Counts the agent's restarts after failures only: a restart for a node joining keeps the count, so
    # the driver tells groups apart by worker pid.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    with open(args.log_file, "a") as log:
        started = time.time()
        write_line(
            log,
            {"event": "start", "pid": os.getpid(), "rank": rank, "world": world, "t": started,
             "restart": restart},
        )  # fmt: skip
        # MASTER_ADDR/PORT, RANK and WORLD_SIZE come from torchrun's rendezvous (env:// init).
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
        x, y = load_dataset(args.data)

        model = WORKLOADS[args.workload].make()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        step = 0
        if os.path.exists(args.checkpoint):
            # Every rank loads it (rather than rank 0 broadcasting), so the optimizer state is restored
            # everywhere; DDP's constructor broadcasts rank 0's parameters anyway.
            state = torch.load(args.checkpoint, map_location="cpu")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])
        ddp = DistributedDataParallel(model)
        write_line(
            log,
            {"event": "ready", "pid": os.getpid(), "rank": rank, "world": world, "t": time.time(),
             "restart": restart, "resume_step": step, "init_s": time.time() - started},
        )  # fmt: skip

        while step < args.steps:
            idx = batch_indices(step, rank, world, len(y), WORKLOADS[args.workload].batch)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()  # DDP all-reduces (averages) the gradients across ranks here
            optimizer.step()
            step += 1
            # `step` is the number of global steps completed; `samples` is this rank's share of the step.
            write_line(
                log,
                {"t": time.time(), "rank": rank, "world": world, "step": step, "loss": float(loss.detach()),
                 "samples": len(idx), "restart": restart, "pid": os.getpid()},
            )  # fmt: skip
            if rank == 0 and step % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint, model, optimizer, step)

    # Leave together, then skip the interpreter's teardown: a finished worker sometimes died at exit with
    # "terminate called without an active exception" (SIGABRT), which torchrun counts as a failure and
    # answers by restarting the whole job.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
