"""The job: what the user asked for (`ElasticJob`), validated up front, and what every role builds from it.

- `settings`: `ElasticJob`, every setting of one job and the cheap checks run when it is built;
- `specs`: each role's slice of the job (`ShardSpec`, `LoopSpec`, `CheckpointSpec`, `RoleSpecs`), and
  `ModelSpec`, which builds the model, the loss and the optimizer;
- `build`: the model, the loss and the optimizer, built the same way in every role; `StateLayout`;
  `resolve_callable` for import paths; `GLOBAL_RNG_LOCK`, held by whatever draws from torch's generator;
- `inputs`: the expensive checks of the dataset against the job, once before any cluster work;
- `loading`: a job's YAML form, and pydantic's refusals as `JobConfigError`.
"""

from __future__ import annotations

from .build import GLOBAL_RNG_LOCK, LOSSES, OPTIMIZERS, LossFn, StateLayout, resolve_callable, state_layout
from .settings import ElasticJob
from .specs import CheckpointSpec, LoopSpec, ModelSpec, RoleSpecs, ShardSpec

__all__ = [
    "GLOBAL_RNG_LOCK",
    "LOSSES",
    "OPTIMIZERS",
    "CheckpointSpec",
    "ElasticJob",
    "LoopSpec",
    "LossFn",
    "ModelSpec",
    "RoleSpecs",
    "ShardSpec",
    "StateLayout",
    "resolve_callable",
    "state_layout",
]
