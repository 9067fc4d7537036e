"""Compute worker (seed 000's computing server): a long-running loop, one per elastic worker per job.

Once per generation it asks the coordinator for its `Role` (its rank in the generation's member list);
from then on it trains its share of every step (`Schedule.share`) with no call to the coordinator. On its
own connection to every shard (`channel.py`) it asks for the next step's batches before a step computes,
computes one gradient per micro-batch with torch, and sends every shard one frame: its slice of the
gradients with the losses, tagged (generation, step), and a request for the next step's parameters. The
shard that holds all of a step's gradients applies the step and answers, so the only wait between two
steps is the round trip and the apply.

Stateless by construction: the model is built on torch's `meta` device, which holds shapes and no
values, and each micro-batch runs through `torch.func.functional_call` with the tensors just pulled;
those are dropped when the step ends. It holds handles to the coordinator and the shards only, so it never
talks to another compute worker. Every remote call is bounded by `job.call_timeout`.

A stale generation sends the loop back to the coordinator for its new role; another recoverable error
retries the step; a `FatalError` from a shard ends the loop at once; a model that raises or a loss that is
not finite is reported to the coordinator as a failure that ends the job, naming the step and the batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.func import functional_call

from .allocator import freeze_startup_objects, tune_allocator
from .channel import (
    ChannelAddress,
    Entry,
    Frame,
    ShardLink,
    contiguous_strides,
    raise_error,
    unread_answers_dropped,
    worker_tls,
)
from .compute_async import run_async
from .errors import FatalError, ModelFailure, RecoverableError, StaleGenerationError
from .job import GLOBAL_RNG_LOCK, ElasticJob, StateLayout
from .messages import CoordinatorHandle, Role, Tensors, direct
from .schedule import Schedule

log = logging.getLogger(__name__)

# Remote calls that fail this many times in a row (the coordinator unreachable) end the loop; the
# controller sees it and starts another loop if the worker is still a member.
MAX_CONSECUTIVE_CALL_ERRORS = 5
# How long a pull waits on a shard for the step before it to be applied; a step that takes longer (a
# straggler, a frozen member not yet removed) costs one more pull, never a hung call.
PULL_WAIT_SECONDS = 5.0
# A micro-batch's gradients for one shard up to this size go as one flat run (`gradient_entries`).
PACK_BYTES = 1 << 20
# Steps a loop trains before its phases count as steady (`LoopStats.steady_phases`).
WARMUP_STEPS = 5
# Set to 1 in the compute workers' environment to keep Dask's statistical profiler running while they
# train (`dask_profiler_paused`).
PROFILER_ENV = "PREFECT_ELASTIC_DASK_PROFILER"
# The name of a Dask worker plugin that, where present, is told of every push (see `PushHook`).
PUSH_HOOK = "prefect-elastic-push-hook"
# The name of a Dask worker plugin with a `factor` attribute that, where present, makes this worker's
# compute that many times slower (a straggler for tests and benchmarks: `prefect_elastic.local.slow`).
SLOWDOWN = "prefect-elastic-slowdown"


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
    # Of those, calls to a shard that waited out the call timeout (a shard that never answered: frozen, or
    # cut off, and not told of as moved by `leave_links`).
    timeouts: int = 0
    device: str = "cpu"
    # Seconds spent in each phase of the loop, summed over the run (see docs/benchmarks.md).
    phases: dict[str, float] = field(default_factory=dict)
    # The same from the loop's `WARMUP_STEPS + 1`-th step on, and how many steps that is: the first steps
    # of a process are slower (lazy initialization), and a steady-state figure leaves them out.
    steady_phases: dict[str, float] = field(default_factory=dict)
    steady_steps: int = 0
    # Async mode: batch ids trained on a candidate model (the shards' answers were late), and gradients a
    # shard refused as too stale.
    candidate_steps: int = 0
    refused: int = 0

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if self.steps >= WARMUP_STEPS:
            self.steady_phases[phase] = self.steady_phases.get(phase, 0.0) + seconds

    def trained(self) -> None:
        if self.steps >= WARMUP_STEPS:
            self.steady_steps += 1
        self.steps += 1


@dataclass
class Ahead:
    """The answers for one step, asked for before it starts: from every shard, its parameters of that
    step (sent the moment the shard applied the step before) and the batches of the share it holds, or
    the error that came instead (not applied within the wait, a fence)."""

    generation: int
    step: int
    frames: list[Frame]

    def unpack(
        self, shapes: dict[str, torch.Size]
    ) -> tuple[Tensors, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The parameters and buffers (views of the frames' tensors), and the batches by batch id.
        `shapes`: every parameter's and buffer's shape, for the shards that send theirs as flat runs."""
        state: Tensors = {}
        xs: dict[int, torch.Tensor] = {}
        ys: dict[int, torch.Tensor] = {}
        for frame in self.frames:
            error = frame.header.get("next_error")
            if error is not None:
                raise_error(error)
            for entry, tensor in frame.tensors:
                if entry.kind == "state":
                    state[entry.name] = tensor
                elif entry.kind == "params":
                    state.update(unflatten(frame.header["params"], tensor, shapes))
                elif entry.kind == "buffers":  # (one flat run of the shard's buffers of one dtype)
                    state.update(unflatten(frame.header["buffers"][entry.batch_id], tensor, shapes))
                elif entry.kind == "x":
                    xs[entry.batch_id] = tensor
                elif entry.kind == "y":
                    ys[entry.batch_id] = tensor
        return state, {b: (x, ys[b]) for b, x in xs.items()}


