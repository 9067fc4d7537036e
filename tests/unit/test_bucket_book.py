"""A shard's book of the overlapped step (`bucket_book.py`), without a cluster: bucket parts summed in
batch-id order whatever order they came in (the same bits as today's whole-step mean), a bucket whole
before the step commits, the commit only once every id is sealed (a worker killed between its buckets
leaves no shard committed), duplicate ids dropped, a member's own part of an id asked a backup of held
aside, stale generations refused, the copies flipped and stepped back."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from prefect_elastic.data_server.bucket_book import BucketBook, Seal, TwoCopies, pull_verdict
from prefect_elastic.data_server.optimizer import ShardOptimizer
from prefect_elastic.errors import FatalError
from prefect_elastic.job import ElasticJob
from prefect_elastic.wire.signals import RecoverableError, StaleGenerationError

SIZES = (5, 64, 3, 129)  # a shard's buckets (odd lengths: vectorized kernels treat tails apart)
IDS = (12, 13, 14, 15)  # a step of four micro-batches


def gradients(seed: int = 0) -> dict[int, torch.Tensor]:
    """Each id's flat gradient of the shard, of magnitudes far apart so that the order of the sum shows in
    the bits."""
    generator = torch.Generator().manual_seed(seed)
    return {b: torch.randn(sum(SIZES), generator=generator) * 10.0 ** (3 * i - 4) for i, b in enumerate(IDS)}


def bucket_parts(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split(SIZES))


def seal(worker: str = "w") -> Seal:
    return Seal(worker, 0.5, {})


def book(generation: int = 3, step: int = 3) -> BucketBook:
    return BucketBook(0, SIZES, generation, step, IDS)


def whole_mean(grads: dict[int, torch.Tensor]) -> torch.Tensor:
    """The mean as a shard takes it today: `ShardOptimizer.step` over the whole step, seen through SGD
    with lr 1 and no momentum (parameters at zero: the new parameters are minus the mean)."""
    job = ElasticJob(
        job_id="b", model="tests.models:mlp", dataset="file:///x.npz", optimizer={"name": "sgd", "lr": 1.0}
    )
    shard = ShardOptimizer(job.model_spec, {"p": torch.zeros(sum(SIZES))})
    shard.step([grads[b] for b in IDS])
    return -shard.params["p"]


def test_parts_in_any_order_sum_to_the_whole_steps_mean_bit_for_bit() -> None:
    grads = gradients()
    expected = whole_mean(grads)
    # (The test can fail: another order of the sum gives other bits for these gradients.)
    other = grads[IDS[3]].clone().add_(grads[IDS[2]]).add_(grads[IDS[1]]).add_(grads[IDS[0]]).div_(4)
    assert not torch.equal(other, expected)
    arrivals = [(b, k) for b in IDS for k in range(len(SIZES))]
    for seed in range(20):
        random.Random(seed).shuffle(arrivals)
        shard = book()
        for b, k in arrivals:
            assert shard.take(3, 3, b, k, bucket_parts(grads[b])[k]) in ("held", "folded")
        assert all(shard.whole(k) for k in range(len(SIZES)))
        assert torch.equal(torch.cat([shard.gradient(k) for k in range(len(SIZES))]), expected)


def test_a_part_folds_as_far_as_the_ids_allow_and_a_bucket_is_whole_before_the_step_commits() -> None:
    grads = gradients()
    shard = book()
    assert shard.take(3, 3, 13, 1, bucket_parts(grads[13])[1]) == "held"  # 12 is missing
    assert shard.take(3, 3, 12, 1, bucket_parts(grads[12])[1]) == "folded"  # 12 and 13 go in
    assert shard.parts_held == 2
    for b in (15, 14):
        shard.take(3, 3, b, 1, bucket_parts(grads[b])[1])
    assert shard.whole(1) and shard.to_apply() == [1]
    assert not shard.committable  # the other buckets, and every seal, are missing
    shard.applied(1)
    assert shard.to_apply() == []
    with pytest.raises(FatalError):
        shard.applied(1)
    with pytest.raises(FatalError):
        shard.gradient(0)  # not whole


def test_the_step_commits_only_when_every_id_is_sealed_after_its_buckets() -> None:
    grads = gradients()
    shard = book()
    with pytest.raises(FatalError):
        shard.seal(3, 3, 12, seal())  # before its buckets: a broken sender
    for b in IDS:
        for k, piece in enumerate(bucket_parts(grads[b])):
            shard.take(3, 3, b, k, piece)
    for k in shard.to_apply():
        shard.applied(k)
    for b in IDS[:-1]:
        assert shard.seal(3, 3, b, seal(f"w{b}"))
    assert not shard.committable
    assert shard.seal(3, 3, IDS[-1], seal("w15"))
    assert shard.committable
    record = shard.record(1.0)
    assert record.batch_ids == IDS and record.workers[15] == "w15" and record.step == 3


def test_duplicate_parts_and_seals_are_dropped_and_a_mixed_copy_gives_the_same_bits() -> None:
    # Worker a sends id 12's first two buckets and goes silent; b trains id 12 too (issue 35's backup) and
    # sends all of it: the shard keeps a's two (the same bits) and b's others, and drops b's copies.
    grads = gradients()
    shard = book()
    parts = {b: bucket_parts(grads[b]) for b in IDS}
    for k in (0, 1):
        assert shard.take(3, 3, 12, k, parts[12][k].clone()) in ("held", "folded")
    for k in range(len(SIZES)):
        outcome = shard.take(3, 3, 12, k, parts[12][k].clone())
        assert outcome == ("duplicate" if k < 2 else "folded")
    assert shard.seal(3, 3, 12, seal("b"))
    assert not shard.seal(3, 3, 12, seal("a"))  # a wakes and seals: dropped
    assert shard.duplicates == 3
    for b in IDS[1:]:
        for k in range(len(SIZES)):
            shard.take(3, 3, b, k, parts[b][k])
        shard.seal(3, 3, b, seal())
    assert torch.equal(torch.cat([shard.gradient(k) for k in range(len(SIZES))]), whole_mean(grads))
    assert shard.record(0.0).workers[12] == "b"


def test_a_members_own_part_of_an_id_asked_a_backup_of_is_held_aside_until_confirmed_or_replaced() -> None:
    # The shard asked a backup of 13 and 15: the straggler's own parts of them come (13's computed on
    # moved parameters, wrong bits), then the backup's of 13; the straggler confirms 15. The sums take the
    # backup's 13 and the straggler's 15, in batch-id order: the step's mean bit for bit.
    grads = gradients(2)
    wrong = {b: bucket_parts(grads[b] * 2.0) if b == 13 else bucket_parts(grads[b]) for b in (13, 15)}
    shard = book()
    for b in (12, 14):
        for k, piece in enumerate(bucket_parts(grads[b])):
            shard.take(3, 3, b, k, piece)
    for b in (13, 15):
        for k, piece in enumerate(wrong[b]):
            assert shard.take(3, 3, b, k, piece, aside=True) == "aside"
    assert not any(shard.whole(k) for k in range(len(SIZES))), "in no sum"
    assert shard.missing_parts(13) == [] and shard.parts_held == 2 * len(SIZES) + 2 * len(SIZES)
    assert shard.seal(3, 3, 13, seal("straggler")), "its parts came, aside"
    for k, piece in enumerate(bucket_parts(grads[13])):
        assert shard.take(3, 3, 13, k, piece) in ("held", "folded"), "the backup's replaces it"
    assert shard.duplicates == len(SIZES)
    assert shard.confirm([13]) == 0, "nothing of 13 is aside any more"
    assert not any(shard.whole(k) for k in range(len(SIZES)))
    assert shard.confirm([15]) == len(SIZES)
    assert torch.equal(torch.cat([shard.gradient(k) for k in range(len(SIZES))]), whole_mean(grads))
    # A backup's part after the member's confirmed one is a duplicate, as any second copy.
    assert shard.take(3, 3, 15, 0, bucket_parts(grads[15])[0]) == "duplicate"
    # A fence drops what is aside with the rest.
    fenced = book()
    fenced.take(3, 3, 12, 0, bucket_parts(grads[12])[0], aside=True)
    assert fenced.drop().parts == 1 and fenced.aside == {}


def test_stale_generations_other_steps_unknown_ids_and_wrong_sizes_are_refused() -> None:
    shard = book(generation=3, step=3)
    part = torch.zeros(SIZES[0])
    with pytest.raises(StaleGenerationError):
        shard.take(2, 3, 12, 0, part)
    with pytest.raises(StaleGenerationError):
        shard.seal(4, 3, 12, seal())  # (any other generation: the shard's shell fences first)
    with pytest.raises(RecoverableError):
        shard.take(3, 2, 12, 0, part)  # a step the shard is past: the sender was too slow
    with pytest.raises(FatalError):
        shard.take(3, 3, 99, 0, part)
    with pytest.raises(FatalError):
        shard.take(3, 3, 12, len(SIZES), part)
    with pytest.raises(FatalError):
        shard.take(3, 3, 12, 1, part)  # bucket 1 has 64 elements
    assert shard.parts_held == 0


def test_a_single_micro_batch_step_takes_its_part_as_it_came() -> None:
    # (Async mode assembles each batch id this way: a step of one id, applied once every bucket is in.)
    part = torch.randn(SIZES[1])
    shard = BucketBook(0, SIZES, 1, 7, (40,))
    shard.take(1, 7, 40, 1, part)
    assert shard.gradient(1) is part


def test_a_worker_killed_between_its_buckets_leaves_no_shard_a_version_apart() -> None:
    # One worker trains a whole step for two shards; it sends its buckets in backward order (interleaved
    # across the shards) and then its seals, one per shard, and is killed after each prefix of that.
    grads = {b: torch.randn(sum(SIZES)) for b in IDS}
    sends: list[tuple[str, int, int, int]] = []  # (what, shard, id, bucket)
    for b in IDS:
        sends += [("part", shard, b, k) for k in reversed(range(len(SIZES))) for shard in (1, 0)]
    sends += [("seal", shard, b, -1) for b in IDS for shard in (1, 0)]
    first_seal = next(i for i, s in enumerate(sends) if s[0] == "seal")
    for cut in range(len(sends) + 1):
        books = [book(), book()]
        for what, shard, b, k in sends[:cut]:
            if what == "part":
                books[shard].take(3, 3, b, k, bucket_parts(grads[b])[k])
                for ready in books[shard].to_apply():
                    books[shard].applied(ready)
            else:
                books[shard].seal(3, 3, b, seal())
        committed = [s.committable for s in books]
        if cut < len(sends) - 1:
            assert committed == [False, False], cut  # buckets out, not all sealed: nothing commits
        # Versions apart only when the kill fell between the last two seals, as between one frame per
        # shard before; a fence then steps the shard ahead back (`TwoCopies`).
        assert (committed[0] != committed[1]) == (cut == len(sends) - 1), cut
        undone = [s.drop() for s in books]
        if first_seal < cut < len(sends) - 1:
            assert undone[1].sealed and undone[1].applied == tuple(range(len(SIZES)))


def test_a_fence_drops_the_open_step_and_says_what_it_had_applied() -> None:
    grads = gradients()
    shard = book()
    for b in IDS:
        shard.take(3, 3, b, 2, bucket_parts(grads[b])[2])
    shard.take(3, 3, 12, 0, bucket_parts(grads[12])[0])
    shard.applied(2)
    undone = shard.drop()
    assert (undone.generation, undone.step, undone.applied, undone.parts, undone.sealed) == (
        3,
        3,
        (2,),
        1,
        (),
    )
    assert shard.parts_held == 0 and not shard.whole(2)


def test_two_copies_flip_at_commit_and_step_back_until_the_next_apply() -> None:
    copies = TwoCopies(version=10)
    assert (copies.published, copies.writing) == (0, 1)
    assert not copies.step_back()  # nothing kept yet
    copies.apply_started()
    copies.commit()
    assert (copies.version, copies.published, copies.kept) == (11, 1, 10)
    # A fence found a peer still at 10: back, by flipping.
    assert copies.step_back()
    assert (copies.version, copies.published, copies.kept) == (10, 0, None)
    assert not copies.step_back()  # one version only
    copies.commit()
    copies.apply_started()  # the next step wrote into the copy that held 11's predecessor
    assert not copies.step_back() and copies.version == 11


def test_a_step_applied_in_place_or_a_snapshot_restored_leaves_nothing_to_step_back_to() -> None:
    copies = TwoCopies(version=10)
    copies.commit()
    assert copies.can_step_back_to(10) and not copies.can_step_back_to(9) and not copies.can_step_back_to(11)
    copies.applied_in_place()  # (an optimizer with no out-of-place update, a step pushed whole, async)
    assert (copies.version, copies.published, copies.kept) == (12, 1, None)
    assert not copies.can_step_back_to(11) and not copies.step_back()
    copies.commit()
    copies.restored(7)  # a rollback to the snapshot of 7, copied into the published copy
    assert (copies.version, copies.kept) == (7, None) and not copies.step_back()
    copies.counted_back()  # (a shard holding no state counts back alone)
    assert (copies.version, copies.kept) == (6, None)


@pytest.mark.parametrize(
    ("asked", "step", "verdict"),
    [(5, 8, "answer"), (5, 9, "wait"), (4, 8, None), (6, 8, None), (5, 7, None), (5, 10, None)],
)
def test_a_bucket_pull(asked: int, step: int, verdict: str | None) -> None:
    # A shard of generation 5 at version 8.
    if verdict is not None:
        assert pull_verdict(5, 8, asked, step) == verdict
    elif asked != 5:
        with pytest.raises(StaleGenerationError):
            pull_verdict(5, 8, asked, step)
    else:
        with pytest.raises(RecoverableError):
            pull_verdict(5, 8, asked, step)


def test_every_interleaving_of_two_workers_gives_the_same_sums() -> None:
    # Two workers, two ids each, their parts interleaved in every way that keeps each worker's own order.
    grads = gradients(1)
    expected = whole_mean(grads)
    mine = [
        [(b, k) for b in (12, 14) for k in range(len(SIZES))],
        [(b, k) for b in (13, 15) for k in range(len(SIZES))],
    ]
    a, b = mine
    for places in itertools.islice(itertools.combinations(range(len(a) + len(b)), len(a)), 0, None, 97):
        order, ia, ib = [], iter(a), iter(b)
        for i in range(len(a) + len(b)):
            order.append(next(ia) if i in places else next(ib))
        shard = book()
        for batch_id, k in order:
            shard.take(3, 3, batch_id, k, bucket_parts(grads[batch_id])[k])
        assert torch.equal(torch.cat([shard.gradient(k) for k in range(len(SIZES))]), expected)
