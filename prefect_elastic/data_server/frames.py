"""A data server's side of the step path: the frames of compute loops (`wire/channel.py`), decoded into calls
of the shard's apply and answered with parameters and batches.

One frame each way per step: a push (gradients, buffers and losses of a share of a step) or an async
apply, and what the loop needs next (the parameters of a step once applied here, batches that live here);
also a standby's read of a replica's tensors (`adopt`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch

from ..data.fields import Batch
from ..errors import FatalError
from ..messages import Tensors
from ..wire import (
    Applied,
    Apply,
    Confirm,
    Current,
    CurrentState,
    Entry,
    Frame,
    Next,
    ParamsBucket,
    Part,
    Pull,
    Push,
    ReplicaAsk,
    ReplicaSent,
    Taken,
    Then,
    decode_message,
)
from ..wire.signals import RecoverableError
from .bucket_book import pull_verdict
from .bucketed import bucket_sizes
from .optimizer import Gradient
from .replicas import Replicas, split_tensors
from .state import ShardState
from .step_applies import StepApplies

BatchReader = Callable[[int, int], Awaitable[Batch]]  # (generation, batch id) -> its fields


class ShardFrames:
    """Answers the frames of compute loops for one shard."""

    def __init__(
        self, shard: ShardState, applies: StepApplies, replicas: Replicas, get_batch: BatchReader
    ) -> None:
        self._shard = shard
        self._applies = applies
        self._replicas = replicas
        self._get_batch = get_batch  # (generation, batch id) -> the batch's fields

    async def answer(self, frame: Frame) -> Frame:
        """One frame of a compute loop: a push (gradients, buffers and losses of its share of a step)
        and/or what it needs next (`then`: the parameters of a step, once applied here, and batches that
        live here). A failed push fails the frame; a failed `then` (not ready within its wait, a fence)
        is answered as a `Next` that carries the error, since the push itself went in."""
        message = decode_message(frame.header)
        match message:
            case Apply():
                return await self._on_apply(message, frame)
            case Current():
                version, state = await self._applies.current_for_answer(message.generation)
                return CurrentState(version, self._shard.index).frame(
                    [(Entry("state", -1, n), t) for n, t in state.items()]
                )
            case ReplicaAsk():
                # A standby taking shard `source`'s role reads the replica's tensors here (`adopt`).
                # Each tensor's place in the outline (`replica_outline`) goes as the entry's batch id.
                _, held = split_tensors(self._replicas.replica(message.source, message.version))
                return ReplicaSent().frame([(Entry("replica", place, ""), t) for place, t in held])
            case Part():
                # A bucket of one micro-batch's gradient, sent during backward (quiet: nothing is answered).
                ((_, run),) = frame.tensors
                await self._applies.part(message, run)
                return Taken().frame()
            case Push():
                await self._on_push(message, frame)
                return await self._then(message.generation, message.then)
            case Pull():
                return await self._then(message.generation, message.then)
            case Confirm():
                await self._applies.confirm(message)
                return Taken().frame()
        raise TypeError(f"no answer to {message!r}")

    async def _on_push(self, push: Push, frame: Frame) -> None:
        grads: dict[int, Gradient] = {}
        buffers: dict[int, Tensors] = {}
        for entry, tensor in frame.tensors:
            if entry.kind == "grads":  # packed: one flat run over the parameters `order` names
                grads[entry.batch_id] = self._packed(push.order, tensor)
                continue
            target: dict[int, Any] = grads if entry.kind == "grad" else buffers
            target.setdefault(entry.batch_id, {})[entry.name] = tensor
        if push.bucketed:
            self._check_order(push.order)
        await self._applies.push(push, grads, buffers)

    async def _then(self, generation: int, then: Then | None) -> Frame:
        """The answer to what a loop needs next (`then`), or a bare `Next` where it needs nothing."""
        if then is None:
            return Next().frame()
        answer = Next(self._shard.index)
        tensors: list[tuple[Entry, torch.Tensor]] = []
        following = None
        try:
            if then.step is not None:
                answer, tensors = await self._params_for_answer(generation, then)
                if answer.follow and then.buckets is not None:
                    following = self._buckets(generation, then.step, then.buckets)
            for b in then.batches:
                batch = await self._get_batch(generation, b)
                tensors += [(Entry("field", b, name), t) for name, t in batch.items()]
        except Exception as exc:
            return Next.failed(exc).frame()
        return answer.frame(tensors, following)

    async def _params_for_answer(
        self, generation: int, then: Then
    ) -> tuple[Next, list[tuple[Entry, torch.Tensor]]]:
        assert then.step is not None
        # (`then.worker`: a loop that may be asked for a backup instead, `stragglers.py`.)
        state = await self._applies.pull(generation, then.step, then.wait, then.worker)
        tensors: list[tuple[Entry, torch.Tensor]] = []
        names: list[str] | None = None
        buffers: list[list[str]] | None = None
        follow, numel, dtype = 0, None, None
        optimizer = self._shard.optimizer
        if optimizer is not None and optimizer.flat is not None:
            # The parameters as the one flat tensor they live in, named in the answer: one tensor
            # to encode instead of one per parameter (the loop takes views of it, of this shard's
            # own memory where it reads them in place, unless it asks for a copy: `fetch`).
            names = optimizer.names
            flat = optimizer.flat.clone() if then.copy else optimizer.flat
            if then.buckets and not then.copy:
                # Bucket by bucket, in forward order, each a frame of its own after this one (`_buckets`):
                # the loop's forward starts once the first is in. The ranges are the loop's bucket plan.
                bucket_sizes(then.buckets, optimizer.numel, self._shard.index)
                follow, numel, dtype = len(then.buckets), optimizer.numel, str(flat.dtype)
            else:
                tensors = [(Entry("params", -1, ""), flat)]
            state = self._shard.buffers
            runs = self._shard.buffer_runs.runs
            if runs:
                # Likewise the buffers: one flat tensor per dtype, their names in the answer.
                buffers = [held for held, _ in runs]
                tensors += [(Entry("buffers", k, ""), run) for k, (_, run) in enumerate(runs)]
                state = {}
        answer = Next(self._shard.index, names, buffers, follow, numel, dtype)
        return answer, tensors + [(Entry("state", -1, name), t) for name, t in state.items()]

    def _buckets(self, generation: int, step: int, bounds: list[list[int]]) -> Iterator[Frame]:
        """The frames of a pull's buckets (`bounds`, ranges of the shard's flat parameters), one at a time:
        each is made just before it is written, from the copy published for `step`, and only while the
        shard is still in `generation` at `step` (`pull_verdict`): a fence or a step on between two buckets
        ends the answer with that refusal, and the loop drops the step as after a failed pull."""
        state = self._shard
        flat: torch.Tensor | None = None
        for k, (start, stop) in enumerate(bounds):
            # (Before each bucket, the first one too: this runs once the head was written.)
            if pull_verdict(state.generation, state.version, generation, step) != "answer" or state.applying:
                raise RecoverableError(f"step {step} was applied on at shard {state.index} during its pull")
            if flat is None:
                # The copy published for `step`, taken at the first bucket: a commit would publish the
                # other one, and the verdict above stops the answer before any bucket of a later step.
                optimizer = state.optimizer
                if optimizer is None or optimizer.flat is None:
                    raise RecoverableError(f"shard {state.index} holds no parameters to pull any more")
                flat = optimizer.flat
            run = flat[start:stop]
            yield ParamsBucket(state.index, k).frame([(Entry("params", k, ""), run)])

    def _check_order(self, order: list[str]) -> None:
        """Gradients that came in parts are runs of the shard's flat parameters, cut where the loop's plan
        cuts them: the loop's order of the shard's parameters must be the shard's own."""
        names = self._shard.optimizer.names if self._shard.optimizer is not None else []
        if list(order) != names:
            raise FatalError(
                f"gradients in parts for data server {self._shard.index} in the order {order[:3]}..., "
                f"which holds its parameters in the order {names[:3]}..."
            )

    def _packed(self, order: list[str], flat: torch.Tensor) -> Gradient:
        if self._shard.optimizer is None:
            raise FatalError(
                f"a packed gradient for data server {self._shard.index}, which holds no parameters"
            )
        return self._shard.optimizer.packed(order, flat)

    async def _on_apply(self, apply: Apply, frame: Frame) -> Frame:
        """Async mode: one micro-batch's gradient (with the version of this shard it was computed on),
        applied at once; the answer says what became of it and, if asked (`state`), carries the
        parameters as they are after it."""
        grads: Tensors = {}
        buffers: Tensors = {}
        for entry, tensor in frame.tensors:
            (grads if entry.kind == "grad" else buffers)[entry.name] = tensor
        outcome, staleness = await self._applies.apply_one(apply, grads, buffers)
        if not apply.state:
            return Applied(outcome, staleness, self._shard.index).frame()
        version, state = await self._applies.current_for_answer(apply.generation)
        tensors = [(Entry("state", -1, name), t) for name, t in state.items()]
        return Applied(outcome, staleness, self._shard.index, version).frame(tensors)