def moved_as_one(
    names: Sequence[str], tensors: Sequence[torch.Tensor], shapes: dict[str, torch.Size], device: torch.device
) -> Tensors:
    """`tensors` (named `names`, of one dtype) on `device`, as views of one flat tensor: one transfer
    between host and GPU where there would be one per tensor."""
    return unflatten(names, torch.cat([t.detach().reshape(-1) for t in tensors]).to(device), shapes)


def unflatten(names: Sequence[str], flat: torch.Tensor, shapes: dict[str, torch.Size]) -> Tensors:
    """Views of a shard's flat parameters (`names` in their order), one per parameter."""
    views: Tensors = {}
    at = flat.storage_offset()
    try:
        for name in names:
            shape = shapes[name]
            views[name] = flat.as_strided(shape, contiguous_strides(shape), at)
            at += shape.numel()
    except (KeyError, RuntimeError) as exc:  # not a parameter of the model; past the tensor's end
        raise FatalError(f"a shard sent parameters that do not fit the model: {exc}") from None
    expected = at - flat.storage_offset()
    if flat.dim() != 1 or not flat.is_contiguous() or expected != flat.numel():
        raise FatalError(
            f"a shard sent {flat.numel()} parameter elements for {len(names)} tensors of {expected}"
        )
    return views


def packs(params: Sequence[torch.Tensor]) -> bool:
    """Whether a shard with these parameters gets each micro-batch's gradients packed into one flat run
    (`gradient_entries`): more than one tensor, of one dtype, `PACK_BYTES` at most in all.

    Why: a frame costs a few microseconds per tensor to encode and decode, on both sides, and a step
    moves two of them each way; a model of many small tensors (a transformer's 16 of 40 KB in all) paid
    more for that than for its bytes. Packing copies the bytes once, which beyond `PACK_BYTES` costs
    more than it saves."""
    return (
        len(params) > 1
        and len({t.dtype for t in params}) == 1
        and sum(t.numel() * t.element_size() for t in params) <= PACK_BYTES
    )


def gradient_entries(
    batch_id: int, grads: list[tuple[str, torch.Tensor]], packed: bool
) -> list[tuple[Entry, torch.Tensor]]:
    """One micro-batch's gradients for one shard, in the plan's order: one flat run (kind `grads`, which
    the frame's `order` names) where `packed` (`packs`), else one entry each."""
    if packed:
        return [(Entry("grads", batch_id, ""), torch.cat([t.reshape(-1) for _, t in grads]))]
    return [(Entry("grad", batch_id, n), t) for n, t in grads]


def send_all(links: list[ShardLink], frames: Sequence[Frame | None], order: Sequence[int] = ()) -> None:
    """Frame `i` to shard `i`, in `order` where given (every index once), else in index order."""
    for i in order or range(len(links)):
        frame = frames[i]
        if frame is not None:
            links[i].send(frame)


def push_order(held_bytes: Sequence[int]) -> list[int]:
    """The order a step's frames go to the shards in: the shards holding the most parameter bytes first,
    ties in index order.

    Why: a push wakes the shard it reaches, and on a busy machine the woken process may take the sender's
    core before the next frame is written; the shard with the most to receive, apply and answer is the
    one the step waits for, so it should start first, while a shard without parameters (it only counts
    the step's batch ids) takes its turn beside it. Measured on the transformer, whose parameters all lie
    on data server 1 (4 alternating pairs): the push phase 1.97 ms a step against 2.33 ms."""
    return sorted(range(len(held_bytes)), key=lambda i: (-held_bytes[i], i))


