"""The job blueprint: every setting of one elastic training job, validated when it is built.

This module owns `ElasticJob`: its fields, and the cheap checks that run when it is built (each impossible
value becomes a `JobConfigError` that names the field and the value). What it builds and checks with those
settings lives beside it: `build.py` (the model, the loss, the optimizer every role builds the same way),
`inputs.py` (the expensive checks of the dataset, before any cluster work), `loading.py` (its YAML form and
pydantic's refusals in our words).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal, Self

import fsspec
import pydantic
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..data.fields import MODEL_LOSS, StepFields
from ..data.sources import SourceInfo
from ..errors import JobConfigError
from .build import (
    LOSSES,
    OPTIMIZERS,
    LossFn,
    StateLayout,
    build_model,
    check_optimizer_options,
    splits_tensors,
    state_layout,
)
from .inputs import check_dataset
from .limits import (
    AT_LEAST_ONE,
    IMPORT_PATH,
    IMPORT_PATHS_OF,
    JOB_ID,
    NON_NEGATIVE_OPTIONS,
    POSITIVE_SECONDS,
    TORCH_SEED_RANGE,
    is_non_negative,
    is_number,
    options_by_protocol,
)
from .loading import config_error, read_settings, yaml_of
from .specs import CheckpointSpec, LoopSpec, ModelSpec, RoleSpecs, ShardSpec

__all__ = ["ElasticJob"]


def _default_optimizer() -> dict[str, Any]:
    return {"name": "sgd", "lr": 0.05}


class ElasticJob(BaseModel):
    """Every setting of one elastic training job; building one with an impossible value raises
    `JobConfigError` naming the field and the value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    dataset: str
    loss: str = "cross_entropy"
    optimizer: dict[str, Any] = Field(default_factory=_default_optimizer)
    batch_size: int = 32
    micro_batches: int = 4
    epochs: int = 1
    data_servers: int = 2
    liveness_interval: float = 1.0
    min_workers: int = 1
    min_workers_timeout: float = 60.0
    threads_per_worker: int = 1
    # What a loss costs in sync mode: `reassign` trains the step in flight again, `rollback` (the classic
    # rule) every step since the last snapshot. Both end with the same parameters; `reassign` loses less.
    on_membership_change: Literal["rollback", "reassign"] = "reassign"
    seed: int = 0
    job_id: str = "prefect-elastic"
    call_timeout: float = 30.0
    static_resource: str = "static"
    checkpoint: str | None = None  # fsspec URL of a folder for persistent checkpoints; None: none
    checkpoint_every: int = 10  # snapshots between two checkpoints (one is always written at the end)
    checkpoint_keep: int = 3  # checkpoints kept; older ones are pruned
    # Checkpoint writes that may fail in a row (a full disk, a folder made read-only, storage refusing
    # writes): each is a warning and a `checkpoint-failed` event, and training goes on from the in-memory
    # snapshots, writing again at the next checkpoint. One more ends the job with `CheckpointWriteError`,
    # which holds the final parameters. 0: the first failure ends it.
    checkpoint_failures_allowed: int = 3
    # fsspec options by protocol for `dataset` and `checkpoint`, in the shape of fsspec's own configuration:
    # {"s3": {"endpoint_url": "http://minio:9000"}}. They travel with the job to every process that opens
    # the storage (the controller, the data servers on static workers). Secrets are better left to the
    # environment of those processes (docs/storage.md): the job is logged and shown as flow parameters.
    storage_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Copy every data server's snapshots to the next data server's memory, so a standby static worker can
    # take a lost data server's role (docs/design/standby.md). Off: less memory on static workers, and a
    # lost data server ends the job (unless nothing was trained since the start).
    peer_replicas: bool = True
    # "sync": a step sums M micro-batches and every shard applies it at one step boundary (bitwise
    # reproducible). "async": every shard applies each micro-batch's gradient as it arrives, a worker never
    # waits for the others, and a gradient computed on parameters more than `max_staleness` versions old is
    # refused and trained again (see docs/design/async.md). With `checkpoint`, every shard pauses for a
    # snapshot every `checkpoint_every` survival checks, each written.
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 8
    # Parameters are spread over as many data servers as can each hold at least this many bytes of the
    # model's state (at least one, at most `data_servers`); the others hold a partition and no parameters.
    # Every data server that holds parameters adds its answer to the critical path of every step, which
    # costs more than it saves on a small model (docs/design/commit-point.md, "Which data servers hold
    # parameters"). 0 spreads them over every data server.
    min_shard_bytes: int = 16 * 2**20
    # A tensor larger than a data server's share is split across data servers (contiguous ranges of its
    # elements: `sharding.plan_pieces`), so each data server holding parameters carries about an equal
    # part of the bytes and of the optimizer's work. None: split whenever the optimizer updates
    # elementwise (every built-in one does: `job.build.ELEMENTWISE_OPTIMIZERS`); True under another is
    # refused; False keeps every tensor whole. The trained numbers are the same either way.
    split_tensors: bool | None = None
    # Sync mode: each micro-batch's gradients leave for the shards bucket by bucket while backward still
    # runs, and each shard sums them as they come; the step commits when every micro-batch is sealed, as
    # before (docs/design/overlapped-step.md). The trained numbers are the same either way. None: on from
    # 16 MiB of parameters (below, the extra frames cost more than the overlap saves), unless a machine
    # runs loops and data servers on too few cores (`bucket_push.cores_short`; `overlap_pull=True` keeps it).
    overlap_push: bool | None = None
    # Sync mode: the next step's parameters come back in buckets, each module's forward waiting for its
    # own. None: where they cross a socket (a loop on the shard's machine reads them in place); True: from
    # every shard. Same numbers either way; what pulls whole: docs/design/overlapped-step.md.
    overlap_pull: bool | None = None
    # On a GPU, the kernels that give a micro-batch's gradient the same bits on every worker (cuDNN's
    # deterministic algorithms, cuBLAS's fixed workspace), the premise of the bitwise guarantee. False
    # trades that guarantee for the fastest kernels (cuDNN's autotuner, atomics that sum in any order):
    # every batch id still trains once, but a run with a failure no longer gives the bits of one without
    # (docs/guide.md, "Bitwise, or the fastest kernels"). Nothing changes on a CPU, whose kernels give
    # the same bits either way.
    deterministic: bool = True
    # The data (docs/guide.md, "Your data"): the field(s) the model takes (a list: as keywords) and the
    # loss takes (None: `x` and `y`, or a tuple item's first two); `collate`: an import path.
    inputs: str | list[str] | None = None
    target: str | None = None
    collate: str | None = None
    # Where batches are made (read `prefetch_batches` ahead): "data_servers", or "compute_workers" (each its
    # own share, in a process of its own, so that decoding grows with the workers); None: the compute
    # workers where a user's code runs per sample (a Dataset factory, a `collate`), else the data servers
    # (docs/design/data-pipeline.md).
    data_pipeline: Literal["data_servers", "compute_workers"] | None = None
    prefetch_batches: int = 4
    data_cache_bytes: int = 256 * 2**20  # the source's blocks a reader keeps in memory at most
    # None: "blocks" for Parquet and Arrow on an object store (samples shuffled within `shuffle_window`
    # blocks of rows in a random order), else "samples".
    shuffle: Literal["samples", "blocks"] | None = None
    shuffle_window: int = 8

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            # pydantic's ValidationError is not ours and its text is generic; users catch JobConfigError.
            raise config_error(exc, tuple(type(self).model_fields)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, *args, **kwargs)
        except pydantic.ValidationError as exc:
            raise config_error(exc, tuple(cls.model_fields)) from None

    # ---- cheap checks, run at construction -------------------------------------------------------------

    @field_validator(
        "batch_size",
        "micro_batches",
        "epochs",
        "data_servers",
        "threads_per_worker",
        "min_workers",
        "seed",
        "liveness_interval",
        "min_workers_timeout",
        "call_timeout",
        "max_staleness",
        "min_shard_bytes",
        "checkpoint_failures_allowed",
        "prefetch_batches",
        "data_cache_bytes",
        "shuffle_window",
        mode="before",
    )
    @classmethod
    def _no_bool(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would quietly take True as 1, which is never what a config meant.
        if isinstance(value, bool):
            raise ValueError(f"must be a number, not a boolean; write the {info.field_name} you want")
        return value

    @field_validator(*AT_LEAST_ONE, mode="after")
    @classmethod
    def _at_least_one(cls, value: int, info: ValidationInfo) -> int:
        name = info.field_name or ""
        if value < 1:
            raise ValueError(f"must be at least 1 ({AT_LEAST_ONE[name]})")
        return value

    @field_validator(*POSITIVE_SECONDS, mode="after")
    @classmethod
    def _positive_seconds(cls, value: float, info: ValidationInfo) -> float:
        name = info.field_name or ""
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be a positive, finite number of seconds ({POSITIVE_SECONDS[name]})")
        return value

    @field_validator("call_timeout", mode="after")
    @classmethod
    def _call_timeout_floor(cls, value: float) -> float:
        # Workers long-poll the coordinator for 0.5 s; a shorter bound would turn every wait into an error.
        if value < 1.0:
            raise ValueError("must be at least 1 second (workers wait up to 0.5 s for work in one call)")
        return value

    @field_validator("max_staleness", mode="after")
    @classmethod
    def _staleness_floor(cls, value: int) -> int:
        if value < 0:
            raise ValueError(
                "must be 0 or more (in async mode, how many versions a shard may have moved on since the "
                "parameters a gradient was computed on; 0 refuses every gradient a faster worker overtook)"
            )
        return value

    @field_validator("checkpoint_failures_allowed", mode="after")
    @classmethod
    def _failures_floor(cls, value: int) -> int:
        if value < 0:
            raise ValueError(
                "must be 0 or more (checkpoint writes that may fail in a row before the job stops; 0 stops "
                "it at the first failure)"
            )
        return value

    @field_validator("min_shard_bytes", mode="after")
    @classmethod
    def _shard_bytes_floor(cls, value: int) -> int:
        if value < 0:
            raise ValueError(
                "must be 0 or more (the fewest bytes of the model's state a data server holding parameters "
                "gets; 0 spreads the parameters over every data server)"
            )
        return value

    @field_validator("seed", mode="after")
    @classmethod
    def _seed_in_range(cls, value: int) -> int:
        lo, hi = TORCH_SEED_RANGE
        if not lo <= value <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], the range torch.manual_seed accepts")
        return value

    @field_validator("job_id", mode="after")
    @classmethod
    def _job_id_pattern(cls, value: str) -> str:
        if not JOB_ID.fullmatch(value):
            raise ValueError(
                "must be 1 to 64 characters, each a letter, a digit, '-', '_' or '.'; roles register under "
                "it, so pick a short name such as 'mnist-run-1'"
            )
        return value

    @field_validator("static_resource", mode="after")
    @classmethod
    def _static_resource_name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "must name the Dask resource of static workers (e.g. 'static' for "
                "`dask worker ADDR --resources static=1`)"
            )
        return value

    @field_validator("dataset", mode="after")
    @classmethod
    def _dataset_given(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "must be the fsspec URL of a .npz file or of a directory of .npz shards, "
                "e.g. file:///data/train.npz or s3://bucket/train/"
            )
        return value

    @field_validator("storage_options", mode="before")
    @classmethod
    def _storage_by_protocol(cls, value: Any) -> Any:
        # Before pydantic's own check, whose "Input should be a valid dictionary" would not say that the
        # options go under a protocol, which is the usual mistake.
        return options_by_protocol(value)

    @field_validator("model", "collate", mode="after")
    @classmethod
    def _import_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not IMPORT_PATH.fullmatch(value):
            raise ValueError(
                "must be an import path 'module:callable' (e.g. 'my_project.models:make_net') of a "
                + IMPORT_PATHS_OF[str(info.field_name)]
            )
        return value

    @field_validator("loss", mode="after")
    @classmethod
    def _loss_name(cls, value: str) -> str:
        if value not in LOSSES and value != MODEL_LOSS and not IMPORT_PATH.fullmatch(value):
            raise ValueError(
                f"must be one of {', '.join(repr(n) for n in LOSSES)}, 'model' (the model returns its own "
                "loss) or an import path 'module:callable' of a function (output, target) -> scalar tensor"
            )
        return value

    @field_validator("prefetch_batches", "data_cache_bytes", mode="after")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must not be negative (0: none)")
        return value

    @field_validator("optimizer", mode="after")
    @classmethod
    def _optimizer_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        options = dict(value)
        name = options.pop("name", None)
        choices = ", ".join(repr(n) for n in OPTIMIZERS)
        if name not in OPTIMIZERS:
            shown = "no 'name'" if name is None else f"name {name!r}"
            raise ValueError(
                f"has {shown}; set 'name' to one of {choices} (these work elementwise, so a parameter shard "
                "gets the same numbers as the whole model), plus that optimizer's keyword arguments"
            )
        for key in NON_NEGATIVE_OPTIONS:
            if key in options and not is_non_negative(options[key]):
                raise ValueError(f"{key}={options[key]!r} must be a non-negative number")
        if "betas" in options:
            betas = options["betas"]
            if (
                not isinstance(betas, (list, tuple))
                or len(betas) != 2
                or not all(is_number(b) and 0 <= b < 1 for b in betas)
            ):
                raise ValueError(f"betas={betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
            # YAML gives a list; torch wants a tuple, and the dict must compare equal after a round trip.
            options["betas"] = tuple(betas)
        try:
            check_optimizer_options(OPTIMIZERS[name], options)
        except (TypeError, ValueError, RuntimeError) as exc:
            # A TypeError would escape pydantic unwrapped, so turn every refusal into a ValueError.
            raise ValueError(
                f"torch.optim.{OPTIMIZERS[name].__name__} refused these options ({exc}); give only "
                "keyword arguments that it accepts"
            ) from exc
        return {"name": name, **options}

    @field_validator("split_tensors", mode="after")
    @classmethod
    def _split_elementwise(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        optimizer = info.data.get("optimizer")
        if optimizer is not None:
            try:
                splits_tensors(OPTIMIZERS[optimizer["name"]], value)
            except JobConfigError as exc:
                raise ValueError(exc.problem) from None
        return value

    @property
    def splits(self) -> bool:
        """Whether tensors larger than a data server's share are split (`split_tensors`, decided)."""
        return splits_tensors(OPTIMIZERS[self.optimizer["name"]], self.split_tensors)

    # ---- YAML --------------------------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ElasticJob:
        """The job described by the YAML mapping in the file at `path`."""
        file = Path(path)
        data = read_settings(file, tuple(cls.model_fields))
        try:
            return cls(**data)
        except JobConfigError as exc:
            raise JobConfigError(exc.field, exc.value, f"{exc.problem} (in {file})") from None

    def to_yaml(self) -> str:
        """The job as a YAML mapping that `from_yaml` reads back to an equal job."""
        return yaml_of(self.model_dump())

    # ---- what every role builds from the job -------------------------------------------------------------

    def make_model(self) -> torch.nn.Module:
        """A fresh model from the `model` import path."""
        return build_model(self.model)

    def storage_for(self, url: str) -> dict[str, Any]:
        """The fsspec keyword arguments for opening `url`: `storage_options` of its protocol, or all of
        them, keyed by protocol, for a chained URL (`simplecache::s3://...`, which fsspec splits itself)."""
        if "::" in url:
            return {protocol: dict(options) for protocol, options in self.storage_options.items()}
        protocol, _ = fsspec.core.split_protocol(url)
        return dict(self.storage_options.get(protocol or "file", {}))

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fields that decide the trained parameters: a checkpoint only resumes a job that agrees on
        all of them. (Workers, timeouts, the policy and the job id do not change the result.)"""
        keys = ("model", "dataset", "loss", "optimizer", "batch_size", "micro_batches", "epochs")
        # (The data's settings where given: a checkpoint of a job before them resumes with their defaults.)
        data = {k: getattr(self, k) for k in ("inputs", "target", "collate", "shuffle") if getattr(self, k)}
        # (`data_servers` decides which batch ids each partition serves. A checkpoint holds whole tensors,
        # so which data server held which of them does not matter: `min_shard_bytes` and `split_tensors`
        # may change on a resume, except in async mode, where each shard resumes at a version of its own
        # (`Persistence.shard_start` checks that its pieces are the ones it held).)
        return {**{k: getattr(self, k) for k in (*keys, "data_servers", "seed")}, **data}

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers before training (its `state_dict`); the same for a seed."""
        return self.initial_model().state_dict()

    def initial_model(self) -> torch.nn.Module:
        """The model as built for the job's seed, on the CPU (`ModelSpec.initial_model`)."""
        return self.model_spec.initial_model()

    def initial_tensors(self) -> tuple[StateLayout, dict[str, torch.Tensor]]:
        """The layout of the model's state, and the tensors the servers hold (no alias twice)."""
        model = self.initial_model()
        layout = state_layout(model)
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        tensors = {n: named[n].detach().clone().contiguous() for n in (*layout.params, *layout.buffers)}
        return layout, tensors

    def loss_fn(self) -> LossFn | None:
        """The loss function named by `loss` (None: the model computes its own)."""
        return self.model_spec.loss_fn()

    def build_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer named by `optimizer`, over `params` (the whole model or one shard's slice)."""
        return self.model_spec.build_optimizer(params)

    # ---- each role's slice of the job (`specs.py`) ------------------------------------------------------

    @property
    def model_spec(self) -> ModelSpec:
        """What builds the model, the loss and the optimizer, in every role."""
        return ModelSpec(self.model, self.seed, self.loss, dict(self.optimizer))

    @property
    def shard_spec(self) -> ShardSpec:
        """A data server's settings."""
        return ShardSpec(
            self.job_id, self.model_spec, self.call_timeout, self.max_staleness, self.peer_replicas
        )

    @property
    def loop_spec(self) -> LoopSpec:
        """A compute loop's settings."""
        return LoopSpec(
            self.job_id,
            self.model_spec,
            self.call_timeout,
            self.liveness_interval,
            self.threads_per_worker,
            self.micro_batches,
            self.overlap_push,
            self.deterministic,
            self.overlap_pull,
        )

    @property
    def checkpoint_spec(self) -> CheckpointSpec:
        """The checkpoint writer's settings."""
        return CheckpointSpec(
            self.job_id,
            self.checkpoint,
            self.checkpoint_keep,
            self.storage_for(self.checkpoint) if self.checkpoint else {},
            self.checkpoint_every,
            self.checkpoint_failures_allowed,
            self.fingerprint_fields(),
            min_shard_bytes=self.min_shard_bytes,
        )

    @property
    def role_specs(self) -> RoleSpecs:
        """Every role's settings, made once when the job is prepared."""
        return RoleSpecs(self.shard_spec, self.loop_spec, self.checkpoint_spec)

    def check_inputs(self) -> tuple[SourceInfo, StepFields]:
        """The expensive checks, run once before any cluster work: model, loss, dataset, the fields a step
        takes from it, and whether the loss takes its targets (where the source's schema says their dtype)."""
        # (Built as every model here is, under the lock: a constructor's draws from torch's global generator
        # in one thread changed another job's initial parameters, built at the same moment in another.)
        self.initial_model()
        self.loss_fn()
        storage = self.storage_for(self.dataset)
        return check_dataset(
            self.dataset, storage, self.loss, self.data_servers, self.batch_size, self.inputs, self.target
        )
