"""The trainer of one compute loop (`MicroBatchTrainer`): the model on torch's `meta` device, a
micro-batch's gradient against the parameters just pulled, and a sync step's frames (what to ask each
shard for, the gradients and buffers each one gets). It keeps nothing between steps.

Both loops (`sync_loop.py`, `async_session.py`) compute through it; how a sync step's frames reach the
shards is the `StepPush` it is handed (`pushes.py`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from ..data.fields import XY_FIELDS, Batch
from ..data.maker import LocalBatches
from ..job import GLOBAL_RNG_LOCK, LoopSpec, StateLayout
from ..messages import Role, Tensors
from ..schedule import Schedule
from ..sharding import Piece, part, pieces_of
from ..wire import Confirm, Entry, Pull, Push, ShardLink, Then
from ..wire.signals import ModelFailure, RecoverableError
from .bucket_pull import bucket_pull_for
from .bucket_push import bucket_push_for
from .buckets import ForwardGate, unguarded
from .device import micro_batch_seed, straggle
from .frames import (
    PACK_BYTES,
    Ahead,
    exchange,
    gradient_entries,
    moved_as_one,
    packs,
    push_order,
    receive_all,
    send_all,
)
from .pushes import Pipelined, StepPush
from .stats import LoopStats, PhaseClock

if TYPE_CHECKING:
    import numpy as np

    from ..data.batches import BatchSpec

log = logging.getLogger(__name__)

# How long a pull waits on a shard for the step before it to be applied; a step that takes longer (a
# straggler, a frozen member not yet removed) costs one more pull, never a hung call.
PULL_WAIT_SECONDS = 5.0
# The engine's push path (`pushes.py`).
PIPELINED = Pipelined()

Batches = dict[int, Batch]  # a step's batches by batch id


class MicroBatchTrainer:
    """Computes and pushes the gradients of one share of a step; keeps nothing between steps."""

    def __init__(
        self,
        spec: LoopSpec,
        plan: Sequence[Sequence[Piece | str]],
        layout: StateLayout,
        device: torch.device,
        slowdown: Callable[[], Any] = lambda: None,
        batches: BatchSpec | None = None,
    ) -> None:
        """`batches`: what makes the job's batches; where they are made on the compute workers, this
        loop's are made ahead by a process of its own (`data/maker.py`), else its shards send them."""
        self.spec = spec
        self._slowdown = slowdown
        self.device = device
        # Shapes only: no parameter values live here. (Built under the lock, as every model is: another
        # job's loop in this process may be drawing from torch's global generator.)
        self.model = spec.model_spec.initial_model().to("meta")
        self.param_names = list(layout.params)
        # Moving to meta unties tied weights (each module gets its own meta tensor), so every alias is
        # handed the tensor it shares explicitly; autograd then sums both uses into one gradient.
        self.aliases = dict(layout.aliases)
        self.loss_fn = spec.model_spec.loss_fn()
        self.fields = batches.fields if batches is not None else XY_FIELDS
        on_compute = batches is not None and batches.on_compute
        self.local = LocalBatches(batches, spec.call_timeout) if on_compute else None  # (started now)
        # Each shard's parameters (its plan has its buffers too), in the plan's order: the gradients a
        # frame carries to it, and the order of a packed run of them (the frame's `order`). A piece of a
        # tensor split across shards (`plan_pieces`) carries the flat run of its elements of it.
        meta = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        self.shapes = {n: t.shape for n, t in {**buffers, **meta}.items()}
        # (A plan of names holds whole tensors: `plan_shards`.)
        self.plan = [pieces_of(held, {n: s.numel() for n, s in self.shapes.items()}) for held in plan]
        params = set(self.param_names)
        self.shard_params = [[p.name for p in pieces if p.name in params] for pieces in self.plan]
        self.pieces = [{p.name: p for p in pieces} for pieces in self.plan]
        # Each shard's buffers in the order a push carries them: grouped by dtype (in the plan's order
        # within a group), so that a micro-batch's buffers of one dtype lie back to back in the frame and
        # the shard updates them as one run (`ShardBuffers.update`).
        dtypes = list(dict.fromkeys(b.dtype for b in buffers.values()))
        self.buffer_order = [
            sorted(
                (p.name for p in pieces if p.name in buffers), key=lambda n: dtypes.index(buffers[n].dtype)
            )
            for pieces in self.plan
        ]
        held = [
            [part(meta[n], self.pieces[i][n]) for n in names] for i, names in enumerate(self.shard_params)
        ]
        # (Decided once: a gradient has its parameter's dtype and shape.)
        self.packed = [packs(tensors) for tensors in held]
        # On a GPU, the gradients come back as one flat run where they share a dtype (`to_host`), and so do
        # the parameters go to it where they are small besides (`on_device`).
        self.one_run = len({meta[n].dtype for n in self.param_names}) == 1
        self.small = sum(meta[n].numel() * meta[n].element_size() for n in self.param_names) <= PACK_BYTES
        self.push_order = push_order([sum(t.numel() * t.element_size() for t in tensors) for tensors in held])
        # Data servers that hold no state (`plan_shards` gave a small model's to as few as it needs): a
        # push there only counts the step's batch ids, and the loop reads its answer just before its next
        # push instead of waiting for it (see `step`).
        self.stateless = [not pieces for pieces in self.plan]
        self.pull_wait = min(PULL_WAIT_SECONDS, spec.call_timeout / 2)
        # Where the job asks for it, gradients leave bucket by bucket during backward (`bucket_push.py`).
        # (`overlap_pull=True` plans the buckets too: the parameters come back in the gradients' buckets.)
        push = spec.overlap_push if spec.overlap_push is not None else (spec.overlap_pull or None)
        self.bucket_push = bucket_push_for(push, self.plan, meta)
        # Which shards get each micro-batch's gradients in parts, and whether any still takes them whole
        # from the push: if none does, they are not copied to the host again (on a GPU, a copy of each).
        self.parted = self.bucket_push.gets_parts if self.bucket_push else [False] * len(self.plan)
        self.whole_push = any(
            names and not p for names, p in zip(self.shard_params, self.parted, strict=True)
        )
        # Where the job asks for it, the next step's parameters come back bucket by bucket during forward
        # (`bucket_pull.py`), once a first forward on the meta model showed that every module reads its
        # own parameters only (`guarded`).
        plan_of_buckets = self.bucket_push.plan if self.bucket_push else None
        self.bucket_pull = bucket_pull_for(spec.overlap_pull, plan_of_buckets, device)
        self.guarded: bool | None = None
        self.early_reads: dict[str, str] = {}  # parameter -> the module that reads it before its own runs
        # Tensors split across shards, whole, kept for the next step (`Ahead.unpack`).
        self.wholes: dict[str, tuple[torch.Tensor, np.ndarray]] = {}

    def close(self) -> None:
        """The loop ended: stop the threads that send and read buckets, and the batch maker."""
        for owned in (self.bucket_push, self.bucket_pull, self.local):
            if owned is not None:
                owned.close()

    def then(
        self,
        role: Role,
        step: int,
        schedule: Schedule,
        params: bool = True,
        batches: bool = True,
        share: tuple[int, ...] | None = None,
    ) -> list[Then | None]:
        """What to ask every shard for `step`: its parameters (the shard waits until it has applied the
        step before, or asks this worker for a backup of it: `stragglers.py`) and the batches of this
        worker's share (`share`, where not its own) that it holds. None where there is nothing to ask
        (past the last step, no batch of the share there)."""
        if step >= schedule.total_steps:
            return [None] * len(self.plan)
        if share is None:
            share = schedule.share(step, role.rank, role.size)
        wanted = share if batches and self.local is None else ()
        worker = role.members[role.rank]
        asks: list[Then | None] = []
        for i in range(len(self.plan)):
            held = [b for b in wanted if schedule.server_of(b) == i]
            if params:
                asks.append(Then(step, self.pull_wait, held, worker))
            elif held:
                asks.append(Then(None, self.pull_wait, held))
            else:
                asks.append(None)
        return asks

    def fetch(
        self,
        role: Role,
        step: int,
        shards: list[ShardLink],
        schedule: Schedule,
        share: tuple[int, ...] | None = None,
    ) -> Ahead:
        """Ask every shard for `step` alone (a loop's first step in a generation, after a failure, or a
        backup of another member's share: `share`)."""
        if any(link.pending for link in shards):
            # A stateless data server's answer to the last push of a step or generation that ended: what
            # became of that push no longer matters (a fence voided it, or the run ended).
            with contextlib.suppress(RecoverableError):  # (a stale generation's too)
                receive_all(shards, [link.pending for link in shards], self.spec.call_timeout)
        # The parameters as a copy, never read in place (`wire/published.py`): a loop fetches a step it may
        # have pushed in part already (its frame to one shard went in, another's failed), and a shard that
        # holds its batch ids from that push may apply the step, writing its parameters, while this loop
        # computes the step again for the shards that lack them.
        frames = [
            Pull(role.generation, None if then is None else replace(then, copy=True)).frame()
            for then in self.then(role, step, schedule, share=share)
        ]
        return Ahead(role.generation, step, exchange(shards, frames, self.spec.call_timeout))

    def confirm(self, role: Role, step: int, batch_ids: Sequence[int], shards: list[ShardLink]) -> None:
        """This worker's own copies of `batch_ids` of `step` go in where a shard holds them aside (it had
        asked for a backup of them): every shard answered its push of them without refusing it, so each
        took it before applying the step, and no parameter it read had moved (`SyncApplies.confirm`)."""
        message = Confirm(role.generation, step, role.members[role.rank], list(batch_ids))
        send_all(shards, [None if idle else message.frame() for idle in self.stateless])
        receive_all(shards, [int(not idle) for idle in self.stateless], self.spec.call_timeout)

    def step(
        self,
        role: Role,
        step: int,
        share: tuple[int, ...],
        shards: list[ShardLink],
        schedule: Schedule,
        stats: LoopStats,
        ahead: Ahead | None,
        pushes: StepPush = PIPELINED,
        backup: bool = False,
    ) -> Ahead | None:
        """Train this worker's share of `step` (`backup`: batch ids of it that another member did not
        push, `stragglers.py`) and push it (`pushes`); returns the answers for its next step (`step + 1`
        in either case), where the push asked for them."""
        clock = PhaseClock(stats)
        if ahead is not None and (ahead.generation, ahead.step) != (role.generation, step):
            ahead = None
        state, batches = self.pull(ahead, lambda: self.fetch(role, step, shards, schedule, share))
        if self.local is not None:  # (this worker makes its batches: the next step's while this computes)
            clock.lap("pull")
            batches = {**batches, **self.local.step(share, schedule.share_after(step, role.rank, role.size))}
            clock.lap("batches")  # (the wait for them: where making a batch takes longer than a step)
        # The next step's batches do not depend on this step: ask for them now, so that the shards send
        # them while it computes. Not of a shard that gets gradients in parts during backward: it writes an
        # answer whole before it reads again, so batches beyond the sockets' buffers unread held the parts
        # up; those come with the push's answer (`following`).
        early = self.then(role, step + 1, schedule, params=False)
        asks = pushes.ahead([None if p else a for a, p in zip(early, self.parted, strict=True)])
        send_all(shards, [None if then is None else Pull(role.generation, then).frame() for then in asks])
        clock.lap("pull")
        whole, bare = self.then(role, step + 1, schedule), self.then(role, step + 1, schedule, batches=False)
        following = pushes.ahead([w if p else b for w, b, p in zip(whole, bare, self.parted, strict=True)])
        if self.bucket_pull is not None and self.guards(batches[share[0]]):
            following = self.bucket_pull.ask(shards, following)
        losses, sent = self.compute(role.generation, step, share, shards, state, batches, clock, backup)
        # (The step's parameters and batches go before the push: a loop on the shard's machine holds its
        # answers' memory until then, `wire/inbox.py`.)
        del state, batches
        worker = role.members[role.rank]
        frames = [
            # (A data server that holds no state is asked nothing: its answer is read before the next push.)
            Push(
                role.generation, step, worker, losses, None if idle else then, order, backup, bucketed
            ).frame(tensors)
            for then, order, idle, bucketed, tensors in zip(
                following, self.shard_params, self.stateless, self.parted, sent, strict=True
            )
        ]
        answers = pushes.deliver(
            shards,
            frames,
            role.generation,
            step,
            self.push_order,
            self.stateless,
            self.pull_wait,
            self.spec.call_timeout,
        )
        clock.lap("push")
        return Ahead(role.generation, step + 1, answers) if following[0] is not None else None

    def pull(self, ahead: Ahead | None, fetch: Callable[[], Ahead]) -> tuple[Tensors, Batches]:
        """A step's parameters and buffers, and its batches by batch id: from the answers asked for with the
        last push (`ahead`, where they are this step's), else from those `fetch` asks for now."""
        if self.bucket_pull is not None:
            self.bucket_pull.drop()  # (a step that failed in `unpack` left buckets owed: its links closed)
        pulled = ahead if ahead is not None else fetch()
        return pulled.unpack(self.shapes, self.plan, self.bucket_pull, self.wholes)

    def compute(
        self,
        generation: int,
        step: int,
        share: tuple[int, ...],
        shards: list[ShardLink],
        state: Tensors,
        batches: Batches,
        clock: PhaseClock,
        backup: bool = False,
    ) -> tuple[dict[int, float], list[list[tuple[Entry, torch.Tensor]]]]:
        """Every micro-batch of `share`, against the pulled `state`: the losses by batch id, and for every
        shard the gradients and buffers its push carries (where gradients leave in parts during backward,
        `bucket_push.py`, those sent, flagged `backup` where the share is one, and every part written)."""
        stats = clock.stats
        params = self.on_device(state)
        buffers = {n: t for n, t in state.items() if n not in params}
        pull = self.bucket_pull
        losses: dict[int, float] = {}
        sent: list[list[tuple[Entry, torch.Tensor]]] = [[] for _ in self.plan]
        push = self.bucket_push
        hooks = push.start(shards, generation, step, params, backup) if push is not None else None
        gate = None
        try:
            if pull is not None and pull.owed:
                # Buckets that follow the answers are read from now on, a thread per shard, and each
                # module's forward waits for its own. Every one is in by the end of the first forward
                # (`done`): the loop sends nothing on those links meanwhile (the batch requests left
                # before, in `step`), and the sender threads post backward's parts only after.
                to_come = pull.start(shards)
                gate = ForwardGate(
                    self.model, to_come, pull.receive, self.aliases, done=pull.rest, reads=self.early_reads
                )
            for b in share:
                batch = batches[b]
                began = time.perf_counter()
                if self.bucket_push is not None:
                    self.bucket_push.micro_batch(b)
                loss, g, bufs = self.gradient(params, buffers, batch, step, b, host=self.whole_push)
                if gate is not None and pull is not None:
                    gate.remove()  # (the share's later micro-batches find every bucket in)
                    gate = None
                    stats.pulled = pull.received
                if hooks is not None:
                    # (The buckets backward did not reach go now: zeros, as `materialize_grads` gives.)
                    stats.parts += len(hooks.finish())
                self.slow_down(time.perf_counter() - began)
                # Every shard hears of every batch id (the losses name them), also a shard that holds no
                # parameters or no buffers: each applies the step when it holds all of its batch ids.
                losses[b] = loss
                for i, entries in enumerate(self.entries(b, g, bufs)):
                    sent[i] += entries
                clock.lap("compute")
            if self.bucket_push is not None:
                self.bucket_push.drain(self.spec.call_timeout)  # every part written before any seal leaves
        finally:
            if gate is not None:
                gate.remove()
            if pull is not None and pull.owed:
                pull.abort()  # (the step failed with buckets unread: the loop closes their links)
            if hooks is not None and self.bucket_push is not None:
                hooks.remove()
                self.bucket_push.settle()
        return losses, sent

    def entries(
        self, batch_id: int, grads: Tensors, buffers: Tensors
    ) -> list[list[tuple[Entry, torch.Tensor]]]:
        """One micro-batch's tensors for every shard's push: its gradients back to back, in the plan's
        order (the shard takes them as one flat gradient without a copy: `data_server/optimizer.py`),
        unless they went in parts, then its buffers."""
        every = []
        for i, pieces in enumerate(self.pieces):
            entries: list[tuple[Entry, torch.Tensor]] = []
            if not self.parted[i]:
                held = [(n, part(grads[n], pieces[n])) for n in self.shard_params[i]]
                entries += gradient_entries(batch_id, held, self.packed[i])
            entries += [
                (Entry("buffer", batch_id, n), part(buffers[n], pieces[n])) for n in self.buffer_order[i]
            ]
            every.append(entries)
        return every

    def guards(self, batch: Batch) -> bool:
        """Whether a forward gate can hold each parameter until it arrived, decided once, on the meta model
        with a micro-batch's shape: where a module reads a parameter before its own module runs (a parent
        reading its child's weight), the gate waits for it in that module's pre-hook (`early_reads`,
        `buckets.unguarded`). A forward that fails on meta (a data-dependent one) pulls whole."""
        if self.guarded is None and self.bucket_pull is not None:
            try:
                # On a copy: a model's forward may keep state of its own (a count of its calls, a cache),
                # which this extra forward must not change in the model that trains.
                model = copy.deepcopy(self.model)
                meta = dict(model.named_parameters(remove_duplicate=False))
                buffers = dict(model.named_buffers(remove_duplicate=False))
                aliases = self.aliases

                def forward(params: Mapping[str, torch.Tensor]) -> Any:
                    tensors = {**params, **buffers}
                    tensors.update({alias: tensors[name] for alias, name in aliases.items()})
                    return self.fields.loss_of(
                        lambda *args, **kwargs: functional_call(model, tensors, args, kwargs),
                        batch,
                        torch.device("meta"),
                        self.loss_fn,
                    )

                self.early_reads = unguarded(model, self.bucket_pull.plan, forward, meta, aliases)
                self.guarded = True
            except Exception as exc:
                log.info("parameters pulled whole: the model's forward does not run on meta (%r)", exc)
                self.guarded = False
        return bool(self.guarded)

    def slow_down(self, took: float) -> None:
        """Where this worker is made a straggler (a `SLOWDOWN` plugin with a `factor`), take `factor`
        times as long as the compute that just took `took` seconds."""
        straggle(self._slowdown(), took)

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
        self,
        params: Tensors,
        buffers: Tensors,
        batch: Batch,
        step: int,
        batch_id: int,
        host: bool = True,
    ) -> tuple[float, Tensors, Tensors]:
        """Loss, gradient and updated buffers of one micro-batch, all on the CPU (the gradient left where
        it was computed unless `host`)."""
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
                seed = micro_batch_seed(self.spec.model_spec.seed, batch_id)
                # Only the generators this micro-batch draws from: `torch.manual_seed` also queues a
                # seed for every CUDA device not started yet, recording a Python traceback each time
                # (75 us a micro-batch on a CPU worker, 4% of an mlp step).
                torch.random.default_generator.manual_seed(seed)
                if self.device.type == "cuda":
                    torch.cuda.manual_seed(seed)
                versions = [p._version for p in params.values()]
                loss = self.fields.loss_of(
                    lambda *args, **kwargs: functional_call(self.model, tensors, args, kwargs),
                    batch,
                    self.device,
                    self.loss_fn,
                )
                grads = torch.autograd.grad(
                    loss, list(params.values()), allow_unused=True, materialize_grads=True
                )
                changed = [n for (n, p), v in zip(params.items(), versions, strict=True) if p._version != v]
                if changed:
                    # A compute worker holds no parameters between steps: the change would be lost, and
                    # on a CPU worker it would write into the shard's memory, which the loop reads in
                    # place (`wire/published.py`).
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
            if self.bucket_pull is not None and exc is self.bucket_pull.failure:
                raise  # (a bucket's read failed in a forward pre-hook: the wire's error, not the model's)
            raise ModelFailure(
                step,
                batch_id,
                f"the model raised at step {step}, batch {batch_id}: {type(exc).__name__}: {exc}",
            ) from exc
        return (
            value,
            dict(zip(params, self.to_host(grads) if host else grads, strict=True)),
            {n: t.detach().cpu() for n, t in bufs.items()},
        )