def receive_all(links: list[ShardLink], count: list[int], timeout: float) -> list[Frame]:
    """Read `count[i]` answers from shard `i`, every one of them even after an error (no connection is
    left with an answer unread); raises the first error."""
    answers: list[Frame] = []
    first: BaseException | None = None
    for link, n in zip(links, count, strict=True):
        for _ in range(n):
            try:
                answers.append(link.receive(timeout))
            except Exception as exc:
                first = first or exc
                break  # the link closed itself: nothing more to read there
    if first is not None:
        raise first
    return answers


def exchange(links: list[ShardLink], frames: list[Frame], timeout: float) -> list[Frame]:
    """One frame to every shard, then every answer."""
    send_all(links, frames)
    return receive_all(links, [1] * len(links), timeout)


def compute_loop(
    job: ElasticJob,
    coordinator: CoordinatorHandle,
    plan: list[list[str]],
    layout: StateLayout,
    schedule: Schedule,
) -> LoopStats:
    """Runs as a Dask task pinned to one elastic worker until the job ends, the worker closes, or the
    controller cancels it."""
    from distributed import get_worker, secede
    from distributed.worker import thread_state

    worker = get_worker()
    address = worker.address
    key = thread_state.key
    coordinator = direct(coordinator)
    # Leave the worker's thread slot free: this task runs for the whole job, beside other jobs' loops.
    secede()
    tune_allocator()
    torch.set_num_threads(job.threads_per_worker)
    device = training_device()
    trainer = MicroBatchTrainer(job, plan, layout, device, lambda: worker.plugins.get(SLOWDOWN))
    hook: PushHook | None = worker.plugins.get(PUSH_HOOK)  # type: ignore[assignment]
    stats = LoopStats(worker=address, device=str(device))
    timeout = job.call_timeout

    def wanted() -> bool:
        # A loop the controller cancelled (its worker left the membership) keeps running in its thread;
        # once its task is no longer running on the worker, it ends instead of training beside a new one.
        ts = worker.state.tasks.get(key)
        running = ts is not None and ts.state in ("executing", "long-running")
        return running and worker.status.name in ("running", "paused")

    # One connection to every shard (channel.py), opened on first use and again after any error; where
    # the shards listen comes with each role (a data server promoted onto a standby listens elsewhere).
    shards: list[ShardLink] = []
    data: list[ShardLink] = []  # async mode: a second connection to every shard, for batches only
    with _LOOPS_LOCK:
        _LINKS.setdefault(job.job_id, []).extend([shards, data])
    try:
        with dask_profiler_paused(worker):
            if job.mode == "async":
                return run_async(
                    address, coordinator, shards, data, trainer, schedule, stats, timeout, wanted
                )
            return _run(address, coordinator, shards, trainer, schedule, stats, hook, timeout, wanted)
    finally:
        with _LOOPS_LOCK:
            mine = _LINKS.get(job.job_id, [])
            mine[:] = [links for links in mine if links is not shards and links is not data]
            if not mine:
                _LINKS.pop(job.job_id, None)
        for link in (*shards, *data):
            link.close()


# Compute loops running in each worker of this process (by `id`): Dask's profiler is paused while any is.
_LOOPS: dict[int, int] = {}
_LOOPS_LOCK = threading.Lock()
# The connections of the compute loops running in this process, by job id (each loop's lists, which it
# changes in place as shards move): `leave_links` wakes a loop blocked on a shard whose role moved.
_LINKS: dict[str, list[list[ShardLink]]] = {}


def leave_links(job_id: str, channels: Sequence[Sequence[Any]]) -> int:
    """Runs on a compute worker (`Client.run`, from the controller) once data servers' roles moved to
    standbys: wakes every loop of `job_id` blocked on a connection to one of the old `channels`; it then
    asks the coordinator for its role, which names where the shards listen now. Returns how many
    connections it broke.

    A frozen (or cut-off) static worker's kernel keeps its connections open, so a loop waiting for its
    answer would wait out `call_timeout` (30 s by default) after its role had long moved; a killed one's
    connections close by themselves."""
    moved = {ChannelAddress(*channel) for channel in channels}
    broken = 0
    with _LOOPS_LOCK:
        links = [link for loop in _LINKS.get(job_id, []) for link in loop]
    for link in links:
        if link.address in moved:
            link.interrupt()
            broken += 1
    return broken


