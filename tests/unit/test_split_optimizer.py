"""Tensors split across shards (`plan_pieces`) train to the bits of whole ones, without a cluster: each
shard's optimizer over its pieces (`ShardOptimizer`), the optimizer's state joined into a checkpoint's
whole form by name and cut again under another plan (`checkpoint.optimizer_state`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefect_elastic import CheckpointMismatchError
from prefect_elastic.checkpoint import AsyncCheckpoints, Checkpoint, CheckpointStore, Persistence, fingerprint
from prefect_elastic.checkpoint.optimizer_state import cut_optimizer, join_optimizer
from prefect_elastic.data_server.optimizer import ShardOptimizer
from prefect_elastic.job import ElasticJob, ModelSpec
from prefect_elastic.sharding import Piece, cut, join, part, plan_pieces

# One tensor far over a share (split), small ones with odd lengths around it.
SHAPES = {"big.weight": (300, 250), "big.bias": (300,), "head.weight": (7, 300), "head.bias": (7,)}
OPTIMIZERS = [
    {"name": "sgd", "lr": 0.02, "momentum": 0.9, "nesterov": True},
    {"name": "adam", "lr": 1e-3},
    {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, "amsgrad": True},
]


def model_spec(optimizer: dict[str, object]) -> ModelSpec:
    job = ElasticJob(
        job_id="split", model="tests.models:mlp", dataset="file:///nowhere.npz", optimizer=optimizer
    )
    return job.model_spec


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in SHAPES.items()}


def gradients(steps: int) -> list[list[dict[str, torch.Tensor]]]:
    return [[tensors(100 + 10 * s + m) for m in range(3)] for s in range(steps)]


class Shards:
    """Every shard's optimizer over its pieces of the model, as data servers hold them."""

    def __init__(self, spec: ModelSpec, plan: list[list[Piece]], start: dict[str, torch.Tensor]) -> None:
        self.plan = plan
        self.optimizers = [ShardOptimizer(spec, cut(start, pieces)) if pieces else None for pieces in plan]

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        for pieces, optimizer in zip(self.plan, self.optimizers, strict=True):
            if optimizer is not None:  # each micro-batch's gradient cut as a compute loop cuts it
                optimizer.step([{p.name: part(g[p.name], p) for p in pieces} for g in micro_batches])

    def whole(self) -> dict[str, torch.Tensor]:
        held = [o.params if o is not None else {} for o in self.optimizers]
        return join(held, self.plan, {n: torch.Size(s) for n, s in SHAPES.items()})

    def optimizer_state(self) -> dict[str, object]:
        states = [o.state_dict() if o is not None else {} for o in self.optimizers]
        return join_optimizer(states, self.plan, {n: torch.Size(s) for n, s in SHAPES.items()})


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: str(o["name"]))
def test_split_tensors_train_to_the_bits_of_whole_ones_and_resume_under_another_plan(
    optimizer: dict[str, object],
) -> None:
    spec, start, steps = model_spec(optimizer), tensors(0), gradients(6)
    one = Shards(spec, plan_pieces(start, 1), start)
    three = Shards(spec, plan_pieces(start, 3, split=True), start)
    assert any(not p.whole for pieces in three.plan for p in pieces)
    for micro_batches in steps[:3]:
        one.step(micro_batches)
        three.step(micro_batches)
    for name, t in one.whole().items():
        assert torch.equal(t, three.whole()[name]), name
    # A checkpoint: whole tensors and the optimizer's state by name, the same whichever plan wrote it.
    whole_state = three.optimizer_state()
    reference = one.optimizer_state()
    assert whole_state["param_groups"] == reference["param_groups"]
    for name, entry in reference["state"].items():  # type: ignore[union-attr]
        for key, value in entry.items():
            theirs = whole_state["state"][name][key]  # type: ignore[index]
            assert torch.equal(theirs, value) and theirs.shape == value.shape, (name, key)
    # Resumed on two shards: each cuts its part of the state, and trains on to the same bits.
    plan = plan_pieces(start, 2)
    two = Shards(spec, plan, three.whole())
    for pieces, opt in zip(plan, two.optimizers, strict=True):
        state = cut_optimizer(whole_state, [p for p in pieces if p.name in SHAPES])
        if opt is not None and state is not None:
            opt.load_state_dict(state)
    for micro_batches in steps[3:]:
        one.step(micro_batches)
        two.step(micro_batches)
    for name, t in one.whole().items():
        assert torch.equal(t, two.whole()[name]), name


def test_cut_optimizer_of_a_shard_without_parameters_or_settings_is_none() -> None:
    assert cut_optimizer({"state": {}, "param_groups": []}, [Piece("a", 0, 3, 3)]) is None
    assert cut_optimizer({"state": {}, "param_groups": [{"lr": 0.1}]}, []) is None
    assert join_optimizer([{}, {}], [[], []], {"a": torch.Size([3])}) == {"state": {}, "param_groups": []}


