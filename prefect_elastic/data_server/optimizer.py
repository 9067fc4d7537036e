"""A data server's parameters as views of one flat tensor, and the job's optimizer over that tensor.

Why: a data server applies every step on the step's critical path, and it starts each one woken from
idle, when this machine runs the first operations several times slower (docs/benchmarks.md, "Issue 9").
`torch.optim` loops over the parameters in Python with a few kernels each: SGD with momentum over the
transformer's 16 tensors is 48 kernels and as many trips through the dispatcher; over one flat tensor it is
3. The job's optimizers work elementwise (`ModelSpec.optimizer`: sgd, adam, adamw), so one flat tensor
gives the very numbers that one tensor per parameter gives (`tests/unit/test_shard_optimizer.py` checks it
bit for bit, tails of odd lengths included).

A shard that takes a replica on a promotion keeps its tensors as they came (no copy on the promotion's
path): flat views where they arrived back to back, as a replica read from the peer's channel does, else
one tensor per parameter. Outside this class nothing is flat. `params` maps each name to a view of the flat
tensor; gradients come per name, and a micro-batch's gradients that arrived back to back in one frame
(`channel.decode` makes every tensor a view of the frame's one buffer, and a compute loop sends a shard's
gradients in the plan's order) are taken as one flat view without a copy. `state_dict` gives torch's form
for the unflattened parameters (one state entry per tensor), and `load_state_dict` takes it: snapshots,
replicas and checkpoints read the same whichever way a shard held its parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.sgd import sgd

from ..errors import FatalError
from ..job import ModelSpec
from ..messages import Tensors
from ..wire.published import Published, flat_tensor

# One micro-batch's gradient of a shard's parameters: by name, or one flat tensor in the shard's order.
Gradient = Tensors | torch.Tensor


class ShardOptimizer:
    """The parameters of one shard (`params`, by name, in the plan's order) and their optimizer."""

    def __init__(self, model: ModelSpec, params: Tensors, owned: bool = False) -> None:
        """`model`: builds the job's optimizer; `params`: the shard's parameters, copied; `owned`: this
        shard's alone (a replica just received on a promotion), taken as they are, never copied: one tensor
        each unless they already lie in one flat run. (A promotion's copy of a 200 MB shard and its
        optimizer state cost 0.1 s of the promotion; one tensor each costs a fraction of a millisecond a
        step.)"""
        self.names = list(params)
        self._shapes = [params[n].shape for n in self.names]
        self._sizes = [params[n].numel() for n in self.names]
        # One flat tensor, unless the shard's parameters are of several dtypes: then one tensor each.
        self._flat: torch.Tensor | None = None
        # A copied flat tensor lies in a published region (where memfds can be made): loops on this
        # machine read the parameters there instead of a copy in every answer (`wire/published.py`).
        self.region: Published | None = None
        flat = _flat_view([params[n] for n in self.names]) if owned else None
        if flat is None and not owned and len({params[n].dtype for n in self.names}) == 1:
            flat, self.region = flat_tensor([params[n] for n in self.names], params[self.names[0]].dtype)
        if flat is not None:
            self._flat = flat.detach()
            self.params = dict(zip(self.names, self._views(self._flat), strict=True))
            self._optimizer = model.build_optimizer([self._flat])
        else:
            self.params = {n: t.detach() if owned else t.detach().clone() for n, t in params.items()}
            self._optimizer = model.build_optimizer(list(self.params.values()))

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view(shape) for part, shape in zip(flat.split(self._sizes), self._shapes, strict=True)]

    @property
    def numel(self) -> int:
        """The elements of the shard's parameters, all together."""
        return sum(self._sizes)

    @property
    def flat(self) -> torch.Tensor | None:
        """The parameters as one flat tensor, in `names`' order (None where they are not held so)."""
        return self._flat

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The job's optimizer over `flat` (or over the parameters one by one, where `flat` is None)."""
        return self._optimizer

    def publish(
        self, flat: torch.Tensor, region: Published | None, state: dict[str, Any]
    ) -> tuple[torch.Tensor, Published | None, dict[str, Any]]:
        """Make `flat`, another copy of the same elements (the overlapped step's other copy:
        `data_server/other_copy.py`), the parameters, with `state` its optimizer state and `region` the
        published memory it lies in; returns the copy, region and state it replaces. `params` keeps its
        names, each now a view of `flat`: whoever reads them afresh (an answer, a snapshot) reads it."""
        old = self._flat
        if old is None:
            raise FatalError("a shard whose parameters are not one flat tensor has no other copy")
        optimizer = self._optimizer
        old_state = optimizer.state.pop(old, {})
        optimizer.param_groups[0]["params"] = [flat]
        if state:
            optimizer.state[flat] = state
        old_region, self._flat, self.region = self.region, flat, region
        for name, view in zip(self.names, self._views(flat), strict=True):
            self.params[name] = view
        return old, old_region, old_state

    def packed(self, order: Sequence[str], flat: torch.Tensor) -> Gradient:
        """A micro-batch's gradient that came as one flat run over the parameters `order` names (a compute
        loop packs small gradients: `compute.gradient_entries`): the run itself where it follows this
        shard's order, else views of it by name. Raises FatalError if it is not this shard's gradient."""
        if list(order) == self.names and flat.numel() == sum(self._sizes) and flat.dim() == 1:
            return flat
        shapes = dict(zip(self.names, self._shapes, strict=True))
        if sorted(order) != sorted(self.names) or flat.numel() != sum(self._sizes) or flat.dim() != 1:
            raise FatalError(f"a packed gradient of {len(order)} tensors for a shard of {len(self.names)}")
        sizes = [shapes[n].numel() for n in order]
        return {n: part.view(shapes[n]) for n, part in zip(order, flat.split(sizes), strict=True)}

    def step(self, grads: Sequence[Gradient]) -> None:
        """One optimizer step with the mean of `grads` (one per micro-batch, in batch-id order: the sum runs
        in that order, so the result does not depend on who computed what). Each is a dict by name, or
        one flat tensor in `names`' order (`packed`)."""
        with torch.no_grad():
            if self._flat is not None:
                gradient = _mean([self._flat_gradient(g) for g in grads])
                if not _sgd_step(self._optimizer, self._flat, gradient):
                    self._flat.grad = gradient
                    self._optimizer.step()
                    self._flat.grad = None
                return
            per_name = [
                g if isinstance(g, dict) else dict(zip(self.names, self._views(g), strict=True))
                for g in grads
            ]
            for name, p in self.params.items():
                p.grad = _mean([g[name] for g in per_name])
            self._optimizer.step()
            for p in self.params.values():
                p.grad = None

    def _flat_gradient(self, grads: Gradient) -> torch.Tensor:
        if isinstance(grads, torch.Tensor):
            return grads
        parts = [grads[n] for n in self.names]
        flat = _flat_view(parts)
        if flat is not None:
            return flat
        return torch.cat([g.reshape(-1) for g in parts])

    def state_dict(self) -> dict[str, Any]:
        """torch's `state_dict` of this optimizer as it would be over one tensor per parameter (copies)."""
        held = self._optimizer.state_dict()
        if self._flat is None:
            return _copy(held)
        (group,) = held["param_groups"]
        state: dict[int, dict[str, Any]] = {i: {} for i in range(len(self.names))}
        for key, value in held["state"].get(0, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # per element: momentum, exp_avg...
                for i, part in enumerate(self._views(value.detach())):
                    state[i][key] = part.clone()
            else:  # one for the tensor (Adam's step): the same for every parameter
                for i in state:
                    state[i][key] = _copy(value)
        return {
            "state": {i: entry for i, entry in state.items() if entry},
            "param_groups": [{**group, "params": list(range(len(self.names)))}],
        }

    def load_state_dict(self, state_dict: dict[str, Any], owned: bool = False) -> None:
        """Take a `state_dict` in torch's form over one tensor per parameter (as `state_dict` gives);
        copied, unless `owned` (this shard's alone) and either held one tensor per parameter or, per key,
        lying back to back in one storage (a replica read from a peer's channel: SGD's momentum)."""
        if self._flat is None:
            # (load_state_dict keeps the tensors it is given when their dtype and device are right.)
            self._optimizer.load_state_dict(state_dict if owned else _copy(state_dict))
            return
        (group,) = state_dict["param_groups"]
        per_tensor = state_dict["state"]
        state: dict[int, dict[str, Any]] = {}
        if per_tensor:
            first = per_tensor[group["params"][0]]
            flat_state: dict[str, Any] = {}
            for key, value in first.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    parts = [per_tensor[i][key] for i in group["params"]]
                    run = _flat_view(parts) if owned else None
                    flat_state[key] = (
                        run.detach()
                        if run is not None
                        else torch.cat([p.detach().reshape(-1) for p in parts])
                    )
                else:
                    flat_state[key] = _copy(value)
            state[0] = flat_state
        self._optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": [0]}]})


class ShardBuffers:
    """A shard's buffers (BatchNorm's running statistics and counters) as views of one flat tensor per
    dtype (`runs`: the names of each, in order, and the tensor), so that a step's update and an answer
    cost a few operations and entries, not a few per buffer: a ResNet's 27 buffers were copied one by one
    at every step, on the step's critical path (docs/benchmarks.md, "Issue 9"). `owned` (a replica taken
    on a promotion): the buffers as they came, one tensor each, no runs."""

    def __init__(self, buffers: Tensors, owned: bool = False) -> None:
        self.runs: list[tuple[list[str], torch.Tensor]] = []
        if owned:
            self.tensors = dict(buffers)
            return
        groups: dict[torch.dtype, list[str]] = {}
        for name, t in buffers.items():
            groups.setdefault(t.dtype, []).append(name)
        views: Tensors = {}
        for names in groups.values():
            flat = torch.cat([buffers[n].detach().reshape(-1) for n in names])
            self.runs.append((names, flat))
            sizes = [buffers[n].numel() for n in names]
            for name, part in zip(names, flat.split(sizes), strict=True):
                views[name] = part.view(buffers[name].shape)
        self.tensors = {name: views[name] for name in buffers}  # (in the order they came)

    def update(self, per_batch: Sequence[Tensors]) -> None:
        """Each buffer after a step, from its value after each micro-batch's forward pass (`per_batch`, in
        batch-id order; `combine_buffer`): a run at once where a micro-batch's buffers of it came back to
        back in its frame (a compute loop sends them so: `MicroBatchTrainer.buffer_order`), else one by
        one. The same bits either way: the update is elementwise."""
        done: set[str] = set()
        with torch.no_grad():
            for names, flat in self.runs:
                runs = [_flat_view([u[n] for n in names]) for u in per_batch]
                if per_batch and all(r is not None and r.numel() == flat.numel() for r in runs):
                    flat.copy_(combine_buffer([r for r in runs if r is not None]))
                    done.update(names)
            for name, b in self.tensors.items():
                if name not in done:
                    b.copy_(combine_buffer([u[name] for u in per_batch]))


def combine_buffer(values: list[torch.Tensor]) -> torch.Tensor:
    """The buffer after a step, from its value after each micro-batch's forward pass (batch-id order).

    Floating buffers (BatchNorm running mean and variance) take the mean of the micro-batches' values;
    counters (num_batches_tracked) take the first micro-batch's value, so a step counts once.
    """
    if not values[0].is_floating_point():
        return values[0]
    total = values[0].clone()
    for v in values[1:]:
        total.add_(v)
    return total.div_(len(values))


def _sgd_step(optimizer: torch.optim.Optimizer, flat: torch.Tensor, gradient: torch.Tensor) -> bool:
    """`optimizer.step()` for SGD over the one tensor `flat`, with `gradient`, through the function that
    `SGD.step` calls (`torch.optim.sgd.sgd`) with the arguments it gives: the very same numbers, and the
    momentum buffer where `SGD.step` keeps it. False, having done nothing, for any other optimizer.

    Why: `Optimizer.step` costs 60 us around 10 us of work (hooks, the profiler's record, the grad mode,
    `_init_group`), and a shard starts each step woken from idle, when that took 0.44 ms here against
    0.24 ms for the function alone: on the critical path of every step (docs/design/step-channel.md)."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    if group["fused"] or group["differentiable"] or getattr(optimizer, "grad_scale", None) is not None:
        return False
    state = optimizer.state[flat]
    buffers = [state.get("momentum_buffer")]
    sgd(
        [flat],
        [gradient],
        buffers,
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        has_sparse_grad=False,
        foreach=group["foreach"],
        fused=group["fused"],
    )
    if group["momentum"] != 0:
        state["momentum_buffer"] = buffers[0]
    return True


def _flat_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of `parts` if they lie back to back, in order, in one storage; else None."""
    if not parts:
        return None
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.dtype != first.dtype
            or part.device != first.device
            or part.untyped_storage().data_ptr() != base
            or part.storage_offset() != offset
        ):
            return None
        offset += part.numel()
    total = offset - first.storage_offset()
    return first.as_strided((total,), (1,), first.storage_offset())


def _mean(grads: list[torch.Tensor]) -> torch.Tensor:
    if len(grads) == 1:
        # One micro-batch: its gradient as it came (a buffer of its own, read from the wire); dividing by 1
        # would change no bit.
        return grads[0]
    total = grads[0].clone()
    for g in grads[1:]:
        total.add_(g)
    return total.div_(len(grads))


def _copy(value: Any) -> Any:
    return copy.deepcopy(value)
