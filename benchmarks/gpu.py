"""What a GPU changes: compute workers training on CUDA, checked and measured.

    python -m benchmarks.gpu --out DIR [--budget SECONDS] [--workloads cnn-gpu,transformer,cnn-20,mlp]
    python -m benchmarks.gpu --out DIR --checks "" --workloads resnet18   (needs the bench extra)

Run where a GPU is lent (the device tool lends one GPU and 16 cores to some sessions; CI has none). On a
machine without a GPU it runs on the CPU, which only tries the script out. It writes `gpu.json` into DIR
after every part, so a run cut short keeps what it measured, and skips the parts that would start after
`--budget` seconds.

1. **check**: the digits CNN (BatchNorm), the transformer (dropout: CUDA's generator, seeded per batch id)
   and cnn-20 (cuDNN convolutions). Each trains once on one compute worker with no fault (the reference),
   then on two, one SIGKILLed mid-run and another added, under both policies; then in async mode under the
   same faults. Recorded: each compute loop's device, every batch id committed exactly once, and (sync)
   whether the parameters are bitwise equal to the reference's.
2. **steady**: the plain loop on the GPU (`plain.plain_loop`, in a process of its own) against one compute
   worker in sync mode (`elastic.steady`: snapshots every second, the phases of a step), in alternating
   pairs; then async mode on the mlp against the plain loop (`async_mode.steady`). Each workload trains on
   synthetic data of its own shape and at its own batch (`workloads.Workload`: the resnet18 on 3x32x32,
   batch 32), `--samples` of them an epoch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefect_elastic import ElasticJob
from prefect_elastic.dataset import digits_dataset
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.training import TrainResult, train

from . import async_mode, elastic
from .plain import plain_process
from .workloads import WORKLOADS, write_dataset

SAMPLES = 16384  # 128 steps of 128 an epoch, as benchmarks/sizes.py (512 of the resnet18's 32)
CHECK_SAMPLES = 4096


def exactly_once(result: TrainResult) -> bool:
    return sorted(e.batch_id for e in result.ledger) == list(range(result.total_batches))


def differing(result: TrainResult, reference: TrainResult) -> list[str]:
    return [k for k, t in reference.state_dict.items() if not torch.equal(result.state_dict[k], t)]


def check_model(pool: elastic.ClusterPool, name: str, job: ElasticJob) -> dict[str, Any]:
    """One worker with no fault, then two with a SIGKILL and a join, both policies; async the same."""
    with pool.elastic(1) as cluster:
        reference = train(job.model_copy(update={"job_id": f"{name}-reference"}), cluster=cluster)
    at = max(2, reference.total_steps // 3)
    out: dict[str, Any] = {
        "steps": reference.total_steps,
        "reference_devices": sorted({loop.device for loop in reference.loops}),
        "kill_at_step": at,
    }
    for policy in ("rollback", "reassign", "async"):
        update: dict[str, Any] = {"job_id": f"{name}-{policy}"}
        if policy == "async":
            update["mode"] = "async"
        else:
            update["on_membership_change"] = policy
        faults = FaultSchedule(seed=1).kill_worker(at_step=at).add_worker(at_step=at + 2)
        with pool.elastic(2) as cluster:
            result = train(job.model_copy(update=update), cluster=cluster, faults=faults)
        out[policy] = {
            "devices": sorted({loop.device for loop in result.loops}),
            "exactly_once": exactly_once(result),
            "killed": [r.target for r in faults.log if r.kind == "kill"],
            "generations": result.generation,
            "first_loss": result.history[0],
            "last_loss": statistics.fmean(result.history[-10:]),
            "reference_last_loss": statistics.fmean(reference.history[-10:]),
        }
        if policy != "async":
            out[policy]["differing_from_reference"] = differing(result, reference)
            out[policy]["bitwise_equal"] = not out[policy]["differing_from_reference"]
    return out


def check_jobs(work: Path, epochs: int = 2) -> dict[str, ElasticJob]:
    digits = digits_dataset(str(work / "digits"), shards=1)
    synthetic = write_dataset(work / "check.npz", CHECK_SAMPLES)
    common: dict[str, Any] = {
        "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
        "epochs": epochs,
        "micro_batches": 2,
        "data_servers": 2,
        "liveness_interval": 0.5,
        "min_workers": 1,
        "min_shard_bytes": 0,  # both shards hold parameters: a push goes to two
    }
    synthetic_url = f"file://{synthetic}"
    return {
        "digits-cnn": ElasticJob(
            model="prefect_elastic.local.demo:digits_cnn", dataset=digits, batch_size=16, **common
        ),
        "transformer": ElasticJob(
            model="benchmarks.workloads:transformer", dataset=synthetic_url, batch_size=64, **common
        ),
        "cnn-20": ElasticJob(
            model="benchmarks.workloads:cnn20", dataset=synthetic_url, batch_size=64, **common
        ),
    }


def steady_pairs(
    pool: elastic.ClusterPool, workload: str, data: str, seconds: float, repeats: int, samples: int = SAMPLES
) -> dict[str, Any]:
    """Alternating pairs of the plain loop and one compute worker, runs of about `seconds` (from a short
    probe of the plain loop); and the plain loop once with the kernels a compute worker on a GPU is held
    to (`compute.training_device`), which is what bitwise reproducibility costs apart from the framework.
    `data` holds `samples` samples of the workload's shape."""
    probe = plain_process(workload, data, steps=30)
    per_epoch = samples // WORKLOADS[workload].batch
    epochs = max(1, min(20, round(seconds * 1000 / probe["step_ms"] / per_epoch)))
    deterministic = plain_process(workload, data, steps=epochs * per_epoch, deterministic=True)
    return {
        "probe_step_ms": probe["step_ms"],
        "plain_deterministic_step_ms": deterministic["step_ms"],
        **pairs(pool, workload, data, epochs, per_epoch, repeats),
    }