_PROFILER_CALLBACKS = ("profile", "profile-cycle")


@contextlib.contextmanager
def dask_profiler_paused(worker: Any) -> Iterator[None]:
    """Dask's statistical profiler stopped on `worker` while this loop, or another job's loop there, runs.

    Why: every 10 ms (`distributed.worker.profile.interval`) the worker's event loop walks the stack of
    every thread that runs a task, this loop's among them, twice, holding the GIL, which the loop's
    thread then waits for between torch's kernels. In profiles of the transformer's steady state (py-spy)
    the compute worker's event loop was busy 16% of the time with it, 2% without; the compute phase of a
    step took 13.37 ms against 13.71 in one A/B (4 alternating pairs on one cluster, 2026-11-27), and the
    same within the noise in another (two clusters). A profile of a task that runs for the whole job
    says little anyway. `PREFECT_ELASTIC_DASK_PROFILER=1` in the workers' environment keeps it running."""
    callbacks = [pc for name, pc in list(worker.periodic_callbacks.items()) if name in _PROFILER_CALLBACKS]
    if not callbacks or os.environ.get(PROFILER_ENV) == "1":
        yield
        return
    with _LOOPS_LOCK:
        _LOOPS[id(worker)] = _LOOPS.get(id(worker), 0) + 1
    _on_event_loop(worker, _sync_profiler, worker, callbacks)
    try:
        yield
    finally:
        with _LOOPS_LOCK:
            _LOOPS[id(worker)] -= 1
            if not _LOOPS[id(worker)]:
                del _LOOPS[id(worker)]
        _on_event_loop(worker, _sync_profiler, worker, callbacks)


def _on_event_loop(worker: Any, fn: Callable[..., None], *args: Any) -> None:
    # (A periodic callback is started and stopped on its event loop. After the event loop closed, tornado
    # drops the call; a worker closing has stopped every periodic callback itself.)
    with contextlib.suppress(RuntimeError):
        worker.loop.add_callback(fn, *args)


def _sync_profiler(worker: Any, callbacks: list[Any]) -> None:
    """The profiler paused while a loop runs in `worker`, running otherwise. It reads the count when it
    runs, not when it was queued: two loops' calls, queued from two threads, may arrive in either order."""
    with _LOOPS_LOCK:
        paused = _LOOPS.get(id(worker), 0) > 0
    for pc in callbacks:
        if paused:
            pc.stop()
        # (Not on a worker closing: `Worker.close` stopped them. One retiring may yet go back to running.)
        elif worker.status.name in ("running", "paused", "closing_gracefully") and not pc.is_running():
            pc.start()


