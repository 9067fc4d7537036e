"""Stragglers in sync mode without a cluster: when a shard asks for a backup, who trains which missing
batch ids, where a loop the shards went past goes on; and a step finished by a backup on real data
servers, bit for bit as every member's own pushes, with the straggler's late push refused."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from prefect_elastic.compute import LoopStats, MicroBatchTrainer, Pipelined, ShardByShard
from prefect_elastic.compute.frames import Ahead
from prefect_elastic.data_server import DataServer
from prefect_elastic.messages import Role, Tensors
from prefect_elastic.schedule import Schedule
from prefect_elastic.stragglers import (
    BACKUP_FLOOR_SECONDS,
    BACKUP_STEP_FACTOR,
    BACKUP_UNPACED_SECONDS,
    PACE_KNOWN_AFTER,
    backup_after,
    backup_due_in,
    backup_share,
    catch_up,
)
from prefect_elastic.training import prepare
from prefect_elastic.wire import Frame, ShardLink
from prefect_elastic.wire.signals import BackupWanted, StepPassed

from ..conftest import in_process_servers, make_job
from .test_channel import Served


def test_a_backup_waits_a_few_of_the_shards_recent_steps_and_longer_before_it_knows_them() -> None:
    assert backup_after([]) == backup_after([0.01] * (PACE_KNOWN_AFTER - 1)) == BACKUP_UNPACED_SECONDS
    assert backup_after([0.01] * PACE_KNOWN_AFTER) == BACKUP_FLOOR_SECONDS, "never below the floor"
    # The median: one long step (a membership change, a backup) does not move it.
    assert backup_after([0.1, 0.1, 0.1, 9.0, 0.1]) == pytest.approx(BACKUP_STEP_FACTOR * 0.1)


def test_a_backup_is_due_after_its_wait_or_at_once_when_only_the_positions_behind_are_missing() -> None:
    assert backup_due_in(10.0, 9.0, 0.5, [], []) == float("inf"), "nothing missing"
    assert backup_due_in(10.0, 9.8, 0.5, [3], []) == pytest.approx(0.3)
    assert backup_due_in(10.0, 9.0, 0.5, [3], []) == 0.0
    # The step before got position 3 from a backup: its member is likely still silent, so once every
    # other position is in, the backup is asked for at once...
    assert backup_due_in(10.0, 10.0, 0.5, [3], [3]) == 0.0
    # ... but not while another member's push is missing too: that one may still come.
    assert backup_due_in(10.0, 9.8, 0.5, [1, 3], [3]) == pytest.approx(0.3)
    # A member asked already is asked again a wait after it was asked, not before.
    assert backup_due_in(10.0, 9.0, 0.5, [3], [], told=9.8) == pytest.approx(0.3)
    assert backup_due_in(10.0, 10.0, 0.5, [3], [3], told=9.9) == pytest.approx(0.4)
    assert backup_due_in(10.0, 9.0, 0.5, [3], [], told=9.4) == 0.0


def test_the_members_that_pushed_split_the_missing_batch_ids_and_every_one_is_trained_once() -> None:
    schedule = Schedule((1000,), 10, micro_batches=8, epochs=1, seed=0)
    batches = schedule.step_batches(2)  # 16..23
    size = 4
    silent = schedule.share(2, 1, size)  # rank 1's share: 17, 21
    shares = {rank: backup_share(silent, batches, rank, size) for rank in range(size)}
    assert shares[1] == (), "the silent rank trains none of its own"
    assert sorted(b for share in shares.values() for b in share) == sorted(silent), "each once"
    assert shares == {0: (17,), 1: (), 2: (21,), 3: ()}, "in order of rank and of batch id"
    # Two silent members: the two left take both shares, in turn.
    both = sorted(silent + schedule.share(2, 3, size))
    assert [backup_share(both, batches, r, size) for r in range(size)] == [(17, 21), (), (19, 23), ()]
    # Members asked at different moments, a backup of some of the ids already in, still split alike:
    # by the silent member's positions, not by the order of the ids still missing.
    step = schedule.step_batches(1)  # 8..15; rank 1 of 4 holds 9, 13
    assert backup_share([9, 13], step, 0, size) == (9,) and backup_share([9, 13], step, 2, size) == (13,)
    assert backup_share([13], step, 0, size) == () and backup_share([13], step, 2, size) == (13,)
    # More members than micro-batches: a rank with no share of the step is no backup (it pushes nothing,
    # and may be the one that is silent).
    small = range(0, 2)
    assert [backup_share([1], small, r, 3) for r in range(3)] == [(1,), (), ()]
    # Every position missing (nobody pushed): the loop that asks trains them all.
    assert backup_share(list(batches), batches, 2, size) == tuple(batches)


def test_a_loop_the_shards_went_past_goes_on_beside_the_others() -> None:
    assert catch_up(7, 7, 40) == 7, "a backup's push after its step was applied: the loop's own step stands"
    assert catch_up(7, 5, 40) == 7
    assert catch_up(7, 8, 40) == 9, "its step was backed up: the next one, which the others start after it"
    assert catch_up(7, 30, 40) == 31
    # The last step open: nobody pulls a step after it, so nobody is asked to back it up; the loop the
    # shards passed trains it itself rather than leave it open for ever.
    assert catch_up(3, 9, 10) == 9
    assert catch_up(3, 8, 10) == 9
    assert catch_up(9, 10, 10) == 10, "every step applied: the loop is done"
    assert catch_up(3, 12, 10) == 10


class _NoWait:
    """A push observer that waits for nothing: `ShardByShard` then pushes without asking for the next step."""

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None:
        pass


def _parameters(ahead: Ahead | None, trainer: MicroBatchTrainer) -> Tensors:
    assert ahead is not None
    state, _ = ahead.unpack(trainer.shapes, trainer.plan)
    return {n: t.clone() for n, t in state.items()}


@contextlib.contextmanager
def _two_shards(
    digits_url: str,
) -> Iterator[tuple[list[DataServer], list[Served], MicroBatchTrainer, Schedule]]:
    """Two real data servers of the test job (the mlp, parameters on both), served in this process."""
    servers, plan = in_process_servers(digits_url, min_shard_bytes=0)
    prepared = prepare(make_job(digits_url, "reassign", model="tests.models:mlp", min_shard_bytes=0))
    trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, torch.device("cpu"))
    served = [Served(server.on_frame) for server in servers]
    try:
        yield servers, served, trainer, prepared.schedule
    finally:
        for s in served:
            s.close()


@contextlib.contextmanager
def _links(served: list[Served]) -> Iterator[list[ShardLink]]:
    links = [ShardLink(s.address, timeout=10) for s in served]
    try:
        yield links
    finally:
        for link in links:
            link.close()


def test_a_step_whose_member_is_silent_is_finished_by_a_backup_bit_for_bit(digits_url: str) -> None:
    """Two members of one generation on two real data servers: `a` pushes its share of step 0, `b` does
    not. `a`'s pull of step 1 is answered with `b`'s batch ids; `a` trains them as a backup, and the shards
    apply step 0 as one worker that trained every batch id does. `b`'s push, late, is refused (the shards
    went past it), and what they applied holds every batch id once."""
    with _two_shards(digits_url) as (_, served, trainer, schedule), _links(served) as links:
        solo = Role(0, 0, ("solo",), 0, channels=tuple(s.address for s in served))
        every = tuple(schedule.step_batches(0))
        expected = _parameters(
            trainer.step(solo, 0, every, links, schedule, LoopStats("solo"), None, Pipelined()), trainer
        )

    with _two_shards(digits_url) as (servers, served, trainer, schedule), _links(served) as links:
        channels = tuple(s.address for s in served)
        a, b = Role(0, 0, ("a", "b"), 0, channels=channels), Role(0, 1, ("a", "b"), 0, channels=channels)
        own, silent = schedule.share(0, 0, 2), schedule.share(0, 1, 2)
        stats = LoopStats("a")
        ahead = trainer.step(a, 0, own, links, schedule, stats, None, Pipelined())
        with pytest.raises(BackupWanted) as wanted:
            _parameters(ahead, trainer)
        assert wanted.value.step == 0 and wanted.value.batch_ids == silent
        mine = backup_share(wanted.value.batch_ids, schedule.step_batches(0), a.rank, a.size)
        assert mine == silent
        ahead = trainer.step(a, 0, mine, links, schedule, stats, None, Pipelined(), backup=True)
        backed_up = _parameters(ahead, trainer)
        assert set(backed_up) == set(expected)
        assert all(torch.equal(backed_up[n], expected[n]) for n in expected), "bit for bit"
        assert [server.version for server in servers] == [1, 1]

        # The straggler wakes: its step was applied without it, and it goes on after the next one.
        with _links(served) as late:
            with pytest.raises(StepPassed) as passed:
                trainer.step(b, 0, silent, late, schedule, LoopStats("b"), None, Pipelined())
            assert passed.value.version == 1 and catch_up(0, passed.value.version, schedule.total_steps) == 2
            # Its push itself, had it computed the step before it was applied: refused too.
            losses = {str(batch_id): 1.0 for batch_id in silent}
            push = {"op": "push", "generation": 0, "step": 0, "worker": "b", "losses": losses, "then": None}
            with pytest.raises(StepPassed):
                late[0].request(Frame(push), 10)
        for server in servers:
            (record,) = server.shard.records.since(0)
            assert record.batch_ids == every, "every batch id once"
            assert set(record.workers.values()) == {"a"}


def test_a_second_copy_of_a_batch_ids_gradient_is_dropped(digits_url: str) -> None:
    """A backup and the straggler it stood in for both reach a shard before the step is applied: the
    first copy is kept, and the step is applied once, when every batch id is in."""
    with _two_shards(digits_url) as (servers, served, trainer, schedule), _links(served) as links:
        channels = tuple(s.address for s in served)
        a, b = Role(0, 0, ("a", "b"), 0, channels=channels), Role(0, 1, ("a", "b"), 0, channels=channels)
        stats = LoopStats("a")
        first, *rest = schedule.step_batches(0)
        pushes = ShardByShard(_NoWait())
        # The same batch id twice: `a`'s backup of it, then the straggler `b`'s own.
        trainer.step(a, 0, (first,), links, schedule, stats, None, pushes, backup=True)
        trainer.step(b, 0, (first,), links, schedule, stats, None, pushes)
        assert [server.version for server in servers] == [0, 0], "one batch id, however many copies"
        assert [server.applies.pending for server in servers] == [1, 1]
        trainer.step(a, 0, tuple(rest), links, schedule, stats, None, pushes)
        assert [server.version for server in servers] == [1, 1]
        for server in servers:
            (record,) = server.shard.records.since(0)
            assert record.workers[first] == "a", "the first copy kept"