def pairs(
    pool: elastic.ClusterPool, workload: str, data: str, epochs: int, per_epoch: int, repeats: int
) -> dict[str, Any]:
    """`repeats` pairs of the plain loop (in a process of its own) and one compute worker in sync mode
    (snapshots every second), `epochs` epochs of `per_epoch` steps each; the two runs of a pair next to
    each other, in the opposite order every other pair, so that a drift of the machine weighs on both.
    The ratio is the median of the pairs' ratios of throughput."""
    steps = epochs * per_epoch
    done = []
    for i in range(repeats):
        order = ("plain", "elastic") if i % 2 == 0 else ("elastic", "plain")
        got: dict[str, Any] = {}
        for side in order:
            if side == "plain":
                got["plain"] = plain_process(workload, data, steps=steps)
            else:
                got["elastic"] = elastic.steady(pool, workload, data, epochs, liveness_interval=1.0)
        done.append(
            {
                "ratio": got["elastic"]["samples_per_s"] / got["plain"]["samples_per_s"],
                "plain_step_ms": got["plain"]["step_ms"],
                "plain_device": got["plain"].get("device"),
                "elastic": got["elastic"],
            }
        )
    return {
        "workload": workload,
        "batch": WORKLOADS[workload].batch,
        "epochs": epochs,
        "steps": steps,
        "pairs": done,
        "ratio": statistics.median(p["ratio"] for p in done),
        "plain_step_ms": statistics.median(p["plain_step_ms"] for p in done),
        "elastic_step_ms": statistics.median(p["elastic"]["step_ms"] for p in done),
    }


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu.json")
    parser.add_argument("--budget", type=float, default=420.0, help="start no part after this many seconds")
    parser.add_argument("--workloads", default="cnn-gpu,transformer,cnn-20,mlp")
    parser.add_argument("--checks", default="digits-cnn,transformer,cnn-20")
    parser.add_argument(
        "--check-epochs", type=int, default=2, help="epochs of each check's runs (1 for a smoke run on a CPU)"
    )
    parser.add_argument("--async-epochs", type=int, default=10, help="0 leaves the async mlp out")
    parser.add_argument("--seconds", type=float, default=6.0, help="a steady run's length, about")
    parser.add_argument("--pairs", type=int, default=2, help="plain and prefect-elastic runs of each")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="samples of each steady run's epoch")
    args = parser.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w and w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown} (known: {', '.join(WORKLOADS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results: dict[str, Any] = {"environment": environment(), "check": {}, "steady": {}}

    def part(section: str, name: str, fn: Callable[[], Any]) -> None:
        if time.monotonic() - start > args.budget:
            results[section][name] = {"skipped": f"past the {args.budget:.0f} s budget"}
        else:
            began = time.monotonic()
            try:
                results[section][name] = fn()
            except Exception:
                results[section][name] = {"error": traceback.format_exc()[-3000:]}
            results[section][name]["seconds"] = round(time.monotonic() - began, 1)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
        said = json.dumps(results[section][name])[:600]
        print(f"[{time.monotonic() - start:6.0f} s] {section} {name}: {said}")

    print(json.dumps(results["environment"]))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pool = elastic.ClusterPool()
        try:
            jobs = check_jobs(work, args.check_epochs)
            for name in filter(None, args.checks.split(",")):
                part("check", name, functools.partial(check_model, pool, name, jobs[name]))
            data = WORKLOADS["mlp"].dataset(work, args.samples)  # (MNIST-shaped: the async mlp's too)
            for workload in filter(None, args.workloads.split(",")):
                shaped = WORKLOADS[workload].dataset(work, args.samples)
                run = functools.partial(
                    steady_pairs, pool, workload, shaped, args.seconds, args.pairs, args.samples
                )
                part("steady", workload, run)
        finally:
            pool.close()
        if args.async_epochs > 0:
            part("steady", "async-mlp", lambda: async_mode.steady("mlp", data, args.async_epochs, args.pairs))
    print(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