def _run(
    address: str,
    coordinator: CoordinatorHandle,
    shards: list[ShardLink],
    trainer: MicroBatchTrainer,
    schedule: Schedule,
    stats: LoopStats,
    hook: PushHook | None,
    timeout: float,
    wanted: Callable[[], bool],
) -> LoopStats:
    job = trainer.job
    role: Role | None = None
    known = -1  # the generation whose role the loop has (or had)
    step = 0
    errors = 0
    retries = 0
    ahead: Ahead | None = None
    resume = (-1, 0)  # (generation, step) to go on from if the coordinator gives the same role again
    unreachable: list[float] = []  # when each failed connection to a shard since the last step failed
    while wanted():
        if role is None or step >= schedule.total_steps:
            # No role yet, a new generation, or past the last step: ask (a long poll of the coordinator).
            got, errors = ask_role(coordinator, address, known, stats, job, errors)
            if got is None:
                continue
            if got.stop:
                break
            reconnect(shards, got.channels, timeout)
            if got.generation == resume[0]:
                # The role this loop had, asked again after a shard did not answer: go on where it was.
                role, known, step, ahead = got, got.generation, resume[1], None
            else:
                role, known, step, ahead, retries = got, got.generation, got.start_step, None, 0
                errors = 0
            resume = (-1, 0)
            log.debug("compute %s: rank %d of %d from step %d", address, role.rank, role.size, step)
            continue
        share = schedule.share(step, role.rank, role.size)
        if not share:
            step += 1  # more members than micro-batches in this step
            continue
        try:
            with unread_answers_dropped(shards):
                ahead = trainer.step(role, step, share, shards, schedule, stats, ahead, hook)
            stats.trained()
            freeze_startup_objects()  # (once per process, after its first step: see allocator.py)
            step += 1
            errors = retries = 0
            unreachable.clear()
        except ModelFailure as failure:
            coordinator.report_failure(
                role.generation, address, failure.step, failure.batch_id, "model", str(failure)
            ).result(timeout=timeout)
            role, ahead = None, None  # the job ends, or (an old generation's failure) the loop goes on
        except StaleGenerationError as exc:
            stats.stale += 1
            log.debug("compute %s: step %d of an old generation: %s", address, step, exc)
            role, ahead = None, None
        except RecoverableError as exc:
            # The step before was not applied within the pull's wait (a straggler, or a member that froze
            # and is about to be removed): try this step again. A loop that keeps failing asks for its
            # role again, which a fence answers.
            ahead = None
            retries += 1
            log.debug("compute %s: step %d not ready: %s", address, step, exc)
            if retries >= MAX_CONSECUTIVE_CALL_ERRORS:
                role, known = None, -1
        except FatalError:
            raise
        except Exception as exc:
            # A shard did not answer in time, or its worker is gone: survival detection decides what
            # happens to the step. An error that comes back every time ends the loop, and the controller
            # reports it.
            ahead = None
            stats.call_errors += 1
            stats.timeouts += isinstance(exc, TimeoutError)
            log.warning("compute %s: step %d failed (%s: %s)", address, step, type(exc).__name__, exc)
            if isinstance(exc, OSError):
                # A shard's worker may be gone: the coordinator then suspends training until a standby
                # takes its role (or every shard goes back to a checkpoint), and the next role says where
                # it listens. Until then the same role comes back: ask again, waiting longer each time, for
                # up to a call timeout (the controller has acted on a lost worker long before).
                unreachable.append(time.monotonic())
                if unreachable[-1] - unreachable[0] > timeout:
                    raise
                time.sleep(min(1.0, 0.05 * 2 ** len(unreachable)))
                resume = (role.generation, step)
                role, known = None, -1
                continue
            errors += 1
            if errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                raise
    return stats


def ask_role(
    coordinator: CoordinatorHandle, address: str, known: int, stats: LoopStats, job: ElasticJob, errors: int
) -> tuple[Role | None, int]:
    """The loop's role in a generation newer than `known` (a long poll of the coordinator), or None, and
    how many asks in a row have failed (`errors` counts them: the loop ends after
    `MAX_CONSECUTIVE_CALL_ERRORS`, the controller then starts another if the worker is still a member)."""
    try:
        asked = time.perf_counter()
        got = coordinator.role(address, known).result(timeout=job.call_timeout)
        stats.add("role", time.perf_counter() - asked)
        return got, errors
    except Exception as exc:
        stats.call_errors += 1
        log.warning("compute %s: role failed (%s: %s)", address, type(exc).__name__, exc)
        if errors + 1 >= MAX_CONSECUTIVE_CALL_ERRORS:
            raise
        time.sleep(min(1.0, job.liveness_interval))
        return None, errors + 1


def reconnect(links: list[ShardLink], channels: Sequence[ChannelAddress], timeout: float) -> None:
    """Connections to where the shards listen now (a promoted data server listens elsewhere)."""
    wanted = [ChannelAddress(*channel) for channel in channels]
    if [link.address for link in links] != wanted:
        for link in links:
            link.close()
        tls = worker_tls("connect")  # (the cluster's TLS, if it has any, covers the step path too)
        links[:] = [ShardLink(channel, timeout, tls) for channel in wanted]