def wide_job(tmp_path: Path, **overrides: object) -> ElasticJob:
    fields: dict[str, object] = {
        "job_id": "split",
        "model": "tests.wide_models:wide_mlp",
        "dataset": "file:///nowhere.npz",
        "optimizer": {"name": "adam", "lr": 1e-3},
        "checkpoint": f"file://{tmp_path}/ckpt",
        **overrides,
    }
    return ElasticJob(**fields)  # type: ignore[arg-type]


def test_the_job_splits_by_default_and_its_fingerprint_leaves_out_where_tensors_live(tmp_path: Path) -> None:
    assert wide_job(tmp_path).splits and not wide_job(tmp_path, split_tensors=False).splits
    fields = wide_job(tmp_path).fingerprint_fields()
    assert "min_shard_bytes" not in fields and "split_tensors" not in fields and "data_servers" in fields


def test_an_async_checkpoint_resumes_each_shard_only_on_the_pieces_it_held(tmp_path: Path) -> None:
    j = wide_job(tmp_path, mode="async", min_shard_bytes=0)
    layout, tensors = j.initial_tensors()
    plan = plan_pieces(tensors, 2)
    assert any(not p.whole for pieces in plan for p in pieces)
    CheckpointStore(str(j.checkpoint)).write(
        Checkpoint(
            job_id=j.job_id,
            fingerprint=fingerprint(j.checkpoint_spec, layout, tensors),
            generation=3,
            committed_steps=6,
            ledger=[],
            history=[],
            tensors=tensors,
            optimizers=[],
            versions=(6, 7),
            applied=(tuple(range(6)), tuple(range(7))),
            optimizer={"state": {}, "param_groups": [{"lr": 1e-3}]},
            plan=tuple(tuple((p.name, p.start, p.stop) for p in pieces) for pieces in plan),
        )
    )
    resumed = Persistence(j.checkpoint_spec, layout, tensors, AsyncCheckpoints())
    start = resumed.shard_start(1, plan[1])
    assert start.version == 7 and start.applied == tuple(range(7))
    assert {n: t.shape for n, t in start.params.items()} == {
        p.name: (torch.Size([p.numel]) if not p.whole else tensors[p.name].shape) for p in plan[1]
    }
    with pytest.raises(CheckpointMismatchError, match="data server 1 would hold other tensors"):
        resumed.shard_start(1, plan_pieces(tensors, 2, split=False)[1])


def test_a_checkpoint_of_one_optimizer_state_per_shard_resumes_under_a_split_plan(tmp_path: Path) -> None:
    # Formats 1 and 2 held one state per shard, under the whole-tensor plan of the job's `data_servers` and
    # `min_shard_bytes`; the state by name is read out of them, then cut for each shard of the new plan.
    j = wide_job(tmp_path, data_servers=2, min_shard_bytes=0)
    layout, tensors = j.initial_tensors()
    shapes = {n: tensors[n].shape for n in layout.params}
    step = [{n: torch.full_like(tensors[n], 0.5) for n in layout.params}]
    written = [[p for p in pieces if p.name in shapes] for pieces in plan_pieces(tensors, 2, split=False)]
    old = [ShardOptimizer(j.model_spec, cut(tensors, pieces)) for pieces in written]
    for pieces, optimizer in zip(written, old, strict=True):
        optimizer.step([{p.name: g[p.name] for p in pieces} for g in step])
    legacy = fingerprint(j.checkpoint_spec, layout, tensors)
    legacy["job"]["min_shard_bytes"] = 0  # (as formats 1 and 2 wrote it)
    CheckpointStore(str(j.checkpoint)).write(
        Checkpoint(
            job_id=j.job_id,
            fingerprint=legacy,
            generation=1,
            committed_steps=1,
            ledger=[],
            history=[],
            tensors=tensors,
            optimizers=[o.state_dict() for o in old],
        )
    )
    whole = join_optimizer([o.state_dict() for o in old], written, shapes)
    resumed = Persistence(j.checkpoint_spec, layout, tensors, AsyncCheckpoints())
    for index, pieces in enumerate(plan_pieces(tensors, 2)):
        held = [p for p in pieces if p.name in shapes]
        start = resumed.shard_start(index, pieces)
        assert start.optimizer_state is not None
        expected = cut_optimizer(whole, held)
        assert expected is not None
        for position, entry in expected["state"].items():
            for key, value in entry.items():
                assert torch.equal(start.optimizer_state["state"][position][key], value), (
                    held[position],
                    key,
                )
