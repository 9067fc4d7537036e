"""Compute worker (seed 000's computing server): a long-running loop, one per elastic worker per job.

Each turn it asks the coordinator for work, pulls the parameters of that step from every shard, fetches
each batch from the data server that holds it, computes one gradient per micro-batch with torch, pushes
every shard its slice tagged (generation, step, batch id), and reports the batch ids with their losses;
the answer to a report is the next work, so asking costs no extra round trip.

Stateless by construction: the model is built on torch's `meta` device, which holds shapes and no
values, and each micro-batch runs through `torch.func.functional_call` with the tensors just pulled;
those are dropped when the step ends. It holds handles to the coordinator and the shards only, so it never
talks to another compute worker. Every remote call is bounded by `job.call_timeout`.

A stale generation or a lost batch is recoverable (the loop asks for work again); a model that raises or
a loss that is not finite is reported to the coordinator as a failure that ends the job, naming the step
and the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from .allocator import tune_allocator
from .coordinator import Assignment
from .errors import RecoverableError
from .job import ElasticJob, StateLayout
from .schedule import Schedule

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

# Remote calls that fail this many times in a row (the coordinator unreachable) end the loop; the
# controller sees it and starts another loop if the worker is still a member.
MAX_CONSECUTIVE_CALL_ERRORS = 5


class ModelFailure(Exception):
    def __init__(self, step: int, batch_id: int, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.batch_id = batch_id


@dataclass
class LoopStats:
    worker: str
    steps: int = 0
    batches: int = 0
    stale: int = 0
    call_errors: int = 0
    device: str = "cpu"
    # Seconds spent in each phase of the loop, summed over the run (see docs/benchmarks.md).
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


def compute_loop(
    job: ElasticJob,
    coordinator: Any,
    shards: list[Any],
    plan: list[list[str]],
    layout: StateLayout,
    schedule: Schedule,
) -> LoopStats:
    """Runs as a Dask task pinned to one elastic worker until the job ends or the worker closes."""
    from distributed import get_worker, secede

    worker = get_worker()
    # Leave the worker's thread slot free: this task runs for the whole job, beside other jobs' loops.
    secede()
    tune_allocator()
    torch.set_num_threads(job.threads_per_worker)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    trainer = MicroBatchTrainer(job, plan, layout, device)
    stats = LoopStats(worker=worker.address, device=str(device))
    request_errors = step_errors = 0
    handed: Assignment | None = None  # the next work, when the coordinator gave it with a report
    ahead: PullAhead | None = None  # the parameters of the step after the last one, asked for early
    while worker.status.name in ("running", "paused"):
        try:
            asked = time.perf_counter()
            work, handed = handed, None
            if work is None:
                work = coordinator.request_work(worker.address).result(timeout=job.call_timeout)
                stats.add("wait", time.perf_counter() - asked)
            request_errors = 0
        except Exception as exc:
            request_errors += 1
            stats.call_errors += 1
            log.warning("compute %s: request_work failed (%s: %s)", worker.address, type(exc).__name__, exc)
            if request_errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                raise
            time.sleep(min(1.0, job.liveness_interval))
            continue
        if work is None:
            continue
        if work.stop:
            break
        try:
            losses, handed, ahead = trainer.run(
                work, coordinator, shards, schedule, worker.address, stats, ahead
            )
            step_errors = 0
        except ModelFailure as failure:
            coordinator.report_failure(
                work.generation, worker.address, failure.step, failure.batch_id, "model", str(failure)
            ).result(timeout=job.call_timeout)
            break
        except RecoverableError as exc:
            ahead = None
            stats.stale += 1
            log.debug("compute %s: step %d dropped: %s", worker.address, work.step, exc)
            continue
        except Exception as exc:
            # A shard or the coordinator did not answer in time, or its worker is gone: the step is
            # dropped here and survival detection decides what happens to it. An error that comes back
            # every time ends the loop instead, and the controller reports it.
            ahead = None
            step_errors += 1
            stats.call_errors += 1
            log.warning(
                "compute %s: step %d failed (%s: %s)", worker.address, work.step, type(exc).__name__, exc
            )
            if step_errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                raise
            continue
        stats.steps += 1
        stats.batches += len(losses)
    return stats


@dataclass
class PullAhead:
    """Pulls of step `step`'s parameters, sent with the report of the step before (see `DataServer.pull`)."""

    generation: int
    step: int
    futures: list[Any]

    def serves(self, work: Assignment) -> bool:
        return work.generation == self.generation and work.step == self.step


