"""Gradients that leave bucket by bucket during backward (`ElasticJob.overlap_push`), on a real cluster: the
shards sum the parts as they come and commit at the seals, so a run gives the parameters of the whole-push
run bit for bit, with workers killed and joining, and every batch id once (docs/design/overlapped-step.md).
"""

from __future__ import annotations

import pytest

from prefect_elastic import train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    make_job,
    top_up,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
POLICIES = ["rollback", "reassign"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_run_whose_gradients_leave_during_backward_gives_the_whole_push_runs_parameters(
    cluster: LocalElasticCluster, reference: References, digits_url: str, policy: str
) -> None:
    top_up(cluster, 2)
    job = make_job(digits_url, policy, overlap_push=True, job_id=f"overlap-{policy}")
    faults = FaultSchedule(seed=3).kill_worker(at_step=8).add_worker(at_step=12)
    result = train(job, cluster=cluster, faults=faults)
    assert [r.kind for r in faults.log] == ["kill", "add"]
    assert_same_parameters(result, reference(job.model_copy(update={"overlap_push": False})))
    assert_ledger_exactly_once(result)
    # Every step's gradients went in parts, a bucket or more to each of the 2 shards (the loops that lived
    # to the end say so).
    assert result.loops and all(loop.parts >= 2 * loop.steps > 0 for loop in result.loops), result.loops
