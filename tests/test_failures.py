"""Bad input gets a clear error before any cluster work; failures during training end the job with an
error that names the step and batch, never a hang."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_elastic import (
    FatalError,
    JobConfigError,
    NotEnoughWorkersError,
    TrainingFailedError,
    train,
)
from prefect_elastic.compute import MicroBatchTrainer
from prefect_elastic.dataset import write_npz
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind
from prefect_elastic.wire.signals import ModelFailure

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job, top_up

# Nothing listens here: a test that reaches the cluster would fail with a connection error instead.
NOWHERE = "tcp://127.0.0.1:9"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("data_servers", 0, "at least 1"),
        ("optimizer", {"name": "sgd", "lr": -0.1}, "lr"),
        ("batch_size", -3, "batch_size=-3"),
        ("liveness_interval", 0, "liveness_interval=0"),
    ],
)
def test_impossible_values_name_field_and_value(
    digits_url: str, field: str, value: object, words: str
) -> None:
    with pytest.raises(JobConfigError) as err:
        make_job(digits_url, **{field: value})
    assert err.value.field == field
    assert words in str(err.value)


def test_model_path_that_does_not_import_fails_before_cluster_work(digits_url: str) -> None:
    with pytest.raises(JobConfigError, match="no_such_module") as err:
        train(make_job(digits_url, model="no_such_module:make"), address=NOWHERE)
    assert err.value.field == "model"


def test_model_that_is_not_a_module(digits_url: str) -> None:
    with pytest.raises(JobConfigError, match="not_a_module") as err:
        train(make_job(digits_url, model="tests.models:not_a_module"), address=NOWHERE)
    assert err.value.field == "model"


def test_dataset_without_data(tmp_path: Path, digits_url: str) -> None:
    (tmp_path / "empty").mkdir()
    url = f"file://{tmp_path}/empty"
    with pytest.raises(JobConfigError, match="empty") as err:
        train(make_job(digits_url, dataset=url), address=NOWHERE)
    assert err.value.field == "dataset" and url in str(err.value)


def test_dataset_with_x_and_y_of_different_lengths(tmp_path: Path, digits_url: str) -> None:
    path = tmp_path / "bad.npz"
    write_npz(str(path), np.zeros((10, 1, 8, 8), np.float32), np.zeros(9, np.int64))
    with pytest.raises(JobConfigError, match="10") as err:
        train(make_job(digits_url, dataset=str(path)), address=NOWHERE)
    assert err.value.field == "dataset" and "9" in str(err.value)


def test_targets_of_the_wrong_dtype_for_the_loss_fail_before_cluster_work(tmp_path: Path) -> None:
    # Float class numbers given to cross_entropy: the .npz header says so, no cluster needs to find it.
    path = tmp_path / "float-targets.npz"
    write_npz(str(path), np.zeros((64, 1, 8, 8), np.float32), np.arange(64, dtype=np.float32) % 10)
    with pytest.raises(JobConfigError, match="float32") as err:
        train(make_job(str(path)), address=NOWHERE)
    assert err.value.field == "loss"


def test_batch_larger_than_a_partition(digits_url: str) -> None:
    with pytest.raises(JobConfigError) as err:
        train(make_job(digits_url, batch_size=5000), address=NOWHERE)
    assert "5000" in str(err.value)


def test_nothing_listening_at_the_address_fails_at_once_naming_it(digits_url: str) -> None:
    with pytest.raises(FatalError, match=f"no Dask scheduler answers at {NOWHERE}"):
        train(make_job(digits_url), address=NOWHERE)


def test_a_cluster_that_is_not_a_cluster_is_refused_naming_the_argument(digits_url: str) -> None:
    with pytest.raises(JobConfigError, match="cluster=42: not a Dask cluster object"):
        train(make_job(digits_url), cluster=42)


def test_compute_worker_holds_no_parameters(digits_url: str) -> None:
    """Invariant 3: the compute worker's model has shapes only; values come from each pull."""
    j = make_job(digits_url, model="tests.models:cnn_bn")
    layout, tensors = j.initial_tensors()
    trainer = MicroBatchTrainer(j.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    assert all(t.is_meta for t in trainer.model.state_dict().values())
    state = j.initial_state()
    params = {n: state[n].clone().requires_grad_(True) for n in trainer.param_names}
    buffers = {n: t for n, t in state.items() if n not in params}
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    _loss, grads, new_buffers = trainer.gradient(params, buffers, {"x": x, "y": y}, step=0, batch_id=0)
    assert all(t.is_meta for t in trainer.model.state_dict().values()), "nothing was kept after the step"
    # The same gradient as an ordinary model holding those parameters.
    torch.manual_seed(0)
    ordinary = j.make_model()
    ordinary.load_state_dict(state)
    torch.nn.functional.cross_entropy(ordinary(x), y).backward()
    for name, p in ordinary.named_parameters():
        assert torch.allclose(grads[name], p.grad)
    assert not torch.equal(new_buffers["1.running_mean"], buffers["1.running_mean"])
    assert torch.equal(buffers["1.running_mean"], state["1.running_mean"]), "pulled buffers untouched"


def test_a_model_that_changes_its_parameters_in_place_is_refused_naming_them(digits_url: str) -> None:
    """A compute worker holds no parameters between steps, and on a CPU worker the pulled parameters are
    the shard's own memory (`wire/published.py`): a change in place is lost or corrupts the shard. It fails
    the micro-batch with a message that names the parameter and what to do instead."""
    j = make_job(digits_url, model="tests.models:clamps_in_place")
    layout, tensors = j.initial_tensors()
    trainer = MicroBatchTrainer(j.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    state = j.initial_state()
    params = {n: state[n].clone().requires_grad_(True) for n in trainer.param_names}
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    with pytest.raises(
        ModelFailure, match=r"changed its parameters \['1.weight'\] in place at step 3, batch 5"
    ):
        trainer.gradient(params, {}, {"x": x, "y": y}, step=3, batch_id=5)


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("model", "words"), [("tests.models:raises", "boom from the model"), ("tests.models:nan_model", "nan")]
)
def test_model_failure_ends_job_naming_step_and_batch(
    cluster: LocalElasticCluster, digits_url: str, model: str, words: str
) -> None:
    top_up(cluster, 2)
    with pytest.raises(TrainingFailedError) as err:
        # A scheduler address where a cluster object goes is taken as distributed.Client takes it.
        train(make_job(digits_url, model=model, job_id="failing"), cluster=cluster.scheduler_address)
    assert words in str(err.value)
    assert err.value.step == 0 and err.value.batch_id is not None
    assert f"batch {err.value.batch_id}" in str(err.value)


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_a_worker_whose_model_fails_is_excluded_and_training_goes_on(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    """One bad node (Horovod's host blacklist): the model raises on one compute worker only. That worker is
    excluded, its share goes to the other, the batch it failed on trains there, and the result is still
    bitwise equal to the one-worker, no-fault run."""
    from .models import BAD_WORKER

    top_up(cluster, 2)
    bad = sorted(cluster.elastic_addresses())[0]
    job = make_job(digits_url, policy, model="tests.models:fails_on_one_worker", job_id=f"bad-node-{policy}")
    BAD_WORKER.write_text(bad)
    try:
        result = train(job, cluster=cluster)
    finally:
        BAD_WORKER.unlink(missing_ok=True)
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    [excluded] = [e for e in result.events if e.kind == EventKind.EXCLUDED]
    assert excluded.left == (bad,) and "illegal memory access" in excluded.reason, excluded
    assert result.counters["excluded"] == 1
    after = [e for e in result.membership_events() if e.time >= excluded.time]
    assert after and bad in after[0].left and bad not in after[-1].workers, "its share went to the other"
    assert bad not in {e.worker for e in result.ledger if e.generation > excluded.generation}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_batch_that_fails_on_every_worker_fails_the_job_naming_them(
    cluster: LocalElasticCluster, digits_url: str
) -> None:
    """The same batch failing on two workers is the model's or the data's fault, not a node's: the job
    fails, naming the step, the batch and both workers."""
    top_up(cluster, 2)
    with pytest.raises(TrainingFailedError) as err:
        train(make_job(digits_url, model="tests.models:raises", job_id="bad-model"), cluster=cluster)
    message = str(err.value)
    assert "boom from the model" in message and f"batch {err.value.batch_id}" in message
    named = [w for w in cluster.elastic_addresses() if w in message]
    assert len(named) >= 2, f"both workers it failed on are named: {message}"


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_too_few_workers_fails_after_timeout(cluster: LocalElasticCluster, digits_url: str) -> None:
    top_up(cluster, 1)
    n = len(cluster.elastic_addresses())
    with pytest.raises(NotEnoughWorkersError, match=f"min_workers={n + 5}"):
        train(
            make_job(
                digits_url,
                min_workers=n + 5,
                min_workers_timeout=2.0,
                liveness_interval=0.5,
                job_id="starved",
            ),
            cluster=cluster,
        )


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_two_jobs_share_a_cluster(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    top_up(cluster, 2)
    jobs = [
        make_job(digits_url, model="tests.models:slow_mlp", job_id="job-a", seed=1, epochs=1),
        make_job(digits_url, model="tests.models:cnn_bn", job_id="job-b", seed=2, epochs=1,
            optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}),
    ]  # fmt: skip
    expected = [reference(j) for j in jobs]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = train(jobs[i], cluster=cluster)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    for i in range(2):
        result = results[i]
        assert not isinstance(result, BaseException), result
        assert_same_parameters(result, expected[i])  # type: ignore[arg-type]
        assert_ledger_exactly_once(result)  # type: ignore[arg-type]


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_same_job_id_twice_is_refused(cluster: LocalElasticCluster, digits_url: str) -> None:
    top_up(cluster, 1)
    j = make_job(digits_url, model="tests.models:slow_mlp", job_id="only-once", epochs=3)
    errors: list[BaseException] = []
    started = threading.Event()

    def first() -> None:
        try:
            train(j, cluster=cluster, on_progress=lambda p: started.set())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(60)
    with pytest.raises(FatalError, match="already training"):
        train(j, cluster=cluster)
    t.join(120)
    assert not errors
