"""Each role's slice of the job (`job/specs.py`), without a cluster: every field comes from the job's
setting of that name, a spec crosses a process whole and cannot be changed, and the `ModelSpec` builds
the very model, loss and optimizer the job builds."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from prefect_elastic.job import CheckpointSpec, ElasticJob, LoopSpec, ModelSpec, RoleSpecs, ShardSpec
from prefect_elastic.training import prepare

from ..conftest import make_job

# Where each field of a spec comes from in the job: a field added to a spec without saying so fails here.
FROM_THE_JOB: dict[type, dict[str, Any]] = {
    ModelSpec: {
        "model": lambda j: j.model,
        "seed": lambda j: j.seed,
        "loss": lambda j: j.loss,
        "optimizer": lambda j: j.optimizer,
    },
    ShardSpec: {
        "job_id": lambda j: j.job_id,
        "model_spec": lambda j: j.model_spec,
        "call_timeout": lambda j: j.call_timeout,
        "max_staleness": lambda j: j.max_staleness,
        "peer_replicas": lambda j: j.peer_replicas,
    },
    LoopSpec: {
        "job_id": lambda j: j.job_id,
        "model_spec": lambda j: j.model_spec,
        "call_timeout": lambda j: j.call_timeout,
        "liveness_interval": lambda j: j.liveness_interval,
        "threads_per_worker": lambda j: j.threads_per_worker,
        "micro_batches": lambda j: j.micro_batches,
        "overlap_push": lambda j: j.overlap_push,
        "deterministic": lambda j: j.deterministic,
        "overlap_pull": lambda j: j.overlap_pull,
    },
    CheckpointSpec: {
        "job_id": lambda j: j.job_id,
        "url": lambda j: j.checkpoint,
        "keep": lambda j: j.checkpoint_keep,
        "storage_options": lambda j: j.storage_for(j.checkpoint),
        "every": lambda j: j.checkpoint_every,
        "failures_allowed": lambda j: j.checkpoint_failures_allowed,
        "fingerprint_fields": lambda j: j.fingerprint_fields(),
        "min_shard_bytes": lambda j: j.min_shard_bytes,
    },
}


def unusual_job(tmp_path: Path) -> ElasticJob:
    """A job whose every setting a spec carries differs from its default, so that a field taken from the
    wrong setting (or a default) shows."""
    return ElasticJob(
        model="tests.models:tied_dropout",
        dataset="file:///data/train.npz",
        loss="mse",
        optimizer={"name": "adam", "lr": 0.003, "betas": [0.8, 0.9]},
        micro_batches=3,
        liveness_interval=0.7,
        threads_per_worker=2,
        seed=41,
        job_id="specs-1",
        call_timeout=12.0,
        checkpoint=f"file://{tmp_path}/ckpt",
        checkpoint_every=5,
        checkpoint_keep=7,
        checkpoint_failures_allowed=1,
        storage_options={"file": {"auto_mkdir": True}, "s3": {"endpoint_url": "http://127.0.0.1:9000"}},
        peer_replicas=False,
        mode="async",
        max_staleness=2,
        overlap_push=True,  # (refused when the job is prepared: async mode pushes whole)
        deterministic=False,
        overlap_pull=False,
    )


def specs_of(job: ElasticJob) -> dict[type, Any]:
    specs = job.role_specs
    return {
        ModelSpec: job.model_spec,
        ShardSpec: specs.shard,
        LoopSpec: specs.loop,
        CheckpointSpec: specs.checkpoint,
    }


def test_every_field_of_a_spec_is_the_jobs_setting(tmp_path: Path) -> None:
    job = unusual_job(tmp_path)
    for kind, spec in specs_of(job).items():
        sources = FROM_THE_JOB[kind]
        assert {f.name for f in dataclasses.fields(kind)} == set(sources), kind.__name__
        for name, source in sources.items():
            assert getattr(spec, name) == source(job), f"{kind.__name__}.{name}"
    checkpoint = job.checkpoint_spec
    assert checkpoint.storage_options == {"auto_mkdir": True}, "the options of the checkpoint's protocol only"
    assert job.model_spec.optimizer["betas"] == (0.8, 0.9)


def test_a_job_without_checkpoints_gives_a_spec_with_no_url() -> None:
    spec = ElasticJob(model="tests.models:mlp", dataset="file:///data/train.npz").checkpoint_spec
    assert spec.url is None and spec.storage_options == {}


def test_a_spec_crosses_a_process_whole(tmp_path: Path) -> None:
    specs = unusual_job(tmp_path).role_specs
    again = pickle.loads(pickle.dumps(specs))
    assert isinstance(again, RoleSpecs) and again == specs
    assert again.loop.model_spec == specs.shard.model_spec


def test_a_spec_refuses_assignment(tmp_path: Path) -> None:
    for spec in specs_of(unusual_job(tmp_path)).values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.job_id = "another"  # (ModelSpec has none: refused all the same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        unusual_job(tmp_path).role_specs.shard = unusual_job(tmp_path).shard_spec


@pytest.mark.parametrize("model", ["tests.models:tied_dropout", "tests.models:cnn_bn", "tests.models:mlp"])
def test_the_model_specs_initial_model_is_bitwise_the_jobs(model: str) -> None:
    job = ElasticJob(model=model, dataset="file:///data/train.npz", seed=7)
    ours, theirs = job.model_spec.initial_model().state_dict(), job.initial_model().state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    # The seed decides it, and the caller's own random stream is left where it was (fork_rng).
    other = ElasticJob(model=model, dataset="file:///data/train.npz", seed=8).model_spec.initial_model()
    params = [k for k, _ in other.named_parameters()]
    assert any(not torch.equal(other.state_dict()[k], ours[k]) for k in params)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    job.model_spec.initial_model()
    assert torch.equal(torch.rand(3), expected)


def test_the_model_specs_loss_and_optimizer_are_the_jobs(tmp_path: Path) -> None:
    job = unusual_job(tmp_path)
    spec = job.model_spec
    assert spec.loss_fn() is job.loss_fn() is torch.nn.functional.mse_loss
    params = [torch.ones(3, requires_grad=True)]
    built = spec.build_optimizer(params)
    assert isinstance(built, torch.optim.Adam)
    assert built.defaults == job.build_optimizer([torch.ones(3, requires_grad=True)]).defaults
    assert built.defaults["lr"] == 0.003 and built.defaults["betas"] == (0.8, 0.9)


def test_a_prepared_job_carries_its_specs_and_its_checkpoint_writer_holds_its_own(
    digits_url: str, tmp_path: Path
) -> None:
    job = make_job(digits_url, checkpoint=f"file://{tmp_path}/ckpt")
    prepared = prepare(job)
    assert prepared.specs == job.role_specs
    assert prepared.persistence.spec is prepared.specs.checkpoint
    assert prepared.persistence.store is not None and prepared.persistence.store.url.endswith("ckpt")
