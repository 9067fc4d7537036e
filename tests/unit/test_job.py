"""The job blueprint: every impossible value is a JobConfigError naming the field and the value."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefect_elastic.dataset import write_npz
from prefect_elastic.errors import JobConfigError
from prefect_elastic.job import ElasticJob, resolve_callable

from ..conftest import make_job

MLP = "tests.models:mlp"
UNREAD = "file:///data/train.npz"  # a dataset URL that only the checks of check_inputs would open


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    x = np.random.default_rng(0).random((100, 1, 8, 8), dtype=np.float32)
    y = np.arange(100, dtype=np.int64) % 10
    path = tmp_path / "data.npz"
    write_npz(str(path), x, y)
    return str(path)


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


# ---- model, loss, initial state ----------------------------------------------------------------------------


def test_make_model() -> None:
    model = make_job(UNREAD, model="tests.models:cnn_bn").make_model()
    assert isinstance(model, torch.nn.Module)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("tests.no_such_module:mlp", ["'tests.no_such_module'", "not found", "PYTHONPATH"]),
        ("tests.models:no_such_factory", ["no attribute 'no_such_factory'"]),
        ("tests.models:mlp.deeper", ["'tests.models:mlp'", "no attribute 'deeper'"]),
        ("tests.unit.test_job:MLP", ["str", "not callable"]),
        ("tests.models:not_a_module", ["returned int", "42", "torch.nn.Module"]),
        ("prefect_elastic.errors:JobConfigError", ["raised TypeError"]),
    ],
)
def test_make_model_errors(path: str, words: list[str]) -> None:
    job = make_job(UNREAD, model=path)
    with pytest.raises(JobConfigError) as caught:
        job.make_model()
    _check(caught.value, "model", path, *words)


def test_model_import_that_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_models_for_test.py").write_text("raise ImportError('cannot import torchvision')\n")
    (tmp_path / "needs_dep_for_test.py").write_text("import some_absent_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("broken_models_for_test", "needs_dep_for_test"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(JobConfigError) as caught:
        make_job(UNREAD, model="broken_models_for_test:make").make_model()
    _check(caught.value, "model", "broken_models_for_test:make", "raised ImportError", "torchvision")
    with pytest.raises(JobConfigError) as caught:
        make_job(UNREAD, model="needs_dep_for_test:make").make_model()
    _check(caught.value, "model", "needs_dep_for_test:make", "some_absent_dependency_xyz", "not installed")


def test_resolve_callable() -> None:
    assert resolve_callable("tests.models:mlp", "model").__name__ == "mlp"
    assert resolve_callable("torch.nn:Linear", "model") is torch.nn.Linear
    with pytest.raises(JobConfigError) as caught:
        resolve_callable("nocolon", "loss")
    _check(caught.value, "loss", "nocolon", "module:callable")


def test_loss_fn() -> None:
    out, target = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    assert torch.equal(
        make_job(UNREAD).loss_fn()(out, target), torch.nn.functional.cross_entropy(out, target)
    )
    assert make_job(UNREAD, loss="mse").loss_fn() is torch.nn.functional.mse_loss
    assert make_job(UNREAD, loss="torch.nn.functional:l1_loss").loss_fn() is torch.nn.functional.l1_loss
    with pytest.raises(JobConfigError) as caught:
        make_job(UNREAD, loss="torch.nn.functional:no_such_loss").loss_fn()
    _check(caught.value, "loss", "torch.nn.functional:no_such_loss", "no attribute")


def test_initial_state_deterministic() -> None:
    a = make_job(UNREAD, model="tests.models:cnn_bn", seed=7).initial_state()
    b = make_job(UNREAD, model="tests.models:cnn_bn", seed=7).initial_state()
    c = make_job(UNREAD, model="tests.models:cnn_bn", seed=8).initial_state()
    assert list(a) == list(b) == list(c)
    assert any("running_mean" in key for key in a)  # buffers travel with the parameters
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    for tensor in a.values():
        assert tensor.device.type == "cpu"
        assert tensor.is_contiguous()
        assert not tensor.requires_grad


def test_initial_state_leaves_global_rng_alone() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    make_job(UNREAD, seed=99).initial_state()
    assert torch.equal(torch.rand(3), expected)


# ---- check_inputs ------------------------------------------------------------------------------------------


def test_check_inputs_ok(dataset: str) -> None:
    info = make_job(dataset, batch_size=50, data_servers=2).check_inputs()
    assert info.total == 100


def test_check_inputs_batch_larger_than_partition(dataset: str) -> None:
    with pytest.raises(JobConfigError) as caught:
        make_job(dataset, batch_size=51, data_servers=2).check_inputs()
    _check(caught.value, "batch_size", 51, "100 samples", "data_servers=2", "50")


def test_check_inputs_empty_partition(tmp_path: Path) -> None:
    path = tmp_path / "tiny.npz"
    write_npz(str(path), np.zeros((2, 1, 8, 8), dtype=np.float32), np.zeros(2, dtype=np.int64))
    with pytest.raises(JobConfigError) as caught:
        make_job(str(path), batch_size=1, data_servers=3).check_inputs()
    _check(caught.value, "data_servers", 3, "2 samples", "batch_size=1")


def test_check_inputs_bad_model_before_dataset(dataset: str) -> None:
    with pytest.raises(JobConfigError) as caught:
        make_job(dataset, model="tests.models:not_a_module").check_inputs()
    assert caught.value.field == "model"


def test_check_inputs_bad_loss(dataset: str) -> None:
    with pytest.raises(JobConfigError) as caught:
        make_job(dataset, loss="tests.models:absent_loss").check_inputs()
    assert caught.value.field == "loss"


def test_check_inputs_missing_dataset(tmp_path: Path) -> None:
    url = str(tmp_path / "absent")
    with pytest.raises(JobConfigError) as caught:
        make_job(url).check_inputs()
    _check(caught.value, "dataset", url, "does not exist")


def _targets(tmp_path: Path, y: np.ndarray) -> str:
    path = tmp_path / f"targets-{y.dtype}-{y.ndim}.npz"
    write_npz(str(path), np.zeros((len(y), 1, 8, 8), dtype=np.float32), y)
    return str(path)


def test_check_inputs_float_targets_with_cross_entropy(tmp_path: Path) -> None:
    url = _targets(tmp_path, np.arange(100, dtype=np.float32) % 10)
    with pytest.raises(JobConfigError) as caught:
        make_job(url, loss="cross_entropy").check_inputs()
    _check(caught.value, "loss", "cross_entropy", "float32", "one value per sample", "loss='mse'", "int64")


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.bool_])
def test_check_inputs_integer_targets_torch_cannot_index_with(tmp_path: Path, dtype: type) -> None:
    url = _targets(tmp_path, (np.arange(100) % 2).astype(dtype))
    with pytest.raises(JobConfigError) as caught:
        make_job(url, loss="cross_entropy").check_inputs()
    _check(caught.value, "dataset", url, np.dtype(dtype).name, "astype(numpy.int64)")


@pytest.mark.parametrize("dtype", [np.int64, np.uint8])
def test_check_inputs_integer_targets_with_mse(tmp_path: Path, dtype: type) -> None:
    url = _targets(tmp_path, (np.arange(100) % 10).astype(dtype))
    with pytest.raises(JobConfigError) as caught:
        make_job(url, loss="mse").check_inputs()
    _check(caught.value, "loss", "mse", np.dtype(dtype).name, "loss='cross_entropy'", "float32")


@pytest.mark.parametrize(
    ("loss", "y"),
    [
        ("cross_entropy", np.arange(100, dtype=np.int64) % 10),
        ("cross_entropy", (np.arange(100) % 10).astype(np.uint8)),
        ("cross_entropy", np.full((100, 10), 0.1, dtype=np.float32)),  # class probabilities
        ("mse", np.zeros((100, 10), dtype=np.float32)),
        ("mse", np.zeros((100, 10), dtype=np.float64)),
        # A loss given by import path is not checked: it may take any targets.
        ("torch.nn.functional:cross_entropy", np.zeros(100, dtype=np.float32)),
        ("torch.nn.functional:mse_loss", np.zeros(100, dtype=np.int64)),
    ],
)
def test_check_inputs_targets_the_loss_takes(tmp_path: Path, loss: str, y: np.ndarray) -> None:
    assert make_job(_targets(tmp_path, y), loss=loss).check_inputs().y_dtype == y.dtype.str


def test_initial_state_is_the_same_when_jobs_start_from_threads(tmp_path: Path) -> None:
    """Two controllers in one process build their models at once; each must get its seed's parameters."""
    import threading

    from prefect_elastic.dataset import digits_dataset

    url = digits_dataset(str(tmp_path))
    jobs = [ElasticJob(model="tests.models:cnn_bn", dataset=url, seed=s) for s in (1, 2)] * 4
    solo = [j.initial_state() for j in jobs]
    results: dict[int, dict[str, torch.Tensor]] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i].initial_state())) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        assert all(torch.equal(results[i][k], solo[i][k]) for k in solo[i])


