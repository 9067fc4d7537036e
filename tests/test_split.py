"""Tensors split across data servers (`plan_pieces`, `ElasticJob.split_tensors`) on real processes: a
layer split over 2 or 3 data servers trains to the very bits it trains to whole on one, with a worker
killed mid-run (either policy, and async mode), a data server promoted on a standby, and a checkpoint
(whole tensors, a plain state_dict) resumed with the model on another number of data servers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from prefect_elastic import ElasticJob, TrainingStopped, TrainResult, train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job, top_up
from .models import GATE
from .test_async import async_job, check_async
from .test_elastic import POLICIES, check_run
from .test_static_roles import KillWhenSnapshotted, top_up_static

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

WIDE = "tests.wide_models:wide_mlp"
BIG = "1.weight"  # the layer of 64 x 1024 elements
WIDE_BYTES = 76_810 * 4
ONE_HOLDER = 1 << 40  # `min_shard_bytes` past the model's bytes: all of it, whole, on the last data server


def wide_job(digits_url: str, policy: str = "rollback", **overrides: object) -> ElasticJob:
    fields: dict[str, object] = {"model": WIDE, "job_id": f"split-{policy}", **overrides}
    return make_job(digits_url, policy, **fields)


def holders_of(result: TrainResult, name: str) -> list[int]:
    return [i for i, names in enumerate(result.shard_plan) if name in names]


def test_a_layer_split_over_2_and_3_data_servers_trains_to_the_bits_of_it_whole_on_one(
    reference: References, digits_url: str
) -> None:
    # 3 data servers serve the data in every run (which batch lives where is the same); the parameters
    # lie whole on the last, split over the last two, or split over all three.
    whole = reference(wide_job(digits_url, data_servers=3, min_shard_bytes=ONE_HOLDER))
    over_two = reference(wide_job(digits_url, data_servers=3, min_shard_bytes=WIDE_BYTES // 2))
    over_three = reference(wide_job(digits_url, data_servers=3, min_shard_bytes=0))
    unsplit = reference(wide_job(digits_url, data_servers=3, min_shard_bytes=0, split_tensors=False))
    assert holders_of(whole, BIG) == [2] and [bool(n) for n in whole.shard_plan] == [False, False, True]
    assert holders_of(over_two, BIG) == [1, 2]
    assert holders_of(over_three, BIG) == [0, 1, 2]
    assert len(holders_of(unsplit, BIG)) == 1
    for result in (over_two, over_three, unsplit):
        assert_same_parameters(result, whole)
        assert result.history == whole.history
        assert_ledger_exactly_once(result)
        # The result is whole tensors, of the model's shapes.
        assert result.state_dict[BIG].shape == (1024, 64)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_worker_killed_mid_run_with_a_layer_split_over_two(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    top_up(cluster, 2)
    job = wide_job(digits_url, policy, min_shard_bytes=0)
    faults = FaultSchedule(seed=1).kill_worker(at_step=8)
    result = train(job, cluster=cluster, faults=faults)
    assert holders_of(result, BIG) == [0, 1]
    check_run(result, reference(job), policy)
    assert faults.log and faults.log[0].kind == "kill"


def test_async_mode_with_a_layer_split_over_two_and_a_kill(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    top_up(cluster, 2)
    job = async_job(digits_url, model=WIDE, epochs=3, min_shard_bytes=0, job_id="split-async")
    first = cluster.elastic_addresses()[0]
    faults = FaultSchedule(seed=3).kill_worker(at_step=60, worker=first)
    result = train(job, cluster=cluster, faults=faults)
    assert holders_of(result, BIG) == [0, 1]
    assert [r.kind for r in faults.log] == ["kill"]
    check_async(result, reference(wide_job(digits_url, epochs=3, min_shard_bytes=0)))


def test_a_data_server_holding_part_of_a_layer_is_promoted_on_a_standby(
    reference: References, digits_url: str
) -> None:
    with LocalElasticCluster(static_workers=3, elastic_workers=2) as cluster:
        top_up_static(cluster, 3)
        job = wide_job(digits_url, "reassign", epochs=4, min_shard_bytes=0, job_id="split-standby")
        kill = KillWhenSnapshotted(cluster, index=1)
        try:
            result = train(job, cluster=cluster, on_progress=kill)
        finally:
            GATE.unlink(missing_ok=True)
    assert holders_of(result, BIG) == [0, 1] and len(kill.killed) == 1
    assert result.counters["promotions"] == 1
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)


def test_a_checkpoint_of_split_tensors_is_whole_and_resumes_on_another_number_of_data_servers(
    cluster: LocalElasticCluster, reference: References, digits_url: str, tmp_path: Path
) -> None:
    top_up(cluster, 2)
    folder = {"checkpoint": f"file://{tmp_path}/ckpt", "checkpoint_every": 2, "liveness_interval": 0.3}
    split = wide_job(digits_url, min_shard_bytes=0, job_id="split-ckpt", **folder)
    stop = threading.Event()
    with pytest.raises(TrainingStopped) as stopped:
        train(split, cluster=cluster, stop=stop, on_progress=lambda p: p.committed_steps >= 15 and stop.set())
    written = stopped.value.checkpoint
    assert written is not None and os.path.exists(written)
    # A plain state_dict of whole tensors, whichever data servers held which part of them.
    payload = torch.load(written, weights_only=True)
    model = split.initial_model()
    assert {n: t.shape for n, t in payload["tensors"].items()} == {
        n: t.shape for n, t in model.state_dict().items()
    }
    model.load_state_dict(payload["tensors"])
    assert payload["optimizer"]["state"][BIG]["exp_avg"].shape == (1024, 64)
    # Resumed with the whole model on one data server: the same bits as the run that was never stopped.
    whole = split.model_copy(update={"min_shard_bytes": ONE_HOLDER})
    result = train(whole, cluster=cluster)
    assert result.resumed_from == written
    assert [bool(n) for n in result.shard_plan] == [False, True]
    assert_same_parameters(result, reference(split))
    assert_ledger_exactly_once(result)
    assert result.history == reference(split).history
