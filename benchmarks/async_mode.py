"""Async mode against sync mode: a straggler, and steady throughput over plain PyTorch.

- `straggler`: 4 compute workers, one of them `factor` times slower (`LocalElasticCluster.slow_worker`), and
  the same without a straggler; sync and async in turn on one cluster. The figure is the time from the
  first committed step to a target loss: the mean loss over the last `WINDOW_SAMPLES` samples trained
  falls to the level the sync run without a straggler reaches half-way through its run.
- `steady`: 1 compute worker, async, beside the plain loop in a process of its own, interleaved.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefect_elastic.dataset import write_npz
from prefect_elastic.job import ElasticJob
from prefect_elastic.local import slow
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training import TrainResult, train

from .elastic import make_job, steady_throughput
from .plain import plain_process
from .workloads import BATCH, THREADS

WINDOW_SAMPLES = 2048  # the loss a run stands at: the mean over this many samples trained


def loss_curve(result: TrainResult) -> list[tuple[float, float]]:
    """(seconds since the first commit, mean loss over the last `WINDOW_SAMPLES` samples) at each commit."""
    per_step = result.job.batch_size * (1 if result.job.mode == "async" else result.job.micro_batches)
    window = max(1, WINDOW_SAMPLES // per_step)
    times, losses = result.commit_times, result.history
    start = times[0]
    return [
        (times[k] - start, statistics.fmean(losses[k + 1 - window : k + 1]))
        for k in range(window - 1, len(losses))
    ]


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def straggler(
    workload: str, data: str, workers: int, factor: float, epochs: int, repeats: int
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    with LocalElasticCluster(static_workers=2, elastic_workers=workers) as cluster:
        # Uncounted: the first job on a fresh cluster is slower in every phase.
        train(make_job(workload, data, micro_batches=workers, epochs=1, job_id="warm"), cluster=cluster)
        for _ in range(repeats):
            for slowed in (False, True):
                with cluster.client() as client:
                    slow.clear(client)
                if slowed:
                    cluster.slow_worker(cluster.elastic_addresses()[0], factor)
                for mode in ("sync", "async"):
                    job = make_job(
                        workload, data, micro_batches=workers, epochs=epochs, mode=mode,
                        job_id=f"straggler-{mode}",
                    )  # fmt: skip
                    began = time.time()
                    result = train(job, cluster=cluster)
                    key = f"{mode}-{'straggler' if slowed else 'even'}"
                    curves.setdefault(key, []).append(loss_curve(result))
                    runs.setdefault(key, []).append(
                        {
                            "wall_s": time.time() - began,
                            "train_s": result.commit_times[-1] - result.commit_times[0],
                            "final_loss": loss_curve(result)[-1][1],
                            "candidate_steps": result.candidate_steps,
                            "batches": result.total_batches,
                            "staleness": result.staleness,
                            "stale_refusals": result.counters.get("stale_refusals", 0),
                        }
                    )
        with cluster.client() as client:
            slow.clear(client)
    # The target: where the sync run without a straggler stands half-way through its run.
    reference = curves["sync-even"][0]
    target = reference[len(reference) // 2][1]
    for key, per_run in curves.items():
        for run, curve in zip(runs[key], per_run, strict=True):
            run["time_to_target_s"] = time_to(curve, target)

    def median_time(key: str) -> float | None:
        times = [r["time_to_target_s"] for r in runs[key]]
        return statistics.median(times) if all(t is not None for t in times) else None

    out: dict[str, Any] = {
        "workload": workload,
        "workers": workers,
        "factor": factor,
        "epochs": epochs,
        "target_loss": target,
        "runs": runs,
        "time_to_target_s": {key: median_time(key) for key in runs},
    }
    for case in ("straggler", "even"):
        a, s = out["time_to_target_s"][f"async-{case}"], out["time_to_target_s"][f"sync-{case}"]
        out[f"ratio_{case}"] = a / s if a is not None and s else None
    return out


def steady(workload: str, data: str, epochs: int, repeats: int) -> dict[str, Any]:
    """1 compute worker in async mode against the plain loop, `repeats` interleaved pairs."""
    pairs = []
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        train(make_job(workload, data, epochs=1, mode="async", job_id="warm"), cluster=cluster)
        for _ in range(repeats):
            result = train(
                make_job(workload, data, epochs=epochs, mode="async", job_id="steady-async"), cluster=cluster
            )
            ours = steady_throughput(result)
            plain = plain_process(workload, data, steps=result.total_batches)["samples_per_s"]
            pairs.append(
                {
                    "async_samples_per_s": ours,
                    "plain_samples_per_s": plain,
                    "ratio": ours / plain,
                    "candidate_share": result.candidate_steps / result.total_batches,
                    "staleness": result.staleness,
                }
            )
    return {
        "workload": workload,
        "batch": BATCH,
        "pairs": pairs,
        "ratio": statistics.median(p["ratio"] for p in pairs),
        "candidate_share": statistics.median(p["candidate_share"] for p in pairs),
    }


# The digits held out of training for the accuracy figure (of 1797), chosen by a fixed seed.
HELD_OUT = 297


def accuracy(workdir: str, workers: int, epochs: int, repeats: int) -> dict[str, Any]:
    """Final accuracy of async mode against sync mode on the same data and epochs: scikit-learn's digits,
    `HELD_OUT` of them held out, the demo's digits CNN (BatchNorm), `workers` compute workers; each run's
    final model is evaluated on the held-out digits. Sync and async in turn, `repeats` times, each pair
    with a seed of its own (sync is bitwise deterministic: one seed would repeat the same number)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = np.asarray(digits.target, dtype=np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    held, kept = order[:HELD_OUT], order[HELD_OUT:]
    folder = Path(workdir) / "digits-held-out"
    folder.mkdir(parents=True, exist_ok=True)
    write_npz(str(folder / "digits-train.npz"), x[kept], y[kept])
    test_x, test_y = torch.from_numpy(x[held]), torch.from_numpy(y[held])

    def job(mode: str, seed: int) -> ElasticJob:
        # Micro-batches of 16 in both modes. A sync step averages `workers` of them into one update; in
        # async mode each is an update of its own, so its learning rate is divided by `workers`: each
        # sample moves the model as far in both modes (the linear scaling rule; docs/design/async.md). What
        # sync's learning rate, or updates as large as sync's step, gave instead: docs/benchmarks.md,
        # "Async mode".
        return ElasticJob(
            job_id=f"accuracy-{mode}",
            seed=seed,  # (the model's initial weights and every micro-batch's draws: a repeat of its own)
            model="prefect_elastic.local.demo:digits_cnn",
            dataset=f"file://{folder / 'digits-train.npz'}",
            optimizer={"name": "sgd", "lr": 0.05 if mode == "sync" else 0.05 / workers, "momentum": 0.9},
            batch_size=16,
            micro_batches=workers,
            epochs=epochs,
            data_servers=2,
            threads_per_worker=THREADS,
            min_workers=1,
            mode=mode,
        )

    def evaluate(made: ElasticJob, state: dict[str, torch.Tensor]) -> float:
        model = made.initial_model()
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            return float((model(test_x).argmax(dim=1) == test_y).float().mean())

    runs: dict[str, list[float]] = {"sync": [], "async": []}
    with LocalElasticCluster(static_workers=2, elastic_workers=workers) as cluster:
        for seed in range(repeats):
            for mode in runs:
                made = job(mode, seed)
                runs[mode].append(evaluate(made, train(made, cluster=cluster).state_dict))
    sync, async_ = statistics.median(runs["sync"]), statistics.median(runs["async"])
    return {
        "workers": workers,
        "epochs": epochs,
        "held_out": HELD_OUT,
        "runs": runs,
        "sync": sync,
        "async": async_,
        "points": 100 * (async_ - sync),
    }
