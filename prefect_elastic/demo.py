"""The demo: elastic training of a small CNN on the scikit-learn digits, on a local cluster of real
processes, with a compute worker killed and another added mid-run.

    python -m prefect_elastic.demo            (or: prefect-elastic demo)

It first trains the job with one compute worker and no failures (the reference), then trains it again on
two workers while a fault schedule SIGKILLs one and starts a new one, shows progress as it goes, and ends
by printing the accuracy, what happened to the membership, and whether the parameters are bitwise equal
to the reference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import TextIO

import numpy as np
import torch
from torch import nn

from .cluster import LocalElasticCluster
from .coordinator import MembershipEvent, Progress
from .dataset import digits_dataset
from .job import ElasticJob
from .testing import FaultSchedule
from .training import TrainResult, train


def digits_cnn() -> nn.Module:
    """A small CNN for 8x8 digits (about 5k parameters), with BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def accuracy(job: ElasticJob, state: dict[str, torch.Tensor]) -> float:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    model = job.make_model()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    return float((predicted == torch.from_numpy(digits.target)).float().mean())


class ProgressLine:
    """One line redrawn in place on a terminal; a line every few seconds otherwise."""

    def __init__(self, label: str, out: TextIO = sys.stdout) -> None:
        self.label = label
        self.out = out
        self.tty = out.isatty()
        self.last = 0.0

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        if now - self.last < (0.1 if self.tty else 2.0) and p.state == "running":
            return
        self.last = now
        width = 30
        filled = int(width * p.committed_steps / max(1, p.total_steps))
        loss = f"{p.loss:.3f}" if p.loss is not None else "-"
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] step {p.committed_steps}/{p.total_steps} "
            f"loss {loss} gen {p.generation} workers {len(p.workers)} {p.state}"
        )
        self.out.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        self.out.flush()

    def event(self, e: MembershipEvent) -> None:
        if e.kind in ("snapshot", "done"):
            return
        detail = ", ".join(
            part
            for part in (
                f"lost {', '.join(e.left)}" if e.left else "",
                f"joined {', '.join(e.joined)}" if e.joined else "",
                f"{e.steps_lost} committed steps undone" if e.steps_lost else "",
                f"{e.batches_dropped} in-flight micro-batches re-queued" if e.batches_dropped else "",
            )
            if part
        )
        self.out.write(
            ("\n" if self.tty else "") + f"  [{e.kind}] generation {e.generation}, step {e.step}: {detail}\n"
        )

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


def run_demo(policy: str = "rollback", epochs: int = 6, out: TextIO = sys.stdout) -> bool:
    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    workdir = tempfile.mkdtemp(prefix="prefect-elastic-demo-")
    dataset = digits_dataset(workdir, shards=2)
    job = ElasticJob(
        model="prefect_elastic.demo:digits_cnn",
        dataset=dataset,
        batch_size=16,
        micro_batches=4,
        epochs=epochs,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        data_servers=2,
        liveness_interval=1.0,
        on_membership_change=policy,
        job_id="digits-demo",
    )
    say(f"prefect-elastic demo: {job.model} on the digits ({dataset}), policy {policy}")
    say("starting a local cluster: a scheduler, 2 static workers (data servers), 1 elastic worker ...")
    with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
        say(f"cluster at {cluster.scheduler_address}, logs in {cluster.log_dir}")
        say("\n1) the reference: one compute worker, no failures")
        reference = _train(job, cluster, "reference", None)
        say("\n2) elastic: a second worker joins, one is SIGKILLed mid-step, another is added")
        cluster.add_worker()
        steps = reference.total_steps
        faults = FaultSchedule(seed=0).kill_worker(at_step=steps // 4).add_worker(at_step=steps // 4 + 1)
        result = _train(job, cluster, "elastic  ", faults)

    same = all(torch.equal(result.state_dict[k], reference.state_dict[k]) for k in reference.state_dict)
    ids = [e.batch_id for e in result.ledger]
    say("\nwhat happened to the membership:")
    for e in result.events:
        if e.kind != "snapshot":
            say(
                f"  {time.strftime('%H:%M:%S', time.localtime(e.time))} {e.kind:<9} gen {e.generation:<2} "
                f"step {e.step:<4} workers {len(e.workers)}  {e.reason}"
            )
    say(f"  faults injected: {', '.join(f'{r.kind} {r.target} at step {r.step}' for r in faults.log)}")
    say(f"  snapshots taken: {result.counters['snapshots']}, committed steps undone: {result.steps_lost}, "
        f"in-flight micro-batches re-queued: {result.batches_dropped}")  # fmt: skip
    say("\nresult:")
    say(f"  accuracy on the digits: reference {accuracy(job, reference.state_dict):.3f}, "
        f"elastic {accuracy(job, result.state_dict):.3f}")  # fmt: skip
    say(f"  final loss {result.history[-1]:.4f} after {result.steps} steps in {result.elapsed:.1f} s "
        f"(reference: {reference.elapsed:.1f} s on one worker)")  # fmt: skip
    say(f"  ledger: {len(ids)} batch ids, each exactly once: {ids == list(range(result.total_batches))}")
    say(f"  parameters bitwise equal to the no-failure run: {'YES' if same else 'NO'}")
    return same and ids == list(range(result.total_batches))


def _train(
    job: ElasticJob, cluster: LocalElasticCluster, label: str, faults: FaultSchedule | None
) -> TrainResult:
    line = ProgressLine(label)
    try:
        return train(job, cluster=cluster, on_progress=line, on_event=line.event, faults=faults)
    finally:
        line.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefect-elastic demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=["rollback", "reassign"], default="rollback")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    return 0 if run_demo(args.policy, args.epochs) else 1


if __name__ == "__main__":
    sys.exit(main())