class MicroBatchTrainer:
    """Computes and pushes the gradients of one assignment; keeps nothing between assignments."""

    def __init__(
        self, job: ElasticJob, plan: list[list[str]], layout: StateLayout, device: torch.device
    ) -> None:
        self.job = job
        self.plan = plan
        self.device = device
        self.model = job.make_model().to("meta")  # shapes only: no parameter values live here
        self.param_names = list(layout.params)
        # Moving to meta unties tied weights (each module gets its own meta tensor), so every alias is
        # handed the tensor it shares explicitly; autograd then sums both uses into one gradient.
        self.aliases = dict(layout.aliases)
        self.loss_fn = job.loss_fn()
        self.shard_of = {name: i for i, names in enumerate(plan) for name in names}

    def run(
        self,
        work: Assignment,
        coordinator: Any,
        shards: list[Any],
        schedule: Schedule,
        worker: str,
        stats: LoopStats,
        ahead: PullAhead | None = None,
    ) -> tuple[dict[int, float], Assignment | None, PullAhead | None]:
        """Train one assignment; returns the losses, the next work the coordinator handed back, and the
        pulls of the step after this one, already on their way."""
        timeout = self.job.call_timeout
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            stats.add(phase, now - clock)
            clock = now

        gen, step = work.generation, work.step
        # Issue every read at once, then wait: the calls overlap on the wire.
        if ahead is not None and ahead.serves(work):
            pulls = ahead.futures
        else:
            pulls = [s.pull(gen, step) for s in shards]
        fetches = {b: shards[schedule.server_of(b)].get_batch(gen, b) for b in work.batch_ids}
        state: Tensors = {}
        for f in pulls:
            state.update(f.result(timeout=timeout))
        lap("pull")
        params = {n: state[n].to(self.device).requires_grad_(True) for n in self.param_names}
        buffers = {n: t for n, t in state.items() if n not in params}

        grads: list[dict[int, Tensors]] = [{} for _ in shards]
        new_buffers: list[dict[int, Tensors]] = [{} for _ in shards]
        losses: dict[int, float] = {}
        for b in work.batch_ids:
            x, y = fetches[b].result(timeout=timeout)
            lap("fetch")
            loss, g, bufs = self.gradient(params, buffers, x, y, step, b)
            losses[b] = loss
            for name, t in g.items():
                grads[self.shard_of[name]].setdefault(b, {})[name] = t
            for name, t in bufs.items():
                new_buffers[self.shard_of[name]].setdefault(b, {})[name] = t
            lap("compute")
        # Every shard hears of every batch id, also a shard that holds no parameters or no buffers.
        ids = list(work.batch_ids)
        pushes = [s.push(gen, step, ids, grads[i], new_buffers[i]) for i, s in enumerate(shards)]
        for f in pushes:
            f.result(timeout=timeout)
        lap("push")
        # Ask for the next step's parameters now: the shards answer as soon as they apply this step, so
        # the reply travels while the report's answer does. If the next work is another step or another
        # generation, these are dropped and pulled again.
        following = None
        if step + 1 < schedule.total_steps:
            following = PullAhead(gen, step + 1, [s.pull(gen, step + 1, True) for s in shards])
        handed: Assignment | None = coordinator.report(gen, worker, step, losses).result(timeout=timeout)
        lap("report")
        return losses, handed, following

    def gradient(
        self, params: Tensors, buffers: Tensors, x: torch.Tensor, y: torch.Tensor, step: int, batch_id: int
    ) -> tuple[float, Tensors, Tensors]:
        """Loss, gradient and updated buffers of one micro-batch, all on the CPU."""
        # Every micro-batch starts from the pulled buffers, so none depends on which ran first.
        bufs = {n: t.to(self.device).clone() for n, t in buffers.items()}
        tensors = {**params, **bufs}
        tensors.update({alias: tensors[name] for alias, name in self.aliases.items()})
        try:
            # Random ops (dropout) draw from a generator seeded by the batch id, not from whatever this
            # process drew before, so a micro-batch gives the same gradient on any worker.
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(micro_batch_seed(self.job.seed, batch_id))
                out = functional_call(self.model, tensors, (x.to(self.device),))
                loss = self.loss_fn(out, y.to(self.device))
                grads = torch.autograd.grad(
                    loss, list(params.values()), allow_unused=True, materialize_grads=True
                )
        except Exception as exc:
            raise ModelFailure(
                step,
                batch_id,
                f"the model raised at step {step}, batch {batch_id}: {type(exc).__name__}: {exc}",
            ) from exc
        value = float(loss.detach())
        if not torch.isfinite(loss.detach()):
            raise ModelFailure(step, batch_id, f"loss is {value} at step {step}, batch {batch_id}")
        return (
            value,
            {n: g.detach().cpu() for n, g in zip(params, grads, strict=True)},
            {n: t.detach().cpu() for n, t in bufs.items()},
        )


def micro_batch_seed(seed: int, batch_id: int) -> int:
    """The seed of the random ops of one micro-batch: a function of the job's seed and the batch id only."""
    return (seed * 1_000_003 + batch_id) % (2**63)
