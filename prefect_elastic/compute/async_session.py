"""One generation of the compute loop in async mode (`AsyncSession`; the loop itself: `async_loop.py`): a
worker never waits for the others, and it does not wait for the shards' fresh parameters either (only for a
shard that has not answered its previous gradient).

Work comes in leases of batch ids from the coordinator (`Coordinator.lease`, asked for while the last lease
trains, so off the step path). For each batch id the loop computes one gradient on the model it has and
sends it to every shard, tagged with the version of that shard's parameters the model came from
(`computed_on`); the shard applies it at once (or refuses it as too stale, or as a batch id it applied
already) and answers with its parameters as they are after it. The loop does not wait for that answer: it
starts on the next batch id (and takes the answer before it sends the next gradient). The sends and the
reads of the answers run on a thread of the session's own (`AsyncSession._exchange`), overlapped with the
next computation. When a gradient is computed, the parameters that arrived meanwhile (during that
computation, the design's "first time period") are the next model; if they did not all arrive in that time
(the exchange with every shard had not ended), the loop applies its own gradient to its copy of the shards'
parameters, fresh or not (a **candidate** model), and trains the next batch id on that. The local step uses
a fresh optimizer of the job's kind, one step from zero state: it is scaled as the job's optimizer scales a
first step (SGD: lr * g; Adam: about lr * sign(g)), and the shards' optimizer state (momentum, moments) is
never touched or guessed. The candidate is a cache, never the truth: only what the shards applied counts,
and a gradient computed on a candidate is tagged with the version its parameters came from, so its staleness
counts every step the shard took since.

A batch id is done for this loop when every shard answered "applied" or "duplicate"; one refused as stale by
any shard is trained again on newer parameters (the shards that applied it answer "duplicate" then). Batches
come over a second connection to each shard, fetched ahead of need by a thread of their own, so that a slow
shard's applies never hold up the data.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..allocator import freeze_startup_objects
from ..data.fields import Batch
from ..messages import CoordinatorHandle, Role, Tensors
from ..schedule import Schedule
from ..sharding import join, part
from ..wire import Applied, Apply, Current, CurrentState, Entry, Frame, Next, Pull, ShardLink, Then
from ..wire.signals import StaleGenerationError
from .stats import LoopStats
from .trainer import MicroBatchTrainer

log = logging.getLogger(__name__)

# The fewest batch ids a loop leases at a time (`micro_batches` where that is more).
MIN_LEASE = 4
# How long a loop that holds no batch id and got none waits before it asks again (the last batch ids of
# the job are held by other workers, or the shards have not reported them committed yet).
IDLE_SECONDS = 0.02


def answer_of(call: Any, timeout: float) -> Any:
    """A Dask actor call's answer. One already in is taken as it is: `ActorFuture.result` always hops to
    the worker's event loop and back, about a millisecond a lease when that loop's thread competes with
    the computation for the GIL."""
    out = getattr(call, "_out", None)
    if out is not None and call.done():
        return out.unwrap()
    return call.result(timeout=timeout)


@dataclass
class Pending:
    """A gradient sent to every shard and not answered by all of them yet."""

    batch_id: int
    answered: set[int] = field(default_factory=set)
    stale: bool = False


class AsyncSession:
    """One generation of an async compute loop: what it holds, and the loop's steps within it."""

    def __init__(
        self,
        role: Role,
        address: str,
        coordinator: CoordinatorHandle,
        trainer: MicroBatchTrainer,
        schedule: Schedule,
        shards: list[ShardLink],
        data: list[ShardLink],
        stats: LoopStats,
        timeout: float,
    ) -> None:
        self.role = role
        self.address = address
        self.coordinator = coordinator
        self.trainer = trainer
        self.schedule = schedule
        self.shards = shards
        self.data = data
        self.stats = stats
        self.timeout = timeout
        # At least 4: a lease costs a Dask actor call (its answer is collected through the worker's event
        # loop, about half a millisecond); the next one is asked for with one batch id left.
        self.lease_size = max(MIN_LEASE, trainer.spec.micro_batches)
        self.hand: deque[int] = deque()  # leased, not yet sent (or refused as stale: sent again)
        # The batches of the batch ids in hand, fetched on the data connections by a thread of their own
        # ahead of need (reading a batch of the mlp's took 0.8 ms of the loop's thread a step).
        self.fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-elastic-batches")
        self.batches: dict[int, Future[Batch]] = {}
        self.lease_call: Any = None  # the coordinator's answer to the next lease, while it is on its way
        self.leased = False  # whether this session asked for a lease yet
        self.pending: deque[Pending] = deque()  # sent, in order; answers come back in that order per shard
        self.state: list[Tensors] = []  # per shard: its parameters (as it sent them, or a candidate)
        self.versions: list[int] = []  # per shard: the version the parameters it last sent are of
        # The last gradient's exchange with the shards (send it to each, read each answer) runs on a
        # thread of its own while the next gradient computes: on the mlp the two transfers take about
        # 2 ms of a 10 ms step, and the socket calls leave the GIL to the computation.
        self.postman = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-elastic-exchange")
        self.exchange: Future[list[Frame]] | None = None

    # -- the loop --------------------------------------------------------------------------------

    def run(self, wanted: Callable[[], bool]) -> bool:
        """Train until the job ends (True) or this generation does (a `StaleGenerationError`)."""
        self._fetch_state()
        while wanted():
            self._ask_lease()
            if not self.hand and not self._take_lease(block=True):
                # Nothing left to lease: the answers still on their way may send a batch id back (refused
                # as stale); once every one is in, the job may be over.
                self._settle(wait=True)
                if not self.hand:
                    if not self.pending and self._job_over():
                        return True
                    time.sleep(IDLE_SECONDS)
                continue
            self._ask_batches()
            self._train_one()
        return False

    def _job_over(self) -> bool:
        got = self.coordinator.role(self.address, self.role.generation).result(timeout=self.timeout)
        if got is None:
            return False
        if got.stop:
            return True
        raise StaleGenerationError(self.role.generation, got.generation, "lease")

    def _ask_lease(self) -> None:
        # The next lease is asked for when two batch ids are left in hand: a loop holds at most a lease
        # and two, so a straggler holds little that faster loops could have trained, and the new lease's
        # first batch is fetched while the last one in hand computes (with one left, the loop waited for
        # that fetch at every lease: 0.8 ms a step on the mlp).
        if self.lease_call is None and len(self.hand) <= 2:
            # The first lease of a session gives back what an earlier session of this loop held in the
            # same generation (it started over after an error, and dropped it).
            self.lease_call = self.coordinator.lease(
                self.address, self.role.generation, self.lease_size, not self.leased
            )
            self.leased = True
        self._take_lease(block=False)

    def _take_lease(self, block: bool) -> bool:
        call = self.lease_call
        if call is None:
            return False
        if not block and not call.done():
            return False
        began = time.perf_counter()
        given = answer_of(call, self.timeout)
        self.stats.add("lease", time.perf_counter() - began)
        self.lease_call = None
        if given is None:
            # Not a member of this generation any more (or training is suspended): ask for the role.
            raise StaleGenerationError(self.role.generation, self.role.generation + 1, "lease")
        self.hand.extend(given)
        return bool(given)

    def _ask_batches(self) -> None:
        # The batches of every batch id in hand are asked for at once: the fetcher reads them while the
        # loop computes.
        if self.trainer.local is not None:
            self.trainer.local.want(self.hand)  # (this worker makes its batches: all asked at once)
        for b in self.hand:
            if b not in self.batches:
                self.batches[b] = self.fetcher.submit(self._fetch_batch, self.role.generation, b)

    def _fetch_batch(self, generation: int, b: int) -> Batch:
        """On the fetcher's thread: batch id `b`'s fields, from the shard that holds them (or made here)."""
        if self.trainer.local is not None:
            return self.trainer.local.take([b])[b]
        link = self.data[self.schedule.server_of(b)]
        frame = link.request(Pull(generation, Then(None, 0.0, [b])).frame(), self.timeout)
        Next.of(frame.header).check()
        return {e.name: t for e, t in frame.tensors if e.kind == "field" and e.batch_id == b}

    def _batch(self, b: int) -> Batch:
        # (Dropped from `batches` only once done: `close` must see a fetch still running.)
        got = self.batches[b].result(timeout=2 * self.timeout + 1)
        del self.batches[b]
        return got

    def _fetch_state(self) -> None:
        """The parameters of every shard as they are now (a new generation, or after a failed call)."""
        began = time.perf_counter()
        frame = Current(self.role.generation).frame()
        for link in self.shards:
            link.send(frame)
        self.state, self.versions = [], []
        for link in self.shards:
            answer = link.receive(self.timeout)
            self.state.append({e.name: t for e, t in answer.tensors})
            self.versions.append(CurrentState.of(answer.header).version)
        self.stats.add("pull", time.perf_counter() - began)

    def _train_one(self) -> None:
        trainer, gen = self.trainer, self.role.generation
        b = self.hand.popleft()
        began = time.perf_counter()
        batch = self._batch(b)
        # (Whole tensors: the parts of one split across shards are joined into a new one.)
        merged = join(self.state, trainer.plan, trainer.shapes)
        # The version of each shard the model came from: the tag of this gradient, whatever arrives while
        # it computes (a candidate's version is that of the parameters it was made from).
        base = list(self.versions)
        # (detached: the loop's copy stays a plain tensor, which a candidate step changes in place)
        params = trainer.on_device(merged)
        buffers = {n: t for n, t in merged.items() if n not in params}
        waited = time.perf_counter()
        self.stats.add("pull", waited - began)
        loss, grads, bufs = trainer.gradient(params, buffers, batch, b, b)
        del params
        computed = time.perf_counter()
        took = computed - waited
        self.stats.add("compute", took)
        trainer.slow_down(took)
        # The parameters that arrived while this gradient was computed are the next model; for
        # a shard whose answer did not arrive in that time, the loop applies this gradient to its own copy
        # of that shard's parameters (a candidate model) and trains on, without waiting.
        arrived = self._settle(wait=False)
        if self.exchange is not None:
            # One gradient in flight at most: shards that have not answered the last are behind this
            # loop, and what they would get next would only be refused as stale. Their answers did not
            # come within the computation, so this is still a candidate step below (on the parameters
            # that came, with this gradient applied).
            blocked = time.perf_counter()
            self._collect()
            self.stats.add("wait", time.perf_counter() - blocked)
        frames = []
        for i, names in enumerate(trainer.shard_params):
            pieces = trainer.pieces[i]
            apply = Apply(gen, self.address, b, base[i], loss)
            tensors = [(Entry("grad", b, n), part(grads[n], pieces[n])) for n in names if n in grads]
            # (Grouped by dtype, as a sync push sends them: the shard updates a run at once.)
            tensors += [(Entry("buffer", b, n), part(bufs[n], pieces[n])) for n in trainer.buffer_order[i]]
            frames.append(apply.frame(tensors))
        self.exchange = self.postman.submit(self._exchange, frames)
        self.pending.append(Pending(b))
        self.stats.batches += 1
        freeze_startup_objects()  # (once per process, after its first push: see allocator.py)
        sent = time.perf_counter()
        self.stats.add("push", sent - computed)
        late = [i for i in range(len(self.shards)) if i not in arrived]
        if late:
            self._candidate_step(grads, late)
            self.stats.add("candidate", time.perf_counter() - sent)

    def _candidate_step(self, grads: Tensors, late: list[int]) -> None:
        # (The gradients are cloned: the exchange thread may still be sending them, and an optimizer may
        # change a gradient in place, as Adam and SGD do with `maximize`.)
        pairs = [
            (self.state[i][p.name], part(grads[p.name], p).clone())
            for i in late
            for p in self.trainer.plan[i]
            if p.name in grads
        ]
        if not pairs:
            return
        tensors = [t for t, _ in pairs]
        for t, g in pairs:
            t.grad = g
        # A fresh optimizer of the job's kind, one step from zero state: the step is scaled as the job's
        # optimizer scales a first step (SGD: lr * g; Adam: about lr * sign(g)), and the shards' optimizer
        # state (momentum, moments) is neither changed nor guessed.
        optimizer = self.trainer.spec.model_spec.build_optimizer(tensors)
        with torch.no_grad():
            optimizer.step()
        for t in tensors:
            t.grad = None
        self.stats.candidate_steps += 1

    def _exchange(self, frames: list[Frame]) -> list[Frame]:
        """On the exchange thread: send each shard its frame, then read each answer (raising what a
        shard raised)."""
        for link, frame in zip(self.shards, frames, strict=True):
            link.send(frame)
        return [link.receive(self.timeout) for link in self.shards]

    def _settle(self, wait: bool) -> set[int]:
        """Take the answers to the last gradient if they have all arrived (wait for them, when `wait`);
        returns the shards whose answers were taken."""
        if self.exchange is None or not (wait or self.exchange.done()):
            return set()
        self._collect()
        return set(range(len(self.shards)))

    def _collect(self) -> None:
        """Wait for the exchange in flight and take its answers."""
        assert self.exchange is not None
        # (Forgotten only once done: `close` must see an exchange still running.)
        answers = self.exchange.result(timeout=2 * self.timeout + 1)
        self.exchange = None
        for i, answer in enumerate(answers):
            self._take_answer(i, answer)

    def close(self) -> None:
        """End the exchange and the fetches in flight, if any (interrupting their reads): the next session
        uses the same connections."""
        exchange, self.exchange = self.exchange, None
        for calls, links, thread in (
            ([exchange] if exchange else [], self.shards, self.postman),
            (list(self.batches.values()), self.data, self.fetcher),
        ):
            for call in calls:
                call.cancel()  # (one not started yet)
            running = [call for call in calls if not call.done()]
            if running:
                for link in links:
                    link.interrupt()
                for call in running:
                    with contextlib.suppress(BaseException):
                        call.result(timeout=self.timeout)
                # Interrupted connections are dead (whether their call had got to them or not): the next
                # session opens new ones.
                for link in links:
                    link.close()
            thread.shutdown(wait=False)
        self.batches.clear()

    def _take_answer(self, i: int, answer: Frame) -> None:
        entry = next(p for p in self.pending if i not in p.answered)
        entry.answered.add(i)
        applied = Applied.of(answer.header)
        if applied.outcome == "stale":
            entry.stale = True
            self.stats.refused += 1
        if applied.version is not None:
            # Fresh parameters replace the candidate (answers come in order: each is newer). The version
            # comes also from a shard that holds no parameters (`plan_shards`): gradients are tagged with it.
            self.state[i] = {e.name: t for e, t in answer.tensors}
            self.versions[i] = applied.version
        while self.pending and len(self.pending[0].answered) == len(self.shards):
            done = self.pending.popleft()
            if done.stale:
                self.hand.appendleft(done.batch_id)  # trained again, on newer parameters
            else:
                self.stats.steps += 1