def test_a_model_checked_in_one_thread_leaves_another_threads_initial_parameters_alone(
    digits_url: str,
) -> None:
    """Two jobs started from threads of one process (two flows in one worker; the controllers of
    `test_two_jobs_share_a_cluster`): one job's input check builds its model while the other job's
    initial parameters are being drawn. Every model is built under one lock, so the second job's draws
    cannot land in the middle of the first's. (Before, the check built its model outside the lock, the
    first job's parameters depended on timing, and its run and its reference run differed.)"""
    from ..models import PAUSE_IN_CONSTRUCTOR, PAUSED

    paused = make_job(digits_url, model="tests.models:pausing_mlp", seed=5)
    other = make_job(digits_url, model="tests.models:mlp", seed=6)
    _, alone = paused.initial_tensors()
    checked: list[BaseException | None] = []

    def check_the_other_while_paused() -> None:
        PAUSED.wait(10)
        try:
            other.check_inputs()  # builds its model: draws from torch's generator
            checked.append(None)
        except BaseException as exc:
            checked.append(exc)

    PAUSE_IN_CONSTRUCTOR.set()
    thread = threading.Thread(target=check_the_other_while_paused)
    thread.start()
    try:
        _, raced = paused.initial_tensors()  # pauses inside the constructor, between two layers' draws
    finally:
        PAUSE_IN_CONSTRUCTOR.clear()
        thread.join(30)
        PAUSED.clear()
    assert checked == [None]
    assert alone.keys() == raced.keys()
    assert all(torch.equal(alone[n], raced[n]) for n in alone), "the same seed gave the same parameters"
