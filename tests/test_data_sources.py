"""The data users have, on real processes, with a compute worker SIGKILLed and one added: the digits as
Parquet, token lists of varying length in a `datasets` folder given to a text classifier as keywords
(padded by the user's collate, the model's own loss), and an image folder of PNGs decoded with Pillow and
augmented at random per sample by a user's Dataset. Each run ends bitwise equal to the one-worker, no-fault
run, every batch id once, in sync mode under either policy and in async mode."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefect_elastic import ElasticJob, train
from prefect_elastic.data.batches import BatchMaker
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.training.prepare import prepare

from .conftest import References, in_process_servers, make_job, top_up
from .data_helpers import write_digits_parquet, write_tokens_folder
from .test_elastic import check_run

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def parquet_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_digits_parquet(tmp_path_factory.mktemp("parquet"))


@pytest.fixture(scope="module")
def tokens_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tokens_folder(tmp_path_factory.mktemp("tokens") / "train")


def parquet_job(url: str, policy: str, **overrides: object) -> ElasticJob:
    return make_job(
        url, policy, model="tests.data_helpers:digits_flat_mlp", job_id=f"pq-{policy}", **overrides
    )


def text_job(folder: str, policy: str, **overrides: object) -> ElasticJob:
    fields: dict[str, object] = {
        "model": "tests.data_helpers:text_classifier",
        "inputs": ["input_ids", "attention_mask"],
        "target": "label",
        "loss": "model",
        "collate": "tests.data_helpers:pad_batch",
        "job_id": f"text-{policy}",
        **overrides,
    }
    return make_job(folder, policy, **fields)


def image_job(policy: str, **overrides: object) -> ElasticJob:
    fields: dict[str, object] = {
        "model": "tests.data_helpers:image_cnn",
        "job_id": f"img-{policy}",
        **overrides,
    }
    return make_job("tests.data_helpers:images", policy, **fields)


def run_with_faults(cluster: LocalElasticCluster, job: ElasticJob, seed: int) -> object:
    top_up(cluster, 2)
    faults = FaultSchedule(seed=seed).kill_worker(at_step=4).add_worker(at_step=5)
    return train(job, cluster=cluster, faults=faults)


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_parquet_with_a_worker_killed_and_one_added(
    cluster: LocalElasticCluster, reference: References, parquet_url: str, policy: str
) -> None:
    job = parquet_job(parquet_url, policy)
    assert prepare(job).dataset.kind == "parquet" and not prepare(job).batches.on_compute
    result = run_with_faults(cluster, job, seed=11)
    check_run(result, reference(job), policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_a_text_classifier_on_a_datasets_folder_with_keyword_inputs_and_its_own_loss(
    cluster: LocalElasticCluster, reference: References, tokens_folder: str, policy: str
) -> None:
    job = text_job(tokens_folder, policy)
    prepared = prepare(job)
    assert prepared.dataset.kind == "datasets" and prepared.batches.on_compute, "a collate: the workers'"
    result = run_with_faults(cluster, job, seed=12)
    check_run(result, reference(job), policy)  # type: ignore[arg-type]
    assert result.history[-1] < result.history[0], "the loss fell"  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_an_image_folder_augmented_at_random_per_sample(
    cluster: LocalElasticCluster, reference: References, policy: str
) -> None:
    job = image_job(policy)
    prepared = prepare(job)
    assert prepared.dataset.kind == "factory" and prepared.batches.on_compute, "a factory: the workers'"
    result = run_with_faults(cluster, job, seed=13)
    check_run(result, reference(job), policy)  # type: ignore[arg-type]
    assert result.history[0] == plain_first_loss(job), "the first step's loss is a plain loop's"  # type: ignore[attr-defined]


def plain_first_loss(job: ElasticJob) -> float:
    """The mean loss of the first step's micro-batches, as a plain loop in this process computes it on the
    initial model and the batches read here."""
    prepared = prepare(job)
    model, maker = job.initial_model(), BatchMaker(prepared.batches)
    losses = []
    with torch.no_grad():
        for b in prepared.schedule.step_batches(0):
            batch = maker.make(b)
            losses.append(float(torch.nn.functional.cross_entropy(model(batch["0"]), batch["1"])))
    return sum(losses) / len(losses)


def test_data_servers_reading_side_by_side_serve_what_one_reader_makes() -> None:
    """Two data servers of one process read augmented samples in their reader threads at once (each builds
    its Dataset as it first reads): every batch has the bits a lone reader makes. (Building a Dataset
    seeded the global generators without the lock: a crop drawn meanwhile by the other changed.)"""
    job = image_job("reassign")
    prepared = prepare(job)
    servers, _ = in_process_servers(job.dataset, model=job.model)
    lone = BatchMaker(prepared.batches)

    async def served() -> dict[int, dict[str, torch.Tensor]]:
        made = {}
        for b in range(3 * prepared.schedule.micro_batches):
            server = servers[prepared.schedule.server_of(b)]
            made[b] = await server.partition.get_batch(server.shard.generation, b)
        return made

    for b, batch in asyncio.run(served()).items():
        assert all(torch.equal(batch[k], t) for k, t in lone.make(b).items()), f"batch {b} differs"
    for server in servers:
        server.partition.close()


def test_the_augmentation_draws_per_sample_and_epoch_the_same_anywhere() -> None:
    """A sample's random crop and flip depend on (seed, epoch, index) only: the same whichever maker, in
    whichever order the samples are read; another epoch draws another crop."""
    spec = prepare(image_job("reassign")).batches
    one, other = BatchMaker(spec), BatchMaker(spec)
    first = one.of_samples(0, 0, [5, 9, 17])
    torch.rand(100)  # (whatever this process drew before does not matter)
    again = other.of_samples(0, 0, [17, 9, 5])
    assert torch.equal(first["0"], again["0"].flip(0))
    next_epoch = one.of_samples(0, 1, [5, 9, 17])
    assert not torch.equal(first["0"], next_epoch["0"]), "each epoch draws anew"
    assert torch.equal(first["1"], next_epoch["1"]), "the labels do not change"


@pytest.mark.parametrize("source", ["parquet", "text", "images"])
def test_async_mode_trains_on_each_source(
    cluster: LocalElasticCluster, parquet_url: str, tokens_folder: str, source: str
) -> None:
    overrides = {"mode": "async", "on_membership_change": "reassign"}
    job = {
        "parquet": lambda: parquet_job(parquet_url, "reassign", **overrides),
        "text": lambda: text_job(tokens_folder, "reassign", **overrides),
        "images": lambda: image_job("reassign", **overrides),
    }[source]()
    top_up(cluster, 2)
    result = train(job, cluster=cluster, faults=FaultSchedule(seed=14).kill_worker(at_step=3))
    ids = sorted(e.batch_id for e in result.ledger)
    assert ids == list(range(result.total_batches)), "every batch id of the schedule, each once"
    assert max(e.staleness for e in result.ledger) <= job.max_staleness
    assert result.counters["rollbacks"] == 0 and len(result.history) == result.total_batches
    tenth = max(1, len(result.history) // 10)
    assert sum(result.history[-tenth:]) < sum(result.history[:tenth]), "the loss fell"


@pytest.mark.parametrize(("source", "policy"), [("text", "rollback"), ("images", "reassign")])
def test_the_pipeline_may_move_to_the_data_servers_with_a_worker_killed_and_one_added(
    cluster: LocalElasticCluster, reference: References, tokens_folder: str, source: str, policy: str
) -> None:
    """A user's Dataset and collate run in the data servers' reader threads where the job asks: the same
    bits as the compute workers' batch makers give, through a kill and a join (where a joined worker,
    whose batch maker takes a second or two to start, falls behind and catches up, at the last step too:
    `stragglers.catch_up`)."""
    made = text_job(tokens_folder, policy) if source == "text" else image_job(policy)
    served = made.model_copy(update={"data_pipeline": "data_servers", "job_id": f"{source}-served"})
    assert not prepare(served).batches.on_compute and prepare(made).batches.on_compute
    top_up(cluster, 2)
    faults = FaultSchedule(seed=12).kill_worker(at_step=4).add_worker(at_step=6)
    result = train(served, cluster=cluster, faults=faults)
    check_run(result, reference(made), policy)
