"""The plan that splits tensors across data servers (`plan_pieces`), cutting and joining a shard's tensors,
and which optimizers may split (`splits_tensors`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from prefect_elastic.errors import JobConfigError
from prefect_elastic.job.build import ELEMENTWISE_OPTIMIZERS, OPTIMIZERS, splits_tensors
from prefect_elastic.sharding import (
    SPLIT_MIN_ELEMENTS,
    Piece,
    cut,
    join,
    plan_pieces,
    plan_shards,
)


def model_state() -> dict[str, torch.Tensor]:
    # One layer far larger than a share (as a ResNet's last block), small ones around it.
    generator = torch.Generator().manual_seed(7)
    sizes = {"stem.weight": (64, 27), "stem.bias": (64,), "block.weight": (512, 1024), "block.bias": (512,),
             "head.weight": (10, 512), "head.bias": (10,), "norm.count": ()}  # fmt: skip
    return {n: torch.randn(s, generator=generator) for n, s in sizes.items()}


def covered_once(state: dict[str, torch.Tensor], plan: list[list[Piece]]) -> None:
    for name, t in state.items():
        runs = sorted((p.start, p.stop) for pieces in plan for p in pieces if p.name == name)
        assert runs, name
        assert runs[0][0] == 0 and runs[-1][1] == t.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs)), (name, runs)
        assert all(p.size == t.numel() for pieces in plan for p in pieces if p.name == name)
    for pieces in plan:  # one range of a tensor per shard at most, in the model's order
        names = [p.name for p in pieces]
        assert names == [n for n in state if n in names]


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_split_plan_covers_every_element_once_and_balances(shards: int) -> None:
    state = model_state()
    plan = plan_pieces(state, shards)
    assert len(plan) == shards
    covered_once(state, plan)
    loads = [sum(p.numel for p in pieces) for pieces in plan]
    total = sum(t.numel() for t in state.values())
    # Within half a small tensor's cut of the even share on each side.
    assert max(loads) - min(loads) <= SPLIT_MIN_ELEMENTS
    assert all(abs(load - total / shards) <= SPLIT_MIN_ELEMENTS / 2 + 1 for load in loads)
    # The whole-tensor plan could not: the big layer alone is most of the model.
    whole = [sum(state[n].numel() for n in names) for names in plan_shards(state, shards)]
    if shards > 1:
        assert max(whole) - min(whole) > max(loads) - min(loads)
        assert any(not p.whole for pieces in plan for p in pieces)


def test_split_plan_is_deterministic_and_depends_on_the_state_only() -> None:
    state = model_state()
    again = {n: torch.zeros_like(t) for n, t in state.items()}  # other values, same names and sizes
    assert plan_pieces(state, 3) == plan_pieces(again, 3) == plan_pieces(dict(state), 3)


def test_small_tensors_are_never_cut() -> None:
    state = {f"layer{i}.weight": torch.zeros(1000) for i in range(10)}
    plan = plan_pieces(state, 3)
    covered_once(state, plan)
    assert all(p.whole for pieces in plan for p in pieces)
    assert sorted(len(pieces) for pieces in plan) == [3, 3, 4]
    # Runs cut only at the tensors' edges would leave shards of 3000, 4000 and 3000 elements: no better
    # than whole tensors dealt out, which is what the plan then is.
    assert plan == plan_pieces(state, 3, split=False)


def test_tiny_models_and_empty_tensors() -> None:
    state = {"a": torch.zeros(1), "b": torch.zeros(0), "c": torch.zeros(2)}
    plan = plan_pieces(state, 5)
    covered_once(state, plan)
    assert all(p.whole for pieces in plan for p in pieces)
    assert plan_pieces({"only": torch.zeros(3)}, 2) == [[Piece("only", 0, 3, 3)], []]
    assert plan_pieces({"none": torch.zeros(0)}, 2) == [[Piece("none", 0, 0, 0)], []]


def test_min_shard_bytes_still_decides_how_many_shards_hold_state() -> None:
    state = model_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert [bool(p) for p in plan_pieces(state, 4, total)] == [False, False, False, True]
    assert [bool(p) for p in plan_pieces(state, 4, total // 2)] == [False, False, True, True]
    covered_once(state, plan_pieces(state, 4, total // 2))
    assert [bool(p) for p in plan_pieces(state, 4, 0)] == [True] * 4


def test_without_split_the_plan_is_whole_tensors() -> None:
    state = model_state()
    plan = plan_pieces(state, 3, split=False)
    assert [[p.name for p in pieces] for pieces in plan] == plan_shards(state, 3)
    assert all(p.whole for pieces in plan for p in pieces)


def test_cut_and_join_give_back_the_whole_tensors() -> None:
    state = model_state()
    shapes = {n: t.shape for n, t in state.items()}
    for shards in (1, 2, 3):
        plan = plan_pieces(state, shards)
        parts = [cut(state, pieces) for pieces in plan]
        for pieces, held in zip(plan, parts, strict=True):
            for p in pieces:
                assert held[p.name].numel() == p.numel
                if not p.whole:  # a flat view of the elements, no copy
                    assert held[p.name].dim() == 1
                    assert held[p.name].data_ptr() == state[p.name].data_ptr() + 4 * p.start
        joined = join(parts, plan, shapes)
        assert list(joined) == list(state)
        assert all(torch.equal(joined[n], state[n]) and joined[n].shape == state[n].shape for n in state)


def test_only_elementwise_optimizers_split() -> None:
    assert set(OPTIMIZERS.values()) <= ELEMENTWISE_OPTIMIZERS
    assert splits_tensors(torch.optim.SGD, None) is True
    assert splits_tensors(torch.optim.Adam, False) is False
    assert splits_tensors(torch.optim.AdamW, True) is True
    # Unknown (LBFGS reads the whole gradient's norm): not split unless asked, and asking is refused.
    assert splits_tensors(torch.optim.LBFGS, None) is False
    assert splits_tensors(torch.optim.LBFGS, False) is False
    with pytest.raises(JobConfigError, match=r"split_tensors=True.*LBFGS is not known to update elementwise"):
        splits_tensors(torch.optim.LBFGS, True)
