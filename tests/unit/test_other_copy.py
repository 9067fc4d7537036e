"""The overlapped step's other copy (`data_server/other_copy.py`), without a cluster: buckets applied into it
and published at the commit give, step after step, the bits and the optimizer state of the whole step
applied in place (`ShardOptimizer.step`); the published copy is not written until the commit; a dropped
step leaves nothing to undo; a restore's state is taken up by the next step."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from prefect_elastic.data_server.optimizer import ShardOptimizer
from prefect_elastic.data_server.other_copy import OtherCopy, copy_kind
from prefect_elastic.wire.published import region_of
from tests.unit.test_shard_optimizer import OPTIMIZERS, SHAPES, model_spec

# Buckets of the shard's flat parameters, cut at odd places (some inside a parameter: a bucket is a run of
# the flat tensor; the plan cuts at piece edges, which these need not be).
CUTS = (0, 35, 36, 300, 301, 700)


def shard_params(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def gradients(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    return [torch.randn(numel, generator=generator) * 1e-2 for _ in range(steps)]


def state_of(optimizer: ShardOptimizer) -> dict[str, Any]:
    return optimizer.state_dict()


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i, entry in a["state"].items():
        other = b["state"][i]
        if entry.keys() != other.keys():
            return False
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other[key]):
                    return False
            elif value != other[key]:
                return False
    return True


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_buckets_applied_into_the_other_copy_then_published_give_the_whole_steps_bits(
    optimizer: dict[str, Any],
) -> None:
    spec = model_spec(optimizer)
    whole = ShardOptimizer(spec, shard_params(0))
    buckets = ShardOptimizer(spec, shard_params(0))
    kind = copy_kind(buckets)
    assert kind is not None
    copy = OtherCopy(buckets, kind)
    for step, gradient in enumerate(gradients(4)):
        whole.step([gradient])
        published = {n: t.clone() for n, t in buckets.params.items()}
        before = state_of(buckets)
        # (Any order: a bucket is applied when it is whole, whichever that is.)
        for start, stop in reversed(list(itertools.pairwise(CUTS))):
            copy.apply(start, stop, gradient[start:stop])
        for name, t in buckets.params.items():
            assert torch.equal(t, published[name]), f"step {step}: {name} written before the commit"
        assert same_state(state_of(buckets), before), f"step {step}: the state changed before the commit"
        copy.flip()
        for name, t in whole.params.items():
            assert torch.equal(buckets.params[name], t), f"step {step}: {name}"
        assert same_state(state_of(buckets), state_of(whole)), f"step {step}"
    assert copy.applied == 4 * (len(CUTS) - 1)


def test_the_published_copy_is_read_in_place_whichever_it_is() -> None:
    buckets = ShardOptimizer(model_spec(OPTIMIZERS[0]), shard_params(1))
    copy = OtherCopy(buckets, "sgd")
    first = buckets.flat
    assert first is not None and region_of(first) is not None
    gradient = gradients(1)[0]
    copy.apply(0, CUTS[-1], gradient)
    copy.flip()
    second = buckets.flat
    assert second is not None and second.data_ptr() != first.data_ptr()
    found = region_of(second)
    assert found is not None and found[0].key != region_of(first)[0].key  # type: ignore[index]
    # The parameters by name are views of the copy published now.
    assert all(
        second.data_ptr() <= t.data_ptr() < second.data_ptr() + second.numel() * 4
        for t in buckets.params.values()
    )
    copy.apply(0, CUTS[-1], gradient)
    copy.flip()
    assert buckets.flat is not None and buckets.flat.data_ptr() == first.data_ptr()  # (back: two copies)


def test_a_dropped_step_leaves_nothing_and_a_restore_is_taken_up() -> None:
    spec = model_spec(OPTIMIZERS[0])
    whole = ShardOptimizer(spec, shard_params(2))
    buckets = ShardOptimizer(spec, shard_params(2))
    copy = OtherCopy(buckets, "sgd")
    steps = gradients(3)
    for gradient in steps[:2]:
        whole.step([gradient])
        copy.apply(0, CUTS[-1], gradient)
        copy.flip()
    saved = ({n: t.clone() for n, t in buckets.params.items()}, state_of(buckets))
    # A step of which some buckets were applied, then dropped (a fence): nothing published moved.
    copy.apply(0, CUTS[2], steps[2][: CUTS[2]] * 7)
    assert all(torch.equal(t, saved[0][n]) for n, t in buckets.params.items())
    # A restore (as `ShardState.restore` does it: into the published copy, and the optimizer's state).
    for name, t in buckets.params.items():
        t.copy_(saved[0][name])
    buckets.load_state_dict(saved[1])
    whole.step([steps[2]])
    copy.apply(0, CUTS[-1], steps[2])
    copy.flip()
    assert all(torch.equal(t, whole.params[n]) for n, t in buckets.params.items())
    assert same_state(state_of(buckets), state_of(whole))


def test_optimizers_without_an_out_of_place_update_have_no_other_copy() -> None:
    params = shard_params(3)
    assert copy_kind(ShardOptimizer(model_spec({"name": "sgd", "lr": 0.1, "foreach": True}), params)) is None
    assert copy_kind(ShardOptimizer(model_spec({"name": "adam", "lr": 1e-3}), params)) == "adam"
    mixed = {**params, "e": torch.zeros(3, dtype=torch.float64)}  # (two dtypes: no flat tensor)
    assert copy_kind(ShardOptimizer(model_spec(OPTIMIZERS[0]), mixed)) is None


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_a_step_back_publishes_the_copy_before_and_its_state_again(optimizer: dict[str, Any]) -> None:
    """A shard a step ahead of a peer steps back (`flip_back`): the parameters and the optimizer state are
    the version before bit for bit, from the first step on, and training from there gives the bits of a
    run that never took the step undone."""
    spec = model_spec(optimizer)
    whole = ShardOptimizer(spec, shard_params(4))
    buckets = ShardOptimizer(spec, shard_params(4))
    copy = OtherCopy(buckets, copy_kind(buckets) or "sgd")
    steps = gradients(4)
    for k, gradient in enumerate(steps[:3]):
        before = ({n: t.clone() for n, t in buckets.params.items()}, state_of(buckets))
        for start, stop in itertools.pairwise(CUTS):
            copy.apply(start, stop, gradient[start:stop] * 3)  # (a step that will be undone)
        copy.flip()
        copy.flip_back()
        assert all(torch.equal(t, before[0][n]) for n, t in buckets.params.items()), k
        assert same_state(state_of(buckets), before[1]), k
        whole.step([gradient])
        for start, stop in itertools.pairwise(CUTS):
            copy.apply(start, stop, gradient[start:stop])
        copy.flip()
        assert all(torch.equal(t, whole.params[n]) for n, t in buckets.params.items()), k
        assert same_state(state_of(buckets), state_of(whole)), k
