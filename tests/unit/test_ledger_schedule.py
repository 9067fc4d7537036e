"""The batch ledger, the schedule and the shard plan: pure pieces, no cluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefect_elastic.data_server import plan_shards
from prefect_elastic.errors import FatalError
from prefect_elastic.ledger import Ledger
from prefect_elastic.schedule import Schedule


def test_ledger_commits_each_batch_once() -> None:
    ledger = Ledger()
    ledger.commit([0, 1], step=0, generation=1)
    with pytest.raises(FatalError, match="twice"):
        ledger.commit([1, 2], step=1, generation=1)
    with pytest.raises(FatalError, match="out of order"):
        ledger.commit([4, 5], step=2, generation=1)
    assert len(ledger) == 2 and ledger.committed_steps == 1


def test_ledger_rollback_drops_after_snapshot() -> None:
    ledger = Ledger()
    ledger.commit([0, 1], 0, 1)
    ledger.mark_snapshot()
    ledger.commit([2, 3], 1, 1)
    ledger.commit([4, 5], 2, 1)
    assert ledger.drop_after_snapshot() == [2, 3, 4, 5]
    assert ledger.committed_steps == 1 and ledger.dropped_steps == 2 and ledger.dropped_batches == 4
    ledger.commit([2, 3], 1, 2)  # the same step again, in the new generation
    assert [(e.batch_id, e.generation) for e in ledger.entries()] == [(0, 1), (1, 1), (2, 2), (3, 2)]


def schedule(**kw: object) -> Schedule:
    args: dict[str, object] = {
        "partition_sizes": (50, 49),
        "batch_size": 8,
        "micro_batches": 4,
        "epochs": 2,
        "seed": 0,
    }
    args.update(kw)
    return Schedule(**args)  # type: ignore[arg-type]


def test_schedule_counts_and_steps() -> None:
    s = schedule()
    assert s.batches_per_server_epoch == 6  # 49 // 8
    assert s.batches_per_epoch == 12 and s.total_batches == 24 and s.total_steps == 6
    assert list(s.step_batches(5)) == [20, 21, 22, 23]
    assert s.step_of(21) == 5
    uneven = schedule(micro_batches=5)
    assert uneven.total_steps == 5 and list(uneven.step_batches(4)) == [20, 21, 22, 23]


def test_each_sample_at_most_once_per_epoch() -> None:
    s = schedule()
    for epoch in range(2):
        for server in range(2):
            ids = [
                b
                for b in range(s.total_batches)
                if s.locate(b).epoch == epoch and s.locate(b).server == server
            ]
            samples = np.concatenate([s.sample_indices(b) for b in ids])
            assert len(samples) == len(set(samples.tolist())) == 48


def test_schedule_is_deterministic_and_seeded() -> None:
    assert np.array_equal(schedule().sample_indices(7), schedule().sample_indices(7))
    assert not np.array_equal(schedule().sample_indices(7), schedule(seed=1).sample_indices(7))
    # A new epoch reshuffles.
    assert not np.array_equal(schedule().sample_indices(0), schedule().sample_indices(12))


def test_schedule_refuses_partitions_without_a_batch() -> None:
    with pytest.raises(ValueError, match="smaller batch_size"):
        schedule(partition_sizes=(7, 9))


def test_plan_shards_is_balanced_deterministic_and_complete() -> None:
    state = {
        "a.weight": torch.zeros(100),
        "a.bias": torch.zeros(10),
        "b.weight": torch.zeros(90),
        "n": torch.zeros(1),
    }
    plan = plan_shards(state, 2)
    # Which shard holds a tensor depends on sizes and names only, not on the state's order.
    assert [set(names) for names in plan] == [
        set(names) for names in plan_shards(dict(reversed(state.items())), 2)
    ]
    assert sorted(n for names in plan for n in names) == sorted(state)
    sizes = [sum(state[n].numel() for n in names) for names in plan]
    assert max(sizes) - min(sizes) <= 10
    # Within a shard the model's own order is kept.
    for names in plan:
        assert names == [n for n in state if n in names]


def test_a_small_state_goes_to_as_few_shards_as_hold_min_bytes_each_the_last_ones() -> None:
    state = {"a.weight": torch.zeros(1000), "a.bias": torch.zeros(10), "b.weight": torch.zeros(990)}
    total = 2000 * 4
    # Too small to split: all of it on the last shard (the first shares its process with the coordinator).
    assert plan_shards(state, 3, total) == [[], [], ["a.weight", "a.bias", "b.weight"]]
    assert plan_shards(state, 3, total + 1) == [[], [], ["a.weight", "a.bias", "b.weight"]]
    # Enough for two shards of min_bytes each: the last two, balanced as before.
    assert plan_shards(state, 3, total // 2) == [[], ["a.weight"], ["a.bias", "b.weight"]]
    # 0 (and enough bytes for every shard) spreads over all of them, as plan_shards does without a floor.
    assert plan_shards(state, 3, 0) == plan_shards(state, 3) == plan_shards(state, 3, 1)
    assert all(plan_shards(state, 3, 0))


def test_state_layout_holds_tied_weights_once() -> None:
    from prefect_elastic.job import state_layout
    from tests.models import tied_dropout

    model = tied_dropout()
    layout = state_layout(model)
    assert layout.aliases == {"again.weight": "hidden.weight"}
    assert "again.weight" not in layout.params and "hidden.weight" in layout.params
    assert "scale" in layout.buffers and "scale" not in layout.exported
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    exported = layout.export(tensors)
    assert list(exported) == list(model.state_dict())
    assert exported["again.weight"] is exported["hidden.weight"]
