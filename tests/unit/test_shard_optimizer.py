"""A shard's parameters in one flat tensor (`data_server/optimizer.py`), without a cluster: the same bits as
torch's optimizer over one tensor per parameter, and torch's state_dict form on the way out and in."""

from __future__ import annotations

import pytest
import torch

from prefect_elastic.compute import PACK_BYTES, gradient_entries, packs, unflatten
from prefect_elastic.data_server.optimizer import ShardBuffers, ShardOptimizer, _flat_view
from prefect_elastic.errors import FatalError
from prefect_elastic.job import ElasticJob, ModelSpec
from prefect_elastic.wire import Entry, Frame, decode, encode

# Odd lengths: the vectorized kernels handle the tail of a tensor apart from its body, and a parameter's
# tail lies in the body of the flat tensor.
SHAPES = {
    "a.weight": (7, 5),
    "a.bias": (7,),
    "b.weight": (33, 7),
    "b.bias": (1,),
    "c": (129,),
    "d": (3, 1, 2),
}

OPTIMIZERS = [
    {"name": "sgd", "lr": 0.02, "momentum": 0.9},
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True},
    {"name": "adam", "lr": 1e-3},
    {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, "amsgrad": True},
]


def model_spec(optimizer: dict[str, object]) -> ModelSpec:
    """The model spec of a job with `optimizer` (checked as the job checks it)."""
    job = ElasticJob(
        job_id="flat", model="tests.models:mlp", dataset="file:///nowhere.npz", optimizer=optimizer
    )
    return job.model_spec


def tensors(seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in shapes.items()}


def torch_reference(optimizer: dict[str, object], steps: list[list[dict[str, torch.Tensor]]]) -> dict:
    """What `torch.optim` gives over one tensor per parameter, with the gradients summed in order."""
    params = {n: t.clone() for n, t in tensors(0).items()}
    opt = model_spec(optimizer).build_optimizer(list(params.values()))
    for micro_batches in steps:
        for name, p in params.items():
            total = micro_batches[0][name].clone()
            for g in micro_batches[1:]:
                total.add_(g[name])
            p.grad = total.div_(len(micro_batches)) if len(micro_batches) > 1 else micro_batches[0][name]
        opt.step()
    return {"params": params, "optimizer": opt.state_dict()}


