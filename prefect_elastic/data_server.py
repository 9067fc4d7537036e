"""Data server with its parameter shard (seed 000): a Dask actor on a static worker, one per partition.

Owns, for one job:
- one partition of the training data, read from the job's fsspec URL when the actor starts, served by
  batch id (`get_batch`);
- one shard of the model state (a fixed set of whole parameter and buffer tensors, see `plan_shards`) and
  the optimizer state for those parameters; `pull` serves them, `push` collects the gradients of one
  step, `apply` runs the step when the coordinator commits it;
- the last snapshot of that shard, in memory (`snapshot`, and `fence(restore=True)` to reload it).

Does not own: which batches are done, when a step commits, the generation (the coordinator owns all
three and tells the shard through `fence` and `apply`). Called by compute workers (`pull`, `get_batch`,
`push`) and by the coordinator (`apply`, `snapshot`, `fence`). Every call carries the generation and a
call from another generation raises `StaleGenerationError`, so a message of a worker that was declared
dead can never touch the parameters.

All methods are `async def`: Dask runs them on the worker's event loop, where actor-to-actor calls cannot
deadlock; the one heavy piece (the optimizer step) runs in a thread so heartbeats go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .allocator import tune_allocator
from .dataset import DatasetInfo, load_partition, partition_bounds
from .errors import FatalError, RecoverableError, StaleGenerationError
from .job import ElasticJob
from .schedule import Schedule

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

# How long a pull sent ahead of its step waits for the step before it to commit; a step that takes
# longer (a slow worker still computing) costs the caller one ordinary pull instead.
PULL_AHEAD_SECONDS = 5.0


def plan_shards(state: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """Deal whole tensors to shards, largest first onto the lightest shard (deterministic).

    Whole tensors keep each optimizer state entry on one shard; elementwise optimizers then give the
    same numbers as on the whole model. Ties break on the name so every process computes the same plan.
    """
    loads = [0] * shards
    plan: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(state, key=lambda n: (-state[n].numel(), n)):
        target = min(range(shards), key=lambda i: (loads[i], i))
        plan[target].append(name)
        loads[target] += state[name].numel()
    order = {name: i for i, name in enumerate(state)}
    return [sorted(names, key=order.__getitem__) for names in plan]


@dataclass
class _Snapshot:
    version: int
    params: Tensors
    buffers: Tensors
    optimizer: dict[str, Any]


class DataServer:
    def __init__(
        self,
        index: int,
        job: ElasticJob,
        dataset: DatasetInfo,
        schedule: Schedule,
        params: Tensors,
        buffers: Tensors,
        optimizer_state: dict[str, Any] | None = None,
        version: int = 0,
    ) -> None:
        tune_allocator()  # pulls, pushes and snapshots allocate megabytes every step; see allocator.py
        self.index = index
        self.job_id = job.job_id
        self._schedule = schedule
        start, stop = partition_bounds(dataset.total, schedule.data_servers, index)
        x, y = load_partition(dataset, start, stop)
        self._x = torch.from_numpy(x)
        self._y = torch.from_numpy(y)
        self._params = {n: t.detach().clone() for n, t in params.items()}
        self._buffers = {n: t.detach().clone() for n, t in buffers.items()}
        self._optimizer = job.build_optimizer(list(self._params.values())) if self._params else None
        if optimizer_state and self._optimizer is not None:
            self._optimizer.load_state_dict(optimizer_state)  # resuming from a checkpoint
        self.generation = 0
        self.version = version  # number of steps applied
        self._applying = False
        self._version_changed: asyncio.Condition | None = None  # made in the event loop, on first use
        self._grads: dict[int, Tensors] = {}  # batch id -> gradient of this shard's params
        self._updated_buffers: dict[int, Tensors] = {}  # batch id -> buffers after its forward pass
        self._snapshot = self._copy_state()
        log.info(
            "data server %d of job %s: samples [%d, %d), %d params, %d buffers",
            index,
            self.job_id,
            start,
            stop,
            len(self._params),
            len(self._buffers),
        )

    def _check(self, generation: int, what: str) -> None:
        if generation != self.generation:
            raise StaleGenerationError(generation, self.generation, what)

    def _check_step(self, step: int, what: str) -> None:
        if self._applying:
            # Only a duplicate of an assignment can get here (the step's last report came in already).
            raise RecoverableError(f"{what} for step {step} while shard {self.index} is applying it")
        if step != self.version:
            raise RecoverableError(
                f"{what} for step {step}, but shard {self.index} is at step {self.version}"
            )

    async def get_batch(self, generation: int, batch_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(generation, "get_batch")
        if self._schedule.server_of(batch_id) != self.index:
            raise FatalError(f"batch {batch_id} lives on data server {self._schedule.server_of(batch_id)}")
        idx = torch.from_numpy(self._schedule.sample_indices(batch_id))
        return self._x[idx], self._y[idx]

    async def pull(self, generation: int, step: int, ahead: bool = False) -> Tensors:
        """The shard's parameters and buffers as of `step` (before it is applied).

        `ahead`: the caller asks before step `step - 1` has committed (it sends this with its report, so
        the answer leaves the moment the step is applied instead of one round trip later); the call waits
        until this shard reaches `step`, or fails when the generation changes or the wait runs out.
        """
        self._check(generation, "pull")
        if ahead:
            await self._wait_for_version(generation, step)
        self._check_step(step, "pull")
        tensors = {**self._params, **self._buffers}
        if ahead:
            # A worker that pulled ahead may get no work in this step, and then nothing stops the next
            # `apply` from changing these tensors while the reply is still being serialized.
            return {n: t.clone() for n, t in tensors.items()}
        # No copy: the tensors are serialized when this reply is sent, and `apply` for this step only
        # runs after every worker of the step has pulled, computed and reported.
        return tensors

    async def _wait_for_version(self, generation: int, step: int) -> None:
        if self._version_changed is None:
            self._version_changed = asyncio.Condition()
        changed = self._version_changed
        deadline = asyncio.get_running_loop().time() + PULL_AHEAD_SECONDS
        async with changed:
            while self.version < step and self.generation == generation:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
        self._check(generation, "pull")

    async def _announce_version(self) -> None:
        if self._version_changed is not None:
            async with self._version_changed:
                self._version_changed.notify_all()

    async def push(
        self,
        generation: int,
        step: int,
        batch_ids: list[int],
        grads: dict[int, Tensors],
        buffers: dict[int, Tensors],
    ) -> None:
        """The gradients (of this shard's parameters) and updated buffers of `batch_ids`."""
        self._check(generation, "push")
        self._check_step(step, "push")
        for batch_id in batch_ids:
            if self._schedule.step_of(batch_id) != step:
                raise FatalError(f"gradient of batch {batch_id} pushed for step {step}")
            self._grads[batch_id] = grads.get(batch_id, {})
            self._updated_buffers[batch_id] = buffers.get(batch_id, {})

    async def apply(self, generation: int, step: int, batch_ids: list[int]) -> int:
        """Apply step `step` from the gradients of `batch_ids`; called by the coordinator only."""
        self._check(generation, "apply")
        self._check_step(step, "apply")
        ordered = sorted(batch_ids)
        missing = [b for b in ordered if b not in self._grads]
        if missing:
            raise RecoverableError(f"shard {self.index}: no gradient for batches {missing} of step {step}")
        grads = [self._grads.pop(b) for b in ordered]
        buffers = [self._updated_buffers.pop(b) for b in ordered]
        self._grads.clear()
        self._updated_buffers.clear()
        self._applying = True
        try:
            await asyncio.to_thread(self._apply, grads, buffers)
        finally:
            self._applying = False
        self.version += 1
        await self._announce_version()
        return self.version

    def _apply(self, grads: list[Tensors], buffers: list[Tensors]) -> None:
        # Summed in batch-id order whatever order they arrived in: this is what makes the result bitwise
        # independent of which worker computed which micro-batch.
        with torch.no_grad():
            for name, p in self._params.items():
                total = grads[0][name].clone()
                for g in grads[1:]:
                    total.add_(g[name])
                p.grad = total.div_(len(grads))
            if self._optimizer is not None:
                self._optimizer.step()
            for p in self._params.values():
                p.grad = None
            for name, b in self._buffers.items():
                b.copy_(_combine_buffer([u[name] for u in buffers]))

    async def snapshot(self, generation: int) -> int:
        self._check(generation, "snapshot")
        self._snapshot = self._copy_state()
        return self.version

    async def fence(self, generation: int, restore: bool) -> int:
        """Enter `generation`: drop the gradients of the step in flight and, if `restore`, reload the
        last snapshot. Returns the version the shard is at afterwards."""
        if generation < self.generation:
            raise StaleGenerationError(generation, self.generation, "fence")
        self.generation = generation
        self._grads.clear()
        self._updated_buffers.clear()
        if restore:
            snap = self._snapshot
            with torch.no_grad():
                for name, p in self._params.items():
                    p.copy_(snap.params[name])
                for name, b in self._buffers.items():
                    b.copy_(snap.buffers[name])
            if self._optimizer is not None:
                self._optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
            self.version = snap.version
        await self._announce_version()
        return self.version

    async def export_snapshot(self) -> dict[str, Any]:
        """The last snapshot, for a persistent checkpoint."""
        snap = self._snapshot
        return {
            "version": snap.version,
            "tensors": {**snap.params, **snap.buffers},
            "optimizer": snap.optimizer,
        }

    async def state(self) -> Tensors:
        return {n: t.detach().clone() for n, t in {**self._params, **self._buffers}.items()}

    async def describe(self) -> dict[str, Any]:
        def nbytes(ts: Tensors) -> int:
            return sum(t.numel() * t.element_size() for t in ts.values())

        return {
            "index": self.index,
            "generation": self.generation,
            "version": self.version,
            "snapshot_version": self._snapshot.version,
            "samples": len(self._y),
            "data_bytes": self._x.numel() * self._x.element_size() + self._y.numel() * self._y.element_size(),
            "param_bytes": nbytes(self._params) + nbytes(self._buffers),
        }

    def _copy_state(self) -> _Snapshot:
        return _Snapshot(
            version=self.version,
            params={n: t.detach().clone() for n, t in self._params.items()},
            buffers={n: t.clone() for n, t in self._buffers.items()},
            optimizer=copy.deepcopy(self._optimizer.state_dict()) if self._optimizer is not None else {},
        )


def _combine_buffer(values: list[torch.Tensor]) -> torch.Tensor:
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
