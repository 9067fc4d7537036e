"""How a sync step's frames reach the shards (`StepPush`), chosen once per loop (`pushes_for`).

`Pipelined` is the engine's path: each push also asks for the next step (its parameters, and the batches
of the share asked for before the step computes), every frame goes out at once, and the answers are the
next step's. `ShardByShard` is for fault injection that no signal from outside can place: where a worker
has a `PushObserver` plugin registered as `PUSH_HOOK` (`prefect_elastic.local.push_faults`), the loop asks
nothing ahead, pushes to the shards one by one, and tells the observer after each push. The trainer
(`trainer.py`) holds no test-only branch: it calls whichever it was handed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..wire import Ask, Frame, Next, Pull, ShardLink, Then
from .frames import receive_all, send_all

# The name of a Dask worker plugin that, where present, is told of every push (a `PushObserver`).
PUSH_HOOK = "prefect-elastic-push-hook"


class PushObserver(Protocol):
    """Told after each push of a step, shard by shard, with a function that waits until that shard has
    applied the step (so a fault can fall between the pushes to two shards)."""

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None: ...


class StepPush(Protocol):
    def ahead(self, asks: list[Ask]) -> list[Ask]:
        """Of the asks for the next step (one per shard), those that go out with this step's frames."""
        ...

    def deliver(
        self,
        shards: list[ShardLink],
        frames: list[Frame],
        generation: int,
        step: int,
        order: Sequence[int],
        stateless: Sequence[bool],
        pull_wait: float,
        timeout: float,
    ) -> list[Frame]:
        """Push `frames[i]` to shard `i`; returns the answers still to be read for the next step."""
        ...


@dataclass(frozen=True)
class Pipelined:
    def ahead(self, asks: list[Ask]) -> list[Ask]:
        return asks

    def deliver(
        self,
        shards: list[ShardLink],
        frames: list[Frame],
        generation: int,
        step: int,
        order: Sequence[int],
        stateless: Sequence[bool],
        pull_wait: float,
        timeout: float,
    ) -> list[Frame]:
        # One frame to every shard: this step's gradients, and a request for the next step's parameters,
        # which the shard answers once it has applied this step. (Sending a shard its frame during
        # backward, once its gradients are in, was tried: 4% faster on cnn-20, but a worker killed during
        # backward then leaves the shards a version apart, which costs a rollback to the snapshot; see
        # docs/design/step-channel.md.)
        # A stateless data server's answer to this push is left in its socket and read just before the
        # next step's push: the step does not wait for a server whose state nothing needs, which has the
        # whole next compute to answer. It may then get a push of the next step before another worker's
        # push of this one, and keeps it until then (`DataServer.push`). Reading the answer before the
        # next push keeps it at most a version behind the others: no loop pushes `s + 1` anywhere before
        # that server has taken its push of `s`. A push that never comes (its worker died between the
        # frames) leaves it a version behind, which the fence finds as it finds any two shards a version
        # apart.
        # Every other answer still unread is read before the push too (the batches of the next step, asked
        # for before this one computed): a shard writes an answer whole before it reads its connection
        # again, so a push sent with an answer larger than the sockets' buffers unread (batches of tens of
        # MB through a socket: a shard on another machine, or no shared memory) waited for the shard to
        # read it while the shard waited for the loop to read that answer, until the call timeout.
        skips = list(zip(shards, stateless, strict=True))
        answers = receive_all(shards, [link.pending for link in shards], timeout)
        send_all(shards, frames, order)
        answers += receive_all(shards, [link.pending - skip for link, skip in skips], timeout)
        return answers


@dataclass(frozen=True)
class ShardByShard:
    observer: PushObserver

    def ahead(self, asks: list[Ask]) -> list[Ask]:
        # (An answer asked for ahead would stand in the connection before the observer's pull.)
        return [None] * len(asks)

    def deliver(
        self,
        shards: list[ShardLink],
        frames: list[Frame],
        generation: int,
        step: int,
        order: Sequence[int],
        stateless: Sequence[bool],
        pull_wait: float,
        timeout: float,
    ) -> list[Frame]:
        for i, (link, frame) in enumerate(zip(shards, frames, strict=True)):
            link.request(frame, timeout)

            def wait_applied(link: ShardLink = link) -> None:
                wait = Then(step + 1, pull_wait)
                answer = link.request(Pull(generation, wait).frame(), timeout)
                Next.of(answer.header).check()

            self.observer.after_push(i, step, wait_applied)
        return []


def pushes_for(observer: PushObserver | None) -> StepPush:
    """The push path of a loop on a worker that has `observer` registered as `PUSH_HOOK` (None: none)."""
    if observer is None:
        return Pipelined()
    return ShardByShard(observer)
