"""Each role's slice of the job: small frozen specs, made once when the job is prepared.

A data server, a compute loop and the checkpoint writer are handed only the settings they read, never the
whole `ElasticJob`: what a role may depend on is written here, a setting added to the job reaches no role
unless a spec carries it, and what travels to a worker is a few numbers and strings. `ElasticJob` makes
them (`model_spec`, `shard_spec`, `loop_spec`, `checkpoint_spec`); `training/prepare.py` makes them once,
as `RoleSpecs`, and the controller hands each role its own.

`ModelSpec` is the one place that builds the model, the loss and the optimizer from their settings, so
every role (and `ElasticJob` itself) builds them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .build import GLOBAL_RNG_LOCK, LossFn, build_model, build_optimizer, loss_named


@dataclass(frozen=True)
class ModelSpec:
    """What builds the model, its loss and its optimizer: part of every role's spec (the data servers
    build the optimizer over their shard, the compute loops the model on the meta device and the loss)."""

    model: str  # the import path of the model's zero-argument factory
    seed: int  # the model's initial parameters, and every micro-batch's random ops (`micro_batch_seed`)
    loss: str  # a built-in loss's name, or an import path
    optimizer: dict[str, Any]  # the optimizer's `name` and keyword arguments

    def initial_model(self) -> torch.nn.Module:
        """The model as built for the seed, on the CPU."""
        # fork_rng keeps the caller's global RNG stream as it was. The lock: model constructors draw from
        # torch's one global generator, so two jobs started from threads of one process would otherwise
        # interleave their draws and start from parameters that depend on timing. Every model this package
        # builds is built here (a check's, a compute loop's skeleton too): one built outside the lock drew
        # in the middle of another job's initial parameters (`test_two_jobs_share_a_cluster`, twice).
        with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return build_model(self.model).cpu()

    def loss_fn(self) -> LossFn | None:
        """The loss function named by `loss` (None: `loss="model"`, the model computes its own)."""
        return None if self.loss == "model" else loss_named(self.loss)

    def build_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer named by `optimizer`, over `params` (the whole model or one shard's slice)."""
        return build_optimizer(self.optimizer, params)


@dataclass(frozen=True)
class ShardSpec:
    """A data server's slice of the job (`DataServer`, its `ShardState` and `ShardOptimizer`, and
    `warm_standby` on a standby that may take a data server's role)."""

    job_id: str
    model_spec: ModelSpec  # the optimizer over the shard's parameters
    call_timeout: float  # a promoted shard's fetch of its replica from the peer
    max_staleness: int  # async mode: the versions a gradient may be behind and still be applied
    peer_replicas: bool  # whether each snapshot is copied to the peer shard


@dataclass(frozen=True)
class LoopSpec:
    """A compute loop's slice of the job (`run_loop`, the mode's `Loop`, `MicroBatchTrainer`)."""

    job_id: str
    model_spec: ModelSpec  # the meta model, the loss, async mode's candidate step; the micro-batch seed
    call_timeout: float  # every remote call's bound
    liveness_interval: float  # the pause before asking the coordinator for a role again after a failure
    threads_per_worker: int  # torch's threads in the loop's worker
    micro_batches: int  # async mode: the least batch ids a lease asks for
    overlap_push: bool | None = None  # sync mode: gradients leave in buckets during backward (None: if big)
    deterministic: bool = True  # on a GPU: the kernels that give every worker a gradient's same bits
    overlap_pull: bool | None = None  # sync mode: parameters arrive in buckets during forward (None: remote)


@dataclass(frozen=True)
class CheckpointSpec:
    """The checkpoint writer's slice of the job (`Persistence`, and the `fingerprint` it checks)."""

    job_id: str
    url: str | None  # the folder's fsspec URL; None: no persistent checkpoints
    keep: int  # checkpoints kept before older ones are pruned
    storage_options: dict[str, Any]  # fsspec's keyword arguments for `url`
    every: int  # snapshots between two checkpoints
    failures_allowed: int  # writes that may fail in a row before the job stops
    fingerprint_fields: dict[str, Any]  # the job's settings a checkpoint must agree on to resume
    # How a checkpoint of format 1 or 2 whose fingerprint does not name it dealt its optimizer states.
    min_shard_bytes: int = 0


@dataclass(frozen=True)
class RoleSpecs:
    """Every role's spec of one job, made once when it is prepared; the controller hands each its own."""

    shard: ShardSpec
    loop: LoopSpec
    checkpoint: CheckpointSpec
