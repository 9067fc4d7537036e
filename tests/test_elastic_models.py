"""Models unlike the tests' MLP on real processes, with workers killed and added: BatchNorm buffers, tied
weights and dropout over shards that hold little, and a language model on token sequences. Each ends
bitwise equal to the one-worker, no-fault run."""

from __future__ import annotations

import pytest
import torch

from prefect_elastic import train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule

from .conftest import References, make_job, top_up
from .test_elastic import check_run

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_batchnorm_buffers_stay_equal(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    top_up(cluster, 2)
    job = make_job(digits_url, "rollback", model="tests.models:cnn_bn", epochs=2, job_id="bn")
    faults = FaultSchedule(seed=6).kill_worker(at_step=6).add_worker(at_step=7)
    result = train(job, cluster=cluster, faults=faults)
    expected = reference(job)
    check_run(result, expected, "rollback")
    buffers = [k for k in result.state_dict if "running_" in k or "num_batches_tracked" in k]
    assert buffers, "the model has BatchNorm buffers"
    assert int(result.state_dict[buffers[-1]]) == result.total_steps, "a step counts once"
    initial = job.initial_state()
    assert not all(ts_equal(result.state_dict[k], initial[k]) for k in buffers), "running stats moved"


def test_tied_weights_dropout_and_tiny_shards(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Tied weights are trained once, dropout draws per batch id, and a shard may hold very little."""
    top_up(cluster, 2)
    job = make_job(digits_url, "reassign", model="tests.models:tied_dropout", data_servers=4, job_id="tied")
    faults = FaultSchedule(seed=7).kill_worker(at_step=5).add_worker(at_step=6)
    result = train(job, cluster=cluster, faults=faults)
    expected = reference(job)
    check_run(result, expected, "reassign")
    assert result.state_dict["again.weight"] is result.state_dict["hidden.weight"], "exported tied"
    initial = job.initial_state()
    assert not torch.equal(result.state_dict["hidden.weight"], initial["hidden.weight"]), (
        "the tied weight trained"
    )
    assert "scale" not in result.state_dict


def test_a_language_model_on_token_sequences(
    cluster: LocalElasticCluster, reference: References, tokens_url: str
) -> None:
    """A model unlike the digits ones, as a user brings it: integer token inputs, an embedding, a
    two-layer LSTM with dropout, LayerNorm, an output layer tied to the embedding and a loss of the user's
    own over (N, T) targets. A worker killed mid-run still leaves the one-worker run's bits."""
    top_up(cluster, 2)
    job = make_job(
        tokens_url, "rollback", model="tests.models:char_lm", loss="tests.models:sequence_loss",
        batch_size=16, epochs=2, job_id="lm",
    )  # fmt: skip
    faults = FaultSchedule(seed=8).kill_worker(at_step=5)
    result = train(job, cluster=cluster, faults=faults)
    expected = reference(job)
    check_run(result, expected, "rollback")
    assert result.state_dict["out.weight"] is result.state_dict["embed.weight"], "exported tied"
    assert result.history[-1] < result.history[0], "the loss fell"


def ts_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return torch.equal(a, b)
