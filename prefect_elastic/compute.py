"""Compute worker (seed 000's computing server): a long-running loop, one per elastic worker per job.

Once per generation it asks the coordinator for its `Role` (its rank in the generation's member list);
from then on it trains its share of every step (`Schedule.share`) with no call to the coordinator: it
pulls the step's parameters from every shard, fetches its batches from the data servers that hold them,
computes one gradient per micro-batch with torch, and pushes every shard its slice with the losses,
tagged (generation, step). The shard that holds all of a step's gradients applies the step. Right after
its pushes the loop asks every shard for the next step's parameters (the shard answers the moment it has
applied this step) and fetches the next step's batches, so the only wait between two steps is the apply.

Stateless by construction: the model is built on torch's `meta` device, which holds shapes and no
values, and each micro-batch runs through `torch.func.functional_call` with the tensors just pulled;
those are dropped when the step ends. It holds handles to the coordinator and the shards only, so it never
talks to another compute worker. Every remote call is bounded by `job.call_timeout`.

A stale generation sends the loop back to the coordinator for its new role; another recoverable error
retries the step; a `FatalError` from a shard ends the loop at once; a model that raises or a loss that is
not finite is reported to the coordinator as a failure that ends the job, naming the step and the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.func import functional_call

from .allocator import tune_allocator
from .errors import FatalError, ModelFailure, RecoverableError, StaleGenerationError
from .job import ElasticJob, StateLayout
from .messages import Call, CoordinatorHandle, Role, ShardHandle, Tensors
from .schedule import Schedule

log = logging.getLogger(__name__)

# Remote calls that fail this many times in a row (the coordinator unreachable) end the loop; the
# controller sees it and starts another loop if the worker is still a member.
MAX_CONSECUTIVE_CALL_ERRORS = 5
# How long a pull waits on a shard for the step before it to be applied; a step that takes longer (a
# straggler, a frozen member not yet removed) costs one more pull, never a hung call.
PULL_WAIT_SECONDS = 5.0
# The name of a Dask worker plugin that, where present, is told of every push (see `PushHook`).
PUSH_HOOK = "prefect-elastic-push-hook"


class PushHook(Protocol):
    """Fault injection between the pushes of one step (`prefect_elastic.local.faults`): where a worker
    has a plugin of this shape registered as `PUSH_HOOK`, the loop pushes to the shards one by one and
    calls it after each, with a function that waits until that shard has applied the step."""

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None: ...


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


@dataclass
class Prefetch:
    """The calls for one step sent before it starts: its parameters from every shard and its batches."""

    generation: int
    step: int
    pulls: list[Call[Tensors]]
    fetches: dict[int, Call[tuple[torch.Tensor, torch.Tensor]]]


def compute_loop(
    job: ElasticJob,
    coordinator: CoordinatorHandle,
    shards: list[ShardHandle],
    plan: list[list[str]],
    layout: StateLayout,
    schedule: Schedule,
) -> LoopStats:
    """Runs as a Dask task pinned to one elastic worker until the job ends, the worker closes, or the
    controller cancels it."""
    from distributed import get_worker, secede
    from distributed.worker import thread_state

    worker = get_worker()
    key = thread_state.key
    # Leave the worker's thread slot free: this task runs for the whole job, beside other jobs' loops.
    secede()
    tune_allocator()
    torch.set_num_threads(job.threads_per_worker)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    trainer = MicroBatchTrainer(job, plan, layout, device)
    hook: PushHook | None = worker.plugins.get(PUSH_HOOK)  # type: ignore[assignment]
    stats = LoopStats(worker=worker.address, device=str(device))
    timeout = job.call_timeout

    def wanted() -> bool:
        # A loop the controller cancelled (its worker left the membership) keeps running in its thread;
        # once its task is no longer running on the worker, it ends instead of training beside a new one.
        ts = worker.state.tasks.get(key)
        running = ts is not None and ts.state in ("executing", "long-running")
        return running and worker.status.name in ("running", "paused")

    role: Role | None = None
    known = -1  # the generation whose role the loop has (or had)
    step = 0
    errors = 0
    retries = 0
    ahead: Prefetch | None = None
    while wanted():
        if role is None or step >= schedule.total_steps:
            # No role yet, a new generation, or past the last step: ask (a long poll of the coordinator).
            try:
                asked = time.perf_counter()
                got = coordinator.role(worker.address, known).result(timeout=timeout)
                stats.add("role", time.perf_counter() - asked)
                errors = 0
            except Exception as exc:
                errors += 1
                stats.call_errors += 1
                log.warning("compute %s: role failed (%s: %s)", worker.address, type(exc).__name__, exc)
                if errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                    raise
                time.sleep(min(1.0, job.liveness_interval))
                continue
            if got is None:
                continue
            if got.stop:
                break
            role, known, step, ahead, retries = got, got.generation, got.start_step, None, 0
            log.debug("compute %s: rank %d of %d from step %d", worker.address, role.rank, role.size, step)
            continue
        share = schedule.share(step, role.rank, role.size)
        if not share:
            step += 1  # more members than micro-batches in this step
            continue
        try:
            ahead = trainer.step(role, step, share, shards, schedule, stats, ahead, hook)
            step += 1
            errors = retries = 0
        except ModelFailure as failure:
            coordinator.report_failure(
                role.generation, worker.address, failure.step, failure.batch_id, "model", str(failure)
            ).result(timeout=timeout)
            role, ahead = None, None  # the job ends, or (an old generation's failure) the loop goes on
        except StaleGenerationError as exc:
            stats.stale += 1
            log.debug("compute %s: step %d of an old generation: %s", worker.address, step, exc)
            role, ahead = None, None
        except RecoverableError as exc:
            # The step before was not applied within the pull's wait (a straggler, or a member that froze
            # and is about to be removed): try this step again. A loop that keeps failing asks for its
            # role again, which a fence answers.
            ahead = None
            retries += 1
            log.debug("compute %s: step %d not ready: %s", worker.address, step, exc)
            if retries >= MAX_CONSECUTIVE_CALL_ERRORS:
                role, known = None, -1
        except FatalError:
            raise
        except Exception as exc:
            # A shard did not answer in time, or its worker is gone: survival detection decides what
            # happens to the step. An error that comes back every time ends the loop, and the controller
            # reports it.
            ahead = None
            errors += 1
            stats.call_errors += 1
            log.warning("compute %s: step %d failed (%s: %s)", worker.address, step, type(exc).__name__, exc)
            if errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                raise
    return stats


class MicroBatchTrainer:
    """Computes and pushes the gradients of one share of a step; keeps nothing between steps."""

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
        self.pull_wait = min(PULL_WAIT_SECONDS, job.call_timeout / 2)

    def prefetch(
        self, role: Role, step: int, shards: list[ShardHandle], schedule: Schedule
    ) -> Prefetch | None:
        """Send the calls of `step` (the parameters, waiting for the step before, and the batches)."""
        if step >= schedule.total_steps:
            return None
        share = schedule.share(step, role.rank, role.size)
        if not share:
            return None
        gen = role.generation
        return Prefetch(
            gen,
            step,
            [s.pull(gen, step, self.pull_wait) for s in shards],
            {b: shards[schedule.server_of(b)].get_batch(gen, b) for b in share},
        )

    def step(
        self,
        role: Role,
        step: int,
        share: tuple[int, ...],
        shards: list[ShardHandle],
        schedule: Schedule,
        stats: LoopStats,
        ahead: Prefetch | None,
        hook: PushHook | None = None,
    ) -> Prefetch | None:
        """Train this worker's share of `step` and push it; returns the calls of its next step, sent."""
        timeout = self.job.call_timeout
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            stats.add(phase, now - clock)
            clock = now

        gen = role.generation
        calls = ahead if ahead is not None and (ahead.generation, ahead.step) == (gen, step) else None
        if calls is None:
            calls = self.prefetch(role, step, shards, schedule)
            assert calls is not None
        state: Tensors = {}
        for f in calls.pulls:
            state.update(f.result(timeout=timeout))
        lap("pull")
        params = {n: state[n].to(self.device).requires_grad_(True) for n in self.param_names}
        buffers = {n: t for n, t in state.items() if n not in params}

        grads: list[dict[int, Tensors]] = [{} for _ in shards]
        new_buffers: list[dict[int, Tensors]] = [{} for _ in shards]
        losses: dict[int, float] = {}
        for b in share:
            x, y = calls.fetches[b].result(timeout=timeout)
            lap("fetch")
            loss, g, bufs = self.gradient(params, buffers, x, y, step, b)
            losses[b] = loss
            for name, t in g.items():
                grads[self.shard_of[name]].setdefault(b, {})[name] = t
            for name, t in bufs.items():
                new_buffers[self.shard_of[name]].setdefault(b, {})[name] = t
            lap("compute")
        del state, params, buffers
        worker = role.members[role.rank]
        # Every shard hears of every batch id (the losses name them), also a shard that holds no
        # parameters or no buffers: each applies the step when it holds all of its batch ids.
        if hook is None:
            pushes = [
                s.push(gen, step, worker, grads[i], new_buffers[i], losses) for i, s in enumerate(shards)
            ]
            following = self.prefetch(role, step + 1, shards, schedule)
            for pushed in pushes:
                pushed.result(timeout=timeout)
        else:
            for i, s in enumerate(shards):
                s.push(gen, step, worker, grads[i], new_buffers[i], losses).result(timeout=timeout)

                def wait_applied(shard: ShardHandle = s) -> None:
                    shard.pull(gen, step + 1, self.pull_wait).result(timeout=timeout)

                hook.after_push(i, step, wait_applied)
            following = self.prefetch(role, step + 1, shards, schedule)
        lap("push")
        return following

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