def gradient_steps(count: int) -> list[list[dict[str, torch.Tensor]]]:
    return [[tensors(100 + 10 * s + m) for m in range(1 + s % 3)] for s in range(count)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_one_flat_tensor_gives_the_bits_of_one_tensor_per_parameter(optimizer: dict[str, object]) -> None:
    steps = gradient_steps(12)
    expected = torch_reference(optimizer, steps)
    shard = ShardOptimizer(model_spec(optimizer), tensors(0))
    for micro_batches in steps:
        shard.step(micro_batches)
    for name, p in expected["params"].items():
        assert torch.equal(shard.params[name], p), name
    got = shard.state_dict()
    assert got["param_groups"] == expected["optimizer"]["param_groups"]
    assert got["state"].keys() == expected["optimizer"]["state"].keys()
    for i, entry in expected["optimizer"]["state"].items():
        assert got["state"][i].keys() == entry.keys()
        for key, value in entry.items():
            assert (
                torch.equal(got["state"][i][key], value)
                if value is not None
                else got["state"][i][key] is None
            )


@pytest.mark.parametrize("optimizer", OPTIMIZERS[::2], ids=lambda o: str(o["name"]))
def test_a_state_dict_taken_out_and_loaded_again_goes_on_with_the_same_bits(
    optimizer: dict[str, object],
) -> None:
    steps = gradient_steps(10)
    expected = torch_reference(optimizer, steps)
    first = ShardOptimizer(model_spec(optimizer), tensors(0))
    for micro_batches in steps[:4]:
        first.step(micro_batches)
    saved = first.state_dict()
    # A promotion or a restore: a new shard from the snapshot's tensors and optimizer state.
    second = ShardOptimizer(model_spec(optimizer), {n: p.clone() for n, p in first.params.items()})
    second.load_state_dict(saved)
    for micro_batches in steps[4:]:
        second.step(micro_batches)
        first.step(micro_batches)
    for name, p in expected["params"].items():
        assert torch.equal(second.params[name], p), name
        assert torch.equal(first.params[name], p), name


@pytest.mark.parametrize("optimizer", OPTIMIZERS[::2], ids=lambda o: str(o["name"]))
def test_a_promoted_shard_takes_the_replica_as_it_came_and_goes_on_with_the_same_bits(
    optimizer: dict[str, object],
) -> None:
    """A promotion takes a replica's tensors (its own, one per parameter) without a copy: that shard then
    holds one tensor per parameter, and the steps give the bits the flat shard would have given."""
    steps = gradient_steps(10)
    expected = torch_reference(optimizer, steps)
    first = ShardOptimizer(model_spec(optimizer), tensors(0))
    for micro_batches in steps[:4]:
        first.step(micro_batches)
    replica = {n: p.clone() for n, p in first.params.items()}
    state = first.state_dict()
    promoted = ShardOptimizer(model_spec(optimizer), replica, owned=True)
    promoted.load_state_dict(state, owned=True)
    assert all(
        promoted.params[n] is not None and promoted.params[n].data_ptr() == replica[n].data_ptr()
        for n in replica
    )
    for micro_batches in steps[4:]:
        promoted.step(micro_batches)
    for name, p in expected["params"].items():
        assert torch.equal(promoted.params[name], p), name
    # Its snapshots read as a flat shard's do.
    assert promoted.state_dict()["state"].keys() == expected["optimizer"]["state"].keys()


def test_the_snapshot_form_is_a_copy_that_later_steps_do_not_change() -> None:
    shard = ShardOptimizer(model_spec(OPTIMIZERS[0]), tensors(0))
    shard.step([tensors(1)])
    saved = shard.state_dict()
    before = saved["state"][0]["momentum_buffer"].clone()
    shard.step([tensors(2)])
    assert torch.equal(saved["state"][0]["momentum_buffer"], before)


def test_the_parameters_are_views_of_the_flat_tensor_and_a_restore_writes_through_them() -> None:
    shard = ShardOptimizer(model_spec(OPTIMIZERS[0]), tensors(0))
    with torch.no_grad():
        for name, p in shard.params.items():
            p.copy_(tensors(5)[name])
    shard.step([tensors(1)])
    reference = ShardOptimizer(model_spec(OPTIMIZERS[0]), tensors(5))
    reference.step([tensors(1)])
    for name in SHAPES:
        assert torch.equal(shard.params[name], reference.params[name])


def test_gradients_that_came_back_to_back_in_a_frame_are_taken_without_a_copy() -> None:
    grads = tensors(3)
    frame = Frame(
        {}, [(Entry("grad", 0, n), g) for n, g in grads.items()] + [(Entry("buffer", 0, "n"), torch.ones(2))]
    )
    parts = encode(frame)
    header = bytes(parts[0])[4:]
    body = bytearray(b"".join(bytes(p) for p in parts[1:]))
    got = decode(header, body)
    decoded = [t for e, t in got.tensors if e.kind == "grad"]
    flat = _flat_view(decoded)
    assert flat is not None and flat.numel() == sum(g.numel() for g in grads.values())
    # A view, not a copy: it reads the frame's own bytes.
    decoded[0].view(-1)[0] = 42.0
    assert flat[0].item() == 42.0
    # Out of order, or with a tensor between them, they are not one run.
    assert _flat_view(decoded[::-1]) is None
    assert _flat_view([decoded[0], decoded[2]]) is None


def test_a_shard_of_two_dtypes_keeps_one_tensor_per_parameter_and_still_steps() -> None:
    params = {"w": torch.randn(5), "h": torch.randn(3, dtype=torch.float64)}
    shard = ShardOptimizer(model_spec(OPTIMIZERS[0]), params)
    shard.step([{"w": torch.ones(5), "h": torch.ones(3, dtype=torch.float64)}])
    assert torch.allclose(shard.params["w"], params["w"] - 0.02)
    assert shard.params["h"].dtype == torch.float64
    assert torch.allclose(shard.params["h"], params["h"] - 0.02)
    assert set(shard.state_dict()["state"]) == {0, 1}


def packed_over_the_wire(batch_id: int, grads: dict[str, torch.Tensor], order: list[str]) -> torch.Tensor:
    """A micro-batch's gradients as a compute loop sends them when they are small (`gradient_entries`),
    through the channel's encoding: the one flat tensor the shard takes."""
    entries = gradient_entries(batch_id, [(n, grads[n]) for n in order], packs(list(grads.values())))
    assert [e.kind for e, _ in entries] == ["grads"]
    parts = encode(Frame({"order": order}, entries))
    got = decode(bytes(parts[0])[4:], bytearray(b"".join(bytes(p) for p in parts[1:])))
    ((_, flat),) = got.tensors
    return flat


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_packed_gradients_give_the_bits_of_one_tensor_per_parameter_in_any_order(
    optimizer: dict[str, object],
) -> None:
    """In the shard's order the flat run is taken as it is; in another order it is taken by name. Either
    way the step is torch's over one tensor per parameter; a promoted shard (one tensor each) too."""
    steps = gradient_steps(8)
    expected = torch_reference(optimizer, steps)
    names = list(SHAPES)
    spec = model_spec(optimizer)
    shards = [
        (ShardOptimizer(spec, tensors(0)), names),
        (ShardOptimizer(spec, tensors(0)), names[::-1]),
        (ShardOptimizer(spec, {n: t.clone() for n, t in tensors(0).items()}, owned=True), names),
    ]
    assert shards[2][0].flat is None  # (one tensor per parameter, as a promotion leaves it)
    for shard, order in shards:
        for micro_batches in steps:
            shard.step([shard.packed(order, packed_over_the_wire(0, g, order)) for g in micro_batches])
        for name, p in expected["params"].items():
            assert torch.equal(shard.params[name], p), (order, name)


def test_a_packed_gradient_that_is_not_the_shards_is_refused() -> None:
    shard = ShardOptimizer(model_spec(OPTIMIZERS[0]), tensors(0))
    names = list(SHAPES)
    flat = torch.cat([t.reshape(-1) for t in tensors(1).values()])
    with pytest.raises(FatalError, match="packed gradient of 5 tensors"):
        shard.packed(names[:-1], flat)
    with pytest.raises(FatalError, match="packed gradient"):
        shard.packed(names, flat[:-1])
    with pytest.raises(FatalError, match="packed gradient"):
        shard.packed([*names[:-1], "not-a-parameter"], flat)


def test_small_gradients_are_packed_and_large_mixed_or_single_ones_go_one_by_one() -> None:
    small = [("a", torch.ones(3, 2)), ("b", torch.zeros(4))]
    assert packs([t.to("meta") for _, t in small])  # (decided on the meta model's parameters)
    ((entry, flat),) = gradient_entries(7, small, True)
    assert entry == Entry("grads", 7, "") and flat.tolist() == [1.0] * 6 + [0.0] * 4
    assert not packs([torch.ones(PACK_BYTES // 4), torch.zeros(1)])
    assert not packs([torch.ones(3), torch.zeros(2, dtype=torch.float64)])
    assert not packs([torch.ones(3)])
    assert [e.name for e, _ in gradient_entries(7, small, False)] == ["a", "b"]


def test_flat_parameters_come_back_as_views_by_name_and_a_wrong_count_is_refused() -> None:
    shard = ShardOptimizer(model_spec(OPTIMIZERS[0]), tensors(0))
    assert shard.flat is not None
    shapes = {n: torch.Size(s) for n, s in SHAPES.items()}
    parts = encode(Frame({}, [(Entry("params", -1, ""), shard.flat)]))
    got = decode(bytes(parts[0])[4:], bytearray(b"".join(bytes(p) for p in parts[1:])))
    ((_, flat),) = got.tensors
    views = unflatten(shard.names, flat, shapes)
    for name, p in shard.params.items():
        assert torch.equal(views[name], p) and views[name].shape == p.shape
    assert views[shard.names[0]].data_ptr() == flat.data_ptr()  # views of the frame's bytes, not copies
    with pytest.raises(FatalError, match="parameter elements"):
        unflatten(shard.names[:-1], flat, shapes)
    with pytest.raises(FatalError, match="do not fit the model"):
        unflatten([*shard.names, "extra"], flat, shapes)


def bn_buffers(seed: int) -> dict[str, torch.Tensor]:
    """Buffers as BatchNorm layers hold them: running statistics (float) and a counter (int64) each."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer, width in (("bn1", 5), ("bn2", 3), ("bn3", 7)):
        out[f"{layer}.running_mean"] = torch.randn(width, generator=gen)
        out[f"{layer}.running_var"] = torch.rand(width, generator=gen)
        out[f"{layer}.num_batches_tracked"] = torch.tensor(seed, dtype=torch.int64)
    return out


def buffers_over_the_wire(batch_id: int, buffers: dict[str, torch.Tensor], order: list[str]) -> dict:
    """A micro-batch's buffers after its gradient, in `order`, through the channel's encoding (12 floats of
    gradient and 30 of buffers: the counters start 8-byte aligned in the body, and decode as one run)."""
    entries = [(Entry("grads", batch_id, ""), torch.ones(12))]
    entries += [(Entry("buffer", batch_id, n), buffers[n]) for n in order]
    parts = encode(Frame({}, entries))
    got = decode(bytes(parts[0])[4:], bytearray(b"".join(bytes(p) for p in parts[1:])))
    return {e.name: t for e, t in got.tensors if e.kind == "buffer"}


def test_buffers_are_updated_as_one_run_per_dtype_with_the_bits_of_one_by_one() -> None:
    """A shard's buffers live in one flat tensor per dtype (`ShardBuffers`); a micro-batch's buffers that
    came back to back in its frame, grouped by dtype as a loop sends them, update a whole run at once:
    the same bits as buffer by buffer (floats: the mean in batch-id order; counters: the first)."""
    start = bn_buffers(0)
    runs, one_by_one = ShardBuffers(start), ShardBuffers(start, owned=True)
    assert [len(names) for names, _ in runs.runs] == [6, 3]
    assert [flat.dtype for _, flat in runs.runs] == [torch.float32, torch.int64]
    grouped = sorted(start, key=lambda n: start[n].dtype == torch.int64)
    for step in range(3):
        per_batch = [buffers_over_the_wire(b, bn_buffers(10 * step + b), grouped) for b in range(1, 4)]
        for names, _ in runs.runs:
            assert all(_flat_view([u[n] for n in names]) is not None for u in per_batch), names
        runs.update(per_batch)
        one_by_one.update(per_batch)
        for name in start:
            assert torch.equal(runs.tensors[name], one_by_one.tensors[name]), name
        assert torch.equal(runs.tensors["bn2.num_batches_tracked"], torch.tensor(10 * step + 1))
    # The views are the runs: a restore that writes a buffer writes its run.
    runs.tensors["bn1.running_mean"].fill_(7.0)
    assert torch.equal(runs.runs[0][1][:5], torch.full((5,), 7.0))
    # Buffers sent in another order (an async loop's push) are updated one by one, to the same bits.
    interleaved = [buffers_over_the_wire(b, bn_buffers(b), list(start)) for b in range(2)]
    runs.update(interleaved)
    one_by_one.update(interleaved)
    for name in start:
        assert torch.equal(runs.tensors[name], one_by_one.tensors[name]), name
