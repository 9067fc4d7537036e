"""The job's model, loss and initial state, and its input checks (`check_inputs`): what cannot be built or
read is a JobConfigError naming the field and the value."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_elastic.dataset import write_npz
from prefect_elastic.errors import JobConfigError
from prefect_elastic.job import ElasticJob, resolve_callable

from ..conftest import make_job
from .test_job import UNREAD, _check


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    x = np.random.default_rng(0).random((100, 1, 8, 8), dtype=np.float32)
    y = np.arange(100, dtype=np.int64) % 10
    path = tmp_path / "data.npz"
    write_npz(str(path), x, y)
    return str(path)


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
    info, fields = make_job(dataset, batch_size=50, data_servers=2).check_inputs()
    assert info.length == 100 and info.kind == "npz" and fields.used == ("x", "y")


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
    info, _ = make_job(_targets(tmp_path, y), loss=loss).check_inputs()
    assert info.field("y") is not None and info.field("y").dtype == y.dtype.str  # type: ignore[union-attr]


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
