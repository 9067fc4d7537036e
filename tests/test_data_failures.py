"""Bad data found only while training: a sample deep in a user's Dataset whose `__getitem__` raises (a
truncated image), or whose item torch's collate cannot batch with its neighbours' (another shape, a
string). The job's check of its first samples passes (`prepare.batch_spec`); the sample is found when its
batch is made, in a data server's reader thread or in a compute worker's batch maker. Either way the job
ends with a `TrainingFailedError` that names the batch id and the sample, and says to look at that sample,
with the steps before it committed: no hang, no retry for ever."""

from __future__ import annotations

import time

import pytest

from prefect_elastic import TrainingFailedError, train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, MembershipEvent, Progress
from prefect_elastic.training.prepare import prepare

from .conftest import make_job, top_up
from .sources_factories import BAD_SAMPLE

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# factory -> the words of the failure the message carries
BAD_DATA = {
    "truncated": "image file is truncated",
    "mis_shapen": "shape",
    "worded": "str",
}


def bad_batch(job: object) -> tuple[int, int]:
    """The step and batch id where the job first meets `BAD_SAMPLE`."""
    schedule = prepare(job).schedule  # type: ignore[arg-type]
    for step in range(schedule.total_steps):
        for batch_id in schedule.step_batches(step):
            if BAD_SAMPLE in {int(i) for i in schedule.samples(batch_id)[1]}:
                return step, batch_id
    raise AssertionError(f"sample {BAD_SAMPLE} is in no batch")


# A sample that does not read and one that does not collate, on each pipeline; a string among tensors, and
# async mode, where batches cost least to make (a compute worker's batch maker takes seconds to start).
CASES = [
    ("truncated", "data_servers", "sync"),
    ("truncated", "compute_workers", "sync"),
    ("mis_shapen", "data_servers", "sync"),
    ("mis_shapen", "compute_workers", "sync"),
    ("worded", "data_servers", "sync"),
    ("truncated", "data_servers", "async"),
]


@pytest.mark.parametrize(("factory", "pipeline", "mode"), CASES)
def test_a_bad_sample_found_while_training_fails_the_job_naming_batch_and_sample(
    cluster: LocalElasticCluster, factory: str, pipeline: str, mode: str
) -> None:
    top_up(cluster, 2)
    job = make_job(
        f"tests.sources_factories:{factory}",
        "reassign",
        model="tests.sources_factories:pairs_classifier",
        optimizer={"name": "sgd", "lr": 0.1},
        batch_size=4,
        micro_batches=2,
        epochs=1,
        data_pipeline=pipeline,
        mode=mode,
        job_id=f"bad-data-{factory}-{pipeline}-{mode}",
        # (A worker excluded for the data's fault would leave fewer than min_workers: a wait, and the wrong
        # error.)
        min_workers=2,
    )
    prepared = prepare(job)
    assert prepared.dataset.kind == "factory"
    assert prepared.batches.on_compute == (pipeline == "compute_workers")
    step, batch_id = bad_batch(job)
    assert step > 0, "the first batch's first samples are good: the job's check passes"
    committed: list[int] = []
    events: list[MembershipEvent] = []

    def seen(progress: Progress) -> None:
        committed.append(progress.committed_steps)

    began = time.monotonic()
    with pytest.raises(TrainingFailedError) as err:
        train(job, cluster=cluster, on_progress=seen, on_event=events.append)
    took = time.monotonic() - began
    message = str(err.value)
    assert f"sample {BAD_SAMPLE} of batch {batch_id}" in message, message
    assert BAD_DATA[factory] in message, message
    assert "look at" in message, f"the message says what to do: {message}"
    assert err.value.step == step and err.value.batch_id == batch_id, message
    # The data is at fault, not a node: made again on any worker, the batch would fail again. No worker is
    # excluded, no membership changes, nothing is tried again: the job fails at once.
    kinds = {e.kind for e in events}
    quiet = {EventKind.START, EventKind.SNAPSHOT, EventKind.FAILED}
    assert kinds <= quiet, [(e.kind, e.reason) for e in events]  # (FAILED may come after the end)
    assert committed, "it trained before"
    if mode == "sync":  # (the steps before the bad batch's were committed, none after it)
        assert max(committed) <= step, (committed, step)
    assert took < job.min_workers_timeout, f"no wait for workers: it took {took:.0f} s"
