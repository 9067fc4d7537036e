"""The straggler's window (docs/design/overlapped-step.md, "A straggler reading in place"), opened by hand on
two real data servers in this process: a backup lets shard 0 apply a step, then the straggler, whose
parameters moved under it, pushes to shard 1 before the backup's copy gets there. A shard that asked for a
backup of an id keeps only a backup's copy of it, or the straggler's once the straggler confirms that every
shard took its push before applying the step (`SyncApplies.confirm`). Each test runs twice: the whole push,
and gradients in parts (`overlap_push`) with an optimizer that updates in place (SGD's foreach path has no
out-of-place update, `other_copy.copy_kind`), whose parts a shard sums as they come."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from prefect_elastic.compute import LoopStats, MicroBatchTrainer, Pipelined, ShardByShard
from prefect_elastic.compute.frames import Ahead, exchange
from prefect_elastic.data_server import DataServer
from prefect_elastic.messages import Role, Tensors
from prefect_elastic.schedule import Schedule
from prefect_elastic.training import prepare
from prefect_elastic.wire import Ask, Frame, Pull, ShardLink, Then
from prefect_elastic.wire.signals import BackupWanted, StepPassed

from ..conftest import in_process_servers, make_job
from .test_channel import Served
from .test_stragglers import _links, _parameters

WAIT = 10.0  # (a pull's wait: long enough never to decide anything here)
# The two ways a step's gradients reach the shards: whole, in the push (the job's defaults: Adam, and no
# parts for the tests' small mlp), and in parts during backward, summed by a shard as they come, with an
# optimizer that applies the step in place (no second copy to publish).
JOBS = [
    pytest.param({}, id="whole-push"),
    pytest.param(
        {"overlap_push": True, "optimizer": {"name": "sgd", "lr": 0.05, "foreach": True}},
        id="parts-in-place",
    ),
]


@contextlib.contextmanager
def _shards(
    digits_url: str, job: dict[str, Any]
) -> Iterator[tuple[list[DataServer], list[Served], MicroBatchTrainer, Schedule]]:
    """Two real data servers of the test job (the mlp, parameters on both; `job` applied), served in this
    process, and a trainer of that job."""
    fields = {"model": "tests.models:mlp", "min_shard_bytes": 0, **job}
    servers, plan = in_process_servers(digits_url, **fields)
    prepared = prepare(make_job(digits_url, "reassign", **fields))
    trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, torch.device("cpu"))
    assert not job.get("overlap_push") or trainer.bucket_push is not None, "gradients in parts"
    served = [Served(server.on_frame) for server in servers]
    try:
        yield servers, served, trainer, prepared.schedule
    finally:
        trainer.close()
        for s in served:
            s.close()


@dataclass(frozen=True)
class _To:
    """A push that reaches shard `shard` alone, asking nothing next: the straggler's frame to the shard
    the backup has not reached yet."""

    shard: int

    def ahead(self, asks: list[Ask]) -> list[Ask]:
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
        shards[self.shard].request(frames[self.shard], timeout)
        return []


class _Slow(ShardLink):
    """A link on which the parts (quiet frames) wait until `release`: the way to a shard slower than the
    way to the other, so that the backup's parts reach it after the straggler's. (Nothing waits in a
    whole push: its frames are answered, and go at once.)"""

    def __init__(self, address: Any, timeout: float) -> None:
        super().__init__(address, timeout)
        self.held: list[Frame] = []

    def post(self, frame: Frame) -> None:
        self.held.append(frame)

    def release(self) -> None:
        held, self.held = self.held, []
        for frame in held:
            super().post(frame)


class _Between:
    """A push observer that runs `then` once the push to shard 0 is applied, before the push to shard 1."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None:
        if shard == 0:
            wait_applied()
            self.then()


def _solo(digits_url: str, job: dict[str, Any]) -> Tensors:
    """Step 0 as one worker that trained every batch id computes it: the bits to match."""
    with _shards(digits_url, job) as (_, served, trainer, schedule), _links(served) as links:
        solo = Role(0, 0, ("solo",), 0, channels=tuple(s.address for s in served))
        every = tuple(schedule.step_batches(0))
        return _parameters(
            trainer.step(solo, 0, every, links, schedule, LoopStats("solo"), None, Pipelined()), trainer
        )


def _published(links: list[ShardLink], trainer: MicroBatchTrainer, step: int) -> Tensors:
    frames = [Pull(0, Then(step, WAIT, copy=True)).frame() for _ in links]
    return _parameters(Ahead(0, step, exchange(links, frames, WAIT)), trainer)


def _moved(
    links: list[ShardLink], trainer: MicroBatchTrainer, schedule: Schedule, share: tuple[int, ...]
) -> Ahead:
    """What a straggler reading in place sees once shard 0 applied step 0 and shard 1 did not: shard 0's
    parameters of step 1 beside shard 1's of step 0 (and its share's batches)."""
    held = [[b for b in share if schedule.server_of(b) == i] for i in range(len(links))]
    frames = [
        Pull(0, Then(1, WAIT, held[0], copy=True)).frame(),
        Pull(0, Then(0, WAIT, held[1], copy=True)).frame(),
    ]
    return Ahead(0, 0, exchange(links, frames, WAIT))


