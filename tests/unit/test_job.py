"""The job blueprint: every impossible value is a JobConfigError naming the field and the value. (Its model,
loss and initial state, and its input checks: test_job_inputs.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prefect_elastic.errors import JobConfigError
from prefect_elastic.job import ElasticJob

from ..conftest import make_job

MLP = "tests.models:mlp"
UNREAD = "file:///data/train.npz"  # a dataset URL that only the checks of check_inputs would open


def _refused(field: str, value: Any, *words: str, **overrides: Any) -> JobConfigError:
    with pytest.raises(JobConfigError) as caught:
        make_job(UNREAD, **{field: value}, **overrides)
    return _check(caught.value, field, value, *words)


def _check(err: JobConfigError, field: str, value: Any, *words: str) -> JobConfigError:
    assert isinstance(err, ValueError)
    assert err.field == field
    message = str(err)
    assert message.startswith(f"{field}="), message
    assert repr(value)[:150] in message, message
    for word in words:
        assert word in message, message
    return err


def test_defaults() -> None:
    job = ElasticJob(model=MLP, dataset=UNREAD)
    assert job.loss == "cross_entropy"
    assert job.optimizer == {"name": "sgd", "lr": 0.05}
    assert (job.batch_size, job.micro_batches, job.epochs, job.data_servers) == (32, 4, 1, 2)
    assert (job.liveness_interval, job.min_workers, job.min_workers_timeout) == (1.0, 1, 60.0)
    assert job.threads_per_worker == 1
    assert job.on_membership_change == "reassign"
    assert job.overlap_push is None  # (on for a model of 16 MiB or more)
    assert job.seed == 0
    assert job.job_id == "prefect-elastic"
    assert job.call_timeout == 30.0
    assert job.static_resource == "static"
    # The default optimizer dict is not shared between jobs.
    assert ElasticJob(model=MLP, dataset=UNREAD).optimizer is not job.optimizer


def test_frozen() -> None:
    job = make_job(UNREAD)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type is not part of our API
        job.batch_size = 3


def test_data_servers_zero_reads_well() -> None:
    err = _refused("data_servers", 0)
    assert str(err) == (
        "data_servers=0: must be at least 1 (each data server holds one data partition, and a share of a "
        "big model's parameters)"
    )


@pytest.mark.parametrize(
    "field", ["batch_size", "micro_batches", "epochs", "data_servers", "threads_per_worker", "min_workers"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_counts_must_be_positive(field: str, value: int) -> None:
    _refused(field, value, "at least 1")


@pytest.mark.parametrize("field", ["liveness_interval", "min_workers_timeout", "call_timeout"])
@pytest.mark.parametrize("value", [0, -1.5, float("inf"), float("nan")])
def test_seconds_must_be_positive(field: str, value: float) -> None:
    _refused(field, value, "positive")


@pytest.mark.parametrize("field", ["batch_size", "epochs", "call_timeout"])
def test_booleans_refused(field: str) -> None:
    _refused(field, True, "boolean")


def test_checkpoint_failures_allowed() -> None:
    """A few checkpoint writes may fail in a row by default; 0 ends the job at the first; a negative count
    or a boolean is refused. It does not decide the result: a checkpoint resumes a job that changed it."""
    assert ElasticJob(model=MLP, dataset=UNREAD).checkpoint_failures_allowed == 3
    assert make_job(UNREAD, checkpoint_failures_allowed=0).checkpoint_failures_allowed == 0
    _refused("checkpoint_failures_allowed", -1, "0 or more", "in a row")
    _refused("checkpoint_failures_allowed", True, "boolean")
    assert "checkpoint_failures_allowed" not in make_job(UNREAD).fingerprint_fields()


def test_wrong_type_named() -> None:
    _refused("batch_size", "many", "integer")


def test_several_errors_reported_together() -> None:
    err = _refused("batch_size", 0, "at least 1", epochs=0)
    assert "epochs=0" in str(err)


def test_unknown_field_refused() -> None:
    err = _refused("batchsize", 32, "not a setting", "batch_size")
    assert "batchsize" in str(err)


def test_missing_model() -> None:
    with pytest.raises(JobConfigError) as caught:
        ElasticJob(dataset="file:///x.npz")
    assert caught.value.field == "model"
    assert "required" in str(caught.value)


def test_model_validate_raises_our_error() -> None:
    with pytest.raises(JobConfigError, match="micro_batches=0"):
        ElasticJob.model_validate({"model": MLP, "dataset": "d", "micro_batches": 0})


def test_on_membership_change_choices() -> None:
    assert make_job(UNREAD, on_membership_change="reassign").on_membership_change == "reassign"
    _refused("on_membership_change", "restart", "rollback", "reassign")


@pytest.mark.parametrize("job_id", ["", "has space", "slash/no", "x" * 65, "ümlaut"])
def test_job_id_pattern(job_id: str) -> None:
    _refused("job_id", job_id, "letter")


def test_job_id_accepts_allowed_characters() -> None:
    assert make_job(UNREAD, job_id="Run_1.a-b").job_id == "Run_1.a-b"
    assert make_job(UNREAD, job_id="x" * 64).job_id == "x" * 64


@pytest.mark.parametrize("value", ["", "   "])
def test_dataset_must_be_given(value: str) -> None:
    _refused("dataset", value, "URL")


@pytest.mark.parametrize("value", ["tests.models.mlp", "tests.models:", ":mlp", "a b:c"])
def test_model_must_be_import_path(value: str) -> None:
    _refused("model", value, "module:callable")


def test_loss_names() -> None:
    assert make_job(UNREAD, loss="mse").loss == "mse"
    assert make_job(UNREAD, loss="torch.nn.functional:l1_loss").loss == "torch.nn.functional:l1_loss"
    _refused("loss", "hinge", "cross_entropy", "mse", "module:callable")


def test_seed_range() -> None:
    _refused("seed", 2**64, "torch.manual_seed")


# ---- optimizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "sgd"},
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
        {"name": "adam", "lr": 1e-3, "betas": [0.9, 0.99]},
        {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8},
    ],
)
def test_optimizer_accepted(optimizer: dict[str, Any]) -> None:
    job = make_job(UNREAD, optimizer=optimizer)
    opt = job.build_optimizer([torch.nn.Parameter(torch.zeros(3))])
    assert type(opt).__name__.lower() == optimizer["name"]


@pytest.mark.parametrize(
    ("optimizer", "words"),
    [
        ({"lr": 0.1}, ["no 'name'", "sgd", "adam"]),
        ({"name": "lbfgs"}, ["'lbfgs'", "adamw"]),
        ({"name": "sgd", "lr": -0.1}, ["lr=-0.1", "non-negative"]),
        ({"name": "sgd", "momentum": -1}, ["momentum=-1"]),
        ({"name": "adamw", "weight_decay": -0.5}, ["weight_decay=-0.5"]),
        ({"name": "adam", "betas": [0.9, 1.0]}, ["betas", "[0, 1)"]),
        ({"name": "adam", "betas": [0.9]}, ["betas"]),
        ({"name": "sgd", "lr": "fast"}, ["lr='fast'"]),
        ({"name": "sgd", "lr": 0.1, "momentun": 0.9}, ["momentun", "SGD"]),
        ({"name": "sgd", "lr": 0.1, "nesterov": True}, ["Nesterov"]),
    ],
)
def test_optimizer_refused(optimizer: dict[str, Any], words: list[str]) -> None:
    _refused("optimizer", optimizer, *words)


def test_optimizer_options_are_checked_without_importing_torch_dynamo() -> None:
    """Checking a job's optimizer runs the optimizer's own checks but builds none: a built one imports
    torch._dynamo (1.7 s of CPU) in the process that prepares the job, which never steps an optimizer."""
    code = (
        "import sys; from prefect_elastic.job import ElasticJob; "
        "ElasticJob(job_id='j', model='m:f', dataset='file:///tmp/x', "
        "optimizer={'name': 'adamw', 'lr': 0.01, 'betas': [0.9, 0.99], 'fused': False}); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_build_optimizer_steps_params() -> None:
    job = make_job(UNREAD, optimizer={"name": "sgd", "lr": 0.5})
    param = torch.nn.Parameter(torch.ones(2))
    opt = job.build_optimizer([param])
    param.grad = torch.ones(2)
    opt.step()
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


# ---- YAML --------------------------------------------------------------------------------------------------


def test_yaml_round_trip(tmp_path: Path) -> None:
    job = make_job(
        UNREAD,
        optimizer={"name": "adam", "lr": 0.01, "betas": (0.8, 0.9)},
        batch_size=16,
        liveness_interval=0.25,
        on_membership_change="reassign",
        job_id="run.7",
        seed=123,
    )
    path = tmp_path / "job.yaml"
    path.write_text(job.to_yaml())
    again = ElasticJob.from_yaml(path)
    assert again == job
    assert again.to_yaml() == job.to_yaml()


def test_from_yaml_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {MLP}\ndataset: file:///d.npz\nlearning_rate: 0.1\n")
    with pytest.raises(JobConfigError) as caught:
        ElasticJob.from_yaml(path)
    _check(caught.value, "learning_rate", 0.1, str(path), "optimizer")


def test_from_yaml_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(JobConfigError) as caught:
        ElasticJob.from_yaml(path)
    _check(caught.value, "config", str(path), "no such file")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""])
def test_from_yaml_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobConfigError) as caught:
        ElasticJob.from_yaml(path)
    _check(caught.value, "config", str(path), "mapping")


def test_from_yaml_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(JobConfigError) as caught:
        ElasticJob.from_yaml(path)
    _check(caught.value, "config", str(path), "not valid YAML")


def test_from_yaml_bad_value_names_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {MLP}\ndataset: file:///d.npz\ndata_servers: 0\n")
    with pytest.raises(JobConfigError) as caught:
        ElasticJob.from_yaml(path)
    _check(caught.value, "data_servers", 0, "at least 1", str(path))