class MicroBatchTrainer:
    """Computes and pushes the gradients of one share of a step; keeps nothing between steps."""

    def __init__(
        self,
        job: ElasticJob,
        plan: list[list[str]],
        layout: StateLayout,
        device: torch.device,
        slowdown: Callable[[], Any] = lambda: None,
    ) -> None:
        self.job = job
        self._slowdown = slowdown
        self.plan = plan
        self.device = device
        # Shapes only: no parameter values live here. (Built under the lock, as every model is: another
        # job's loop in this process may be drawing from torch's global generator.)
        self.model = job.initial_model().to("meta")
        self.param_names = list(layout.params)
        # Moving to meta unties tied weights (each module gets its own meta tensor), so every alias is
        # handed the tensor it shares explicitly; autograd then sums both uses into one gradient.
        self.aliases = dict(layout.aliases)
        self.loss_fn = job.loss_fn()
        self.shard_of = {name: i for i, names in enumerate(plan) for name in names}
        # Each shard's parameters (its plan has its buffers too), in the plan's order: the gradients a
        # frame carries to it, and the order of a packed run of them (the frame's `order`).
        params = set(self.param_names)
        self.shard_params = [[n for n in names if n in params] for names in plan]
        meta = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        self.shapes = {n: t.shape for n, t in {**buffers, **meta}.items()}
        # Each shard's buffers in the order a push carries them: grouped by dtype (in the plan's order
        # within a group), so that a micro-batch's buffers of one dtype lie back to back in the frame and
        # the shard updates them as one run (`ShardBuffers.update`).
        dtypes = list(dict.fromkeys(b.dtype for b in buffers.values()))
        self.buffer_order = [
            sorted((n for n in names if n in buffers), key=lambda n: dtypes.index(buffers[n].dtype))
            for names in plan
        ]
        # (Decided once: a gradient has its parameter's dtype and shape.)
        self.packed = [packs([meta[n] for n in names]) for names in self.shard_params]
        # On a GPU, the gradients come back as one flat run where they share a dtype (`to_host`), and so do
        # the parameters go to it where they are small besides (`on_device`).
        self.one_run = len({meta[n].dtype for n in self.param_names}) == 1
        self.small = sum(meta[n].numel() * meta[n].element_size() for n in self.param_names) <= PACK_BYTES
        self.push_order = push_order(
            [sum(meta[n].numel() * meta[n].element_size() for n in names) for names in self.shard_params]
        )
        # Data servers that hold no state (`plan_shards` gave a small model's to as few as it needs): a
        # push there only counts the step's batch ids, and the loop reads its answer just before its next
        # push instead of waiting for it (see `step`).
        self.stateless = [not names for names in plan]
        self.pull_wait = min(PULL_WAIT_SECONDS, job.call_timeout / 2)

    def then(
        self, role: Role, step: int, schedule: Schedule, params: bool = True, batches: bool = True
    ) -> list[dict[str, Any] | None]:
        """What to ask every shard for `step`: its parameters (the shard waits until it has applied the
        step before) and the batches of this worker's share that it holds. None where there is nothing
        to ask (past the last step, no batch of the share there)."""
        if step >= schedule.total_steps:
            return [None] * len(self.plan)
        share = schedule.share(step, role.rank, role.size) if batches else ()
        asks: list[dict[str, Any] | None] = []
        for i in range(len(self.plan)):
            held = [b for b in share if schedule.server_of(b) == i]
            if params or held:
                asks.append({"step": step if params else None, "wait": self.pull_wait, "batches": held})
            else:
                asks.append(None)
        return asks

    def fetch(self, role: Role, step: int, shards: list[ShardLink], schedule: Schedule) -> Ahead:
        """Ask every shard for `step` alone (a loop's first step in a generation, or after a failure)."""
        if any(link.pending for link in shards):
            # A stateless data server's answer to the last push of a step or generation that ended: what
            # became of that push no longer matters (a fence voided it, or the run ended).
            with contextlib.suppress(RecoverableError):  # (a stale generation's too)
                receive_all(shards, [link.pending for link in shards], self.job.call_timeout)
        # The parameters as a copy, never read in place (`published.py`): a loop fetches a step it may
        # have pushed in part already (its frame to one shard went in, another's failed), and a shard that
        # holds its batch ids from that push may apply the step, writing its parameters, while this loop
        # computes the step again for the shards that lack them.
        frames = [
            Frame({"op": "pull", "generation": role.generation, "then": then and {**then, "copy": True}})
            for then in self.then(role, step, schedule)
        ]
        return Ahead(role.generation, step, exchange(shards, frames, self.job.call_timeout))

    def step(
        self,
        role: Role,
        step: int,
        share: tuple[int, ...],
        shards: list[ShardLink],
        schedule: Schedule,
        stats: LoopStats,
        ahead: Ahead | None,
        hook: PushHook | None = None,
    ) -> Ahead | None:
        """Train this worker's share of `step` and push it; returns the answers for its next step."""
        timeout = self.job.call_timeout
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            stats.add(phase, now - clock)
            clock = now

        gen = role.generation
        if ahead is None or (ahead.generation, ahead.step) != (gen, step):
            ahead = self.fetch(role, step, shards, schedule)
        state, batches = ahead.unpack(self.shapes)
        del ahead
        # The next step's batches do not depend on this step: ask for them now, so that the shards send
        # them while this step computes (their answers wait in the socket until read).
        early_asks = [
            None
            if then is None or hook is not None
            else Frame({"op": "pull", "generation": gen, "then": then})
            for then in self.then(role, step + 1, schedule, params=False)
        ]
        send_all(shards, early_asks)
        lap("pull")
        params = self.on_device(state)
        buffers = {n: t for n, t in state.items() if n not in params}

        following = self.then(role, step + 1, schedule, batches=False)
        frames = [
            Frame(
                {
                    "op": "push",
                    "generation": gen,
                    "step": step,
                    "worker": role.members[role.rank],
                    "losses": {},
                    "then": then if hook is None and not stateless else None,
                    "order": names,  # the parameters a packed gradient covers (`gradient_entries`)
                }
            )
            for then, names, stateless in zip(following, self.shard_params, self.stateless, strict=True)
        ]
        for b in share:
            x, y = batches[b]
            began = time.perf_counter()
            loss, g, bufs = self.gradient(params, buffers, x, y, step, b)
            self.slow_down(time.perf_counter() - began)
            # Every shard hears of every batch id (the losses name them), also a shard that holds no
            # parameters or no buffers: each applies the step when it holds all of its batch ids.
            for frame in frames:
                frame.header["losses"][str(b)] = loss
            # A micro-batch's gradients back to back, in the plan's order, then its buffers: the shard
            # takes them as one flat gradient without a copy (`shard_optimizer.py`).
            for i in range(len(self.plan)):
                frames[i].tensors += gradient_entries(
                    b, [(n, g[n]) for n in self.shard_params[i]], self.packed[i]
                )
                frames[i].tensors += [(Entry("buffer", b, n), bufs[n]) for n in self.buffer_order[i]]
            lap("compute")
        del state, params, buffers, batches
        if hook is None:
            # One frame to every shard: this step's gradients, and a request for the next step's
            # parameters, which the shard answers once it has applied this step. (Sending a shard its
            # frame during backward, once its gradients are in, was tried: 4% faster on cnn-20, but a
            # worker killed during backward then leaves the shards a version apart, which costs a
            # rollback to the snapshot; see docs/design/step-channel.md.)
            # A stateless data server's answer to this push is left in its socket and read just before
            # the next step's push: the step does not wait for a server whose state nothing needs, which
            # has the whole next compute to answer. It may then get a push of the next step before
            # another worker's push of this one, and keeps it until then (`DataServer.push`). Reading the
            # answer before the next push keeps it at most a version behind the others: no loop pushes
            # `s + 1` anywhere before that server has taken its push of `s`. A push that never comes (its
            # worker died between the frames) leaves it a version behind, which the fence finds as it
            # finds any two shards a version apart.
            skips = list(zip(shards, self.stateless, strict=True))
            answers = receive_all(shards, [link.pending if skip else 0 for link, skip in skips], timeout)
            send_all(shards, frames, self.push_order)
            answers += receive_all(shards, [link.pending - skip for link, skip in skips], timeout)
            lap("push")
            return Ahead(gen, step + 1, answers) if following[0] is not None else None
        for i, (link, frame) in enumerate(zip(shards, frames, strict=True)):
            link.request(frame, timeout)

            def wait_applied(link: ShardLink = link) -> None:
                wait = {"step": step + 1, "wait": self.pull_wait, "batches": []}
                answer = link.request(Frame({"op": "pull", "generation": gen, "then": wait}), timeout)
                raise_error(answer.header.get("next_error") or {})

            hook.after_push(i, step, wait_applied)
        lap("push")
        return None

    def slow_down(self, took: float) -> None:
        """Where this worker is made a straggler (a `SLOWDOWN` plugin with a `factor`), take `factor`
        times as long as the compute that just took `took` seconds."""
        plugin = self._slowdown()
        factor = float(getattr(plugin, "factor", 1.0)) if plugin is not None else 1.0
        if factor > 1.0:
            time.sleep((factor - 1.0) * took)

    def on_device(self, state: Tensors) -> Tensors:
        """The parameters in `state` on this worker's device, as the leaves that `gradient` differentiates
        against (the loop's own tensors stay as they are). Small parameters go to a GPU as one transfer,
        not one per tensor: each is a synchronous copy of its own, and a model of many small tensors paid
        more for the copies' count than for their bytes. Large ones go one by one: joining them into one
        run is a copy of their bytes in host memory, which cost more than it saved (docs/benchmarks.md,
        "On a GPU": cnn-gpu's 3.6 MB)."""
        names = self.param_names
        if self.device.type == "cuda" and self.one_run and self.small:
            state = moved_as_one(names, [state[n] for n in names], self.shapes, self.device)
        return {n: state[n].to(self.device).detach().requires_grad_(True) for n in names}

    def to_host(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients (in `param_names`' order) in host memory, for the push: from a GPU as one transfer
        (joined into one run on the GPU, where that copy costs next to nothing)."""
        if self.device.type == "cuda" and self.one_run:
            host = torch.device("cpu")
            return list(moved_as_one(self.param_names, grads, self.shapes, host).values())
        return [g.detach().cpu() for g in grads]

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
            # process drew before, so a micro-batch gives the same gradient on any worker. The generator
            # is the process's one global generator: the lock keeps another thread (another job's loop in
            # this worker, a model being built) from seeding or drawing from it in between. Backward is
            # inside too, for ops that draw there; the lock costs nothing to a worker with one loop.
            cuda = [self.device] if self.device.type == "cuda" else []
            with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=cuda):
                seed = micro_batch_seed(self.job.seed, batch_id)
                # Only the generators this micro-batch draws from: `torch.manual_seed` also queues a
                # seed for every CUDA device not started yet, recording a Python traceback each time
                # (75 us a micro-batch on a CPU worker, 4% of an mlp step).
                torch.random.default_generator.manual_seed(seed)
                if self.device.type == "cuda":
                    torch.cuda.manual_seed(seed)
                versions = [p._version for p in params.values()]
                out = functional_call(self.model, tensors, (x.to(self.device),))
                loss = self.loss_fn(out, y.to(self.device))
                grads = torch.autograd.grad(
                    loss, list(params.values()), allow_unused=True, materialize_grads=True
                )
                changed = [n for (n, p), v in zip(params.items(), versions, strict=True) if p._version != v]
                if changed:
                    # A compute worker holds no parameters between steps: the change would be lost, and
                    # on a CPU worker it would write into the shard's memory, which the loop reads in
                    # place (`published.py`).
                    raise ModelFailure(
                        step,
                        batch_id,
                        f"the model changed its parameters {changed} in place at step {step}, batch "
                        f"{batch_id}: parameters change only through the job's optimizer (work on a copy "
                        "in forward, e.g. `w = self.weight.clamp(-1, 1)`; nn.Embedding's `max_norm` "
                        "renormalizes its weight in place)",
                    )
                # Read after backward, not before: on a GPU, reading it waits for the device, which then
                # idles while backward's kernels are queued. A loss that is not finite fails the job; its
                # gradient is never pushed.
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise ModelFailure(step, batch_id, f"loss is {value} at step {step}, batch {batch_id}")
        except ModelFailure:
            raise
        except Exception as exc:
            raise ModelFailure(
                step,
                batch_id,
                f"the model raised at step {step}, batch {batch_id}: {type(exc).__name__}: {exc}",
            ) from exc
        return (
            value,
            dict(zip(params, self.to_host(grads), strict=True)),
            {n: t.detach().cpu() for n, t in bufs.items()},
        )


def training_device() -> torch.device:
    """The device a compute worker trains on: its GPU where it has one, with deterministic kernels.

    A micro-batch must give the same gradient bits on every worker (invariant 2: the result is bitwise
    equal to the one-worker, no-fault run). On CPU it does; on CUDA, cuDNN may pick a different algorithm
    from one call to the next (`benchmark`), some backward kernels sum with atomics in whatever order
    threads finish, and cuBLAS does so across streams unless its workspace is fixed. These settings are
    the process's, so every job's loop in this worker shares them; an op with no deterministic CUDA
    kernel warns (rather than failing the user's model) and then bitwise equality is not promised.
    Bits are the same across workers of one GPU model and software stack, not across models.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Read when cuBLAS makes its first handle: before this process's first CUDA matrix product.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    # (That setting also fills every new tensor with NaN, host buffers included: a pass over the receive
    # buffers of each step for nothing, since the step overwrites them.)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    return torch.device("cuda")


def micro_batch_seed(seed: int, batch_id: int) -> int:
    """The seed of the random ops of one micro-batch: a function of the job's seed and the batch id only."""
    return (seed * 1_000_003 + batch_id) % (2**63)
