"""The demo: elastic training of a small CNN on the scikit-learn digits, on a local cluster of real
processes, with a compute worker killed and another added mid-run.

    python -m prefect_elastic.local.demo      (or: prefect-elastic demo)

It first trains the job with one compute worker and no failures (the reference), then trains it again on
two workers while a fault schedule SIGKILLs one and starts a new one, shows progress as it goes, and ends
by printing the accuracy, what happened to the membership, and whether the parameters are bitwise equal
to the reference.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from ..dataset import digits_dataset
from ..job import ElasticJob
from ..messages import MembershipEvent, Progress
from .cluster import LocalElasticCluster
from .faults import FaultSchedule


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
    model = job.initial_model()
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
                f"{e.batches_dropped} in-flight micro-batches trained again" if e.batches_dropped else "",
            )
            if part
        )
        self.out.write(
            ("\n" if self.tty else "") + f"  [{e.kind}] generation {e.generation}, step {e.step}: {detail}\n"
        )

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


def run_demo(
    policy: str = "reassign", epochs: int = 20, keep_server: bool = False, out: TextIO = sys.stdout
) -> bool:
    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    workdir = Path(tempfile.mkdtemp(prefix="prefect-elastic-demo-"))
    dataset = digits_dataset(str(workdir / "digits"), shards=2)
    job = ElasticJob(
        model="prefect_elastic.local.demo:digits_cnn",
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
    with prefect_api(say, keep_server) as ui_url:
        say("starting a local Dask cluster: a scheduler, 2 static workers (data servers), 1 elastic ...")
        with LocalElasticCluster(static_workers=2, elastic_workers=1) as cluster:
            say(f"cluster at {cluster.scheduler_address}, logs in {cluster.log_dir}")
            say("\n1) the reference: one compute worker, no failures")
            reference = _run_flow(
                job, cluster, "reference", FaultSchedule(), workdir / "reference.pt", ui_url, say
            )
            say("\n2) elastic: a second worker joins, another is added, one is SIGKILLed mid-step")
            cluster.add_worker()
            steps = reference.summary["total_steps"]
            # The new worker is started early, the kill comes at half-way: a process takes a few seconds
            # to start and join, and a step here takes a few milliseconds (20 epochs: about 15 s).
            faults = FaultSchedule(seed=0).add_worker(at_step=steps // 20).kill_worker(at_step=steps // 2)
            elastic = _run_flow(job, cluster, "elastic  ", faults, workdir / "elastic.pt", ui_url, say)

    summary = elastic.summary
    same = all(torch.equal(elastic.state[k], reference.state[k]) for k in reference.state)
    say("\nwhat happened to the membership:")
    for e in summary["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(float(e["time"])))
        where = f"gen {e['generation']:<2} step {e['step']:<4} workers {len(e['workers'])}"
        say(f"  {when} {e['kind']:<9} {where}  {e['reason']}")
    say(f"  faults injected: {', '.join(f'{r.kind} {r.target} at step {r.step}' for r in faults.log)}")
    say(f"  snapshots taken: {summary['snapshots']}, committed steps undone: {summary['steps_lost']}, "
        f"in-flight micro-batches trained again: {summary['batches_dropped']}")  # fmt: skip
    say("\nresult:")
    say(f"  accuracy on the digits: reference {accuracy(job, reference.state):.3f}, "
        f"elastic {accuracy(job, elastic.state):.3f}")  # fmt: skip
    took, ref_took = summary["elapsed"], reference.summary["elapsed"]
    say(f"  final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
        f"in {took:.1f} s (reference: {ref_took:.1f} s, one worker)")  # fmt: skip
    say(f"  ledger: {summary['batches_committed']} batch ids, each exactly once: {summary['exactly_once']}")
    say(f"  parameters bitwise equal to the no-failure run: {'YES' if same else 'NO'}")
    say(f"  the flow runs in the Prefect UI: {reference.url}\n                                 {elastic.url}")
    return same and bool(summary["exactly_once"])


@dataclass
class FlowOutcome:
    summary: dict[str, Any]
    state: dict[str, torch.Tensor]
    url: str


def _run_flow(
    job: ElasticJob,
    cluster: LocalElasticCluster,
    label: str,
    faults: FaultSchedule,
    output: Path,
    ui_url: str,
    say: Callable[[str], None],
) -> FlowOutcome:
    from ..flows import elastic_training

    line = ProgressLine(label)
    done = faults.watch(cluster, job.job_id, on_progress=line)
    try:
        state = elastic_training(
            job, address=cluster.scheduler_address, output=str(output), return_state=True
        )
    finally:
        done.set()
        faults.wait()
        line.close()
    url = f"{ui_url.rstrip('/')}/runs/flow-run/{state.state_details.flow_run_id}"
    if not state.is_completed():
        raise RuntimeError(f"the flow run ended {state.type.value}: {state.message} ({url})")
    say(f"  flow run: {url}")
    summary: dict[str, Any] = state.result()  # type: ignore[assignment]
    return FlowOutcome(summary, torch.load(output, weights_only=True), url)


@contextlib.contextmanager
def prefect_api(say: Callable[[str], None], keep: bool) -> Iterator[str]:
    """The Prefect API the demo reports to: the configured one, or a local server started for it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    if PREFECT_API_URL.value():
        say(f"reporting to the configured Prefect API at {PREFECT_API_URL.value()}")
        yield str(PREFECT_UI_URL.value() or PREFECT_API_URL.value()).removesuffix("/api")
        return
    from .prefect_server import PrefectServer

    say("no Prefect API is configured: starting a local Prefect server (SQLite) ...")
    with PrefectServer() as server:
        say(f"Prefect UI at {server.ui_url} (started in {server.startup_seconds:.0f} s)")
        with server.settings():
            yield server.ui_url
        if keep:
            say(f"\nthe Prefect server stays up at {server.ui_url}; press Enter to stop it")
            with contextlib.suppress(EOFError):
                input()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefect-elastic demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=["rollback", "reassign"], default="reassign")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--keep-server", action="store_true", help="keep the local Prefect server up at the end"
    )
    args = parser.parse_args(argv)
    return 0 if run_demo(args.policy, args.epochs, args.keep_server) else 1


if __name__ == "__main__":
    sys.exit(main())