@pytest.mark.parametrize("job", JOBS)
def test_a_straggler_computing_on_moved_parameters_is_not_summed_where_a_backup_was_asked_for(
    digits_url: str, job: dict[str, Any]
) -> None:
    """`a` pushes its share of step 0, `b` is silent: both shards ask `a` for `b`'s ids. `a`'s backup
    reaches shard 0, which applies step 0 in place; `b` then computes its share on what it reads (shard
    0's new parameters) and pushes it to shard 1 before `a`'s backup gets there (with parts: the backup's
    parts to shard 1 wait on their way, `_Slow`, and reach it after the straggler's parts and seal). Shard
    1 asked for a backup of those ids: it sums the backup's copy, and both shards end bit for bit as one
    worker that trained every batch id."""
    expected = _solo(digits_url, job)
    with _shards(digits_url, job) as (servers, served, trainer, schedule), _links(served) as links:
        channels = tuple(s.address for s in served)
        a, b = Role(0, 0, ("a", "b"), 0, channels=channels), Role(0, 1, ("a", "b"), 0, channels=channels)
        own, silent = schedule.share(0, 0, 2), schedule.share(0, 1, 2)
        ahead = trainer.step(a, 0, own, links, schedule, LoopStats("a"), None, Pipelined())
        with pytest.raises(BackupWanted) as wanted:
            _parameters(ahead, trainer)
        assert wanted.value.batch_ids == silent, "both shards asked for the silent member's ids"

        slow = [links[0], _Slow(served[1].address, WAIT)]

        def straggler() -> None:
            assert [server.version for server in servers] == [1, 0], "the window is open"
            with _links(served) as late:
                moved = _moved(late, trainer, schedule, silent)
                trainer.step(b, 0, silent, late, schedule, LoopStats("b"), moved, _To(1))
            slow[1].release()  # (the backup's parts to shard 1, after the straggler's; its seal follows)

        backup = ShardByShard(_Between(straggler))
        try:
            # (Refused where shard 1 applied the step without it, from the straggler's copy.)
            with contextlib.suppress(StepPassed):
                trainer.step(a, 0, silent, slow, schedule, LoopStats("a"), None, backup, backup=True)
        finally:
            slow[1].close()
        assert [server.version for server in servers] == [1, 1]
        published = _published(links, trainer, 1)
        wrong = [n for n in expected if not torch.equal(published[n], expected[n])]
        assert not wrong, f"summed the straggler's gradient, computed on moved parameters: {wrong}"
        for server in servers:
            (record,) = server.shard.records.since(0)
            assert set(record.workers.values()) == {"a"}, "every id from the member or its backup"


@pytest.mark.parametrize("job", JOBS)
def test_a_straggler_whose_push_every_shard_took_before_applying_confirms_it(
    digits_url: str, job: dict[str, Any]
) -> None:
    """Shard 1 asked for a backup of `b`'s ids, shard 0 did not yet: `b`'s push, late, completes step 0 at
    shard 0, which applies it, and shard 1 holds `b`'s copy aside (its parts too). No backup can be trained
    any more (shard 0 is past the step), but `b`'s answers say every shard took its push before applying:
    asked by shard 1 for its own ids, `b` confirms them, and shard 1 applies the step with them, bit for
    bit."""
    expected = _solo(digits_url, job)
    with _shards(digits_url, job) as (servers, served, trainer, schedule), _links(served) as links:
        channels = tuple(s.address for s in served)
        a, b = Role(0, 0, ("a", "b"), 0, channels=channels), Role(0, 1, ("a", "b"), 0, channels=channels)
        own, silent = schedule.share(0, 0, 2), schedule.share(0, 1, 2)
        trainer.step(a, 0, own, links, schedule, LoopStats("a"), None, _To(0))
        trainer.step(a, 0, own, links, schedule, LoopStats("a"), None, _To(1))
        # `a` asks shard 1 alone for step 1: shard 1 asks it for a backup, shard 0 never did.
        (answer,) = exchange(links[1:], [Pull(0, Then(1, WAIT, worker="a")).frame()], WAIT)
        assert answer.header["next_error"]["batch_ids"] == list(silent)
        with _links(served) as late:
            ahead = trainer.step(b, 0, silent, late, schedule, LoopStats("b"), None, Pipelined())
            assert [server.version for server in servers] == [1, 0], "shard 1 holds b's copy aside"
            with pytest.raises(BackupWanted) as wanted:
                _parameters(ahead, trainer)
            assert wanted.value.batch_ids == silent
            trainer.confirm(b, 0, silent, late)
        assert [server.version for server in servers] == [1, 1]
        published = _published(links, trainer, 1)
        assert all(torch.equal(published[n], expected[n]) for n in expected), "bit for bit"
        for server in servers:
            (record,) = server.shard.records.since(0)
            assert {record.workers[i] for i in silent} == {"b"}
