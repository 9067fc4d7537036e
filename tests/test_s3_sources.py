"""The data sources of tests/test_data_sources.py on the local S3 server of tests/test_s3.py, trained on real
processes with a compute worker SIGKILLed and one added: the digits as Parquet (row groups of 100 rows) and
the token lists as a `datasets` folder (record batches of 100 rows), uploaded byte for byte. On an object
store both are shuffled by blocks (a row group, a record batch: `training/prepare.py`), so the reference
is the one-worker, no-fault run on the same S3 source. Whoever makes the batches reads S3 with the job's
`storage_options`: the Parquet ones are made on the data servers (the static workers), the text ones on
the compute workers (`data_pipeline`: each worker's batch maker, a process of its own, a joined worker's
too). Each run ends bitwise equal to the reference, every batch id once, under either policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_elastic import ElasticJob
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.training.prepare import prepare

from .conftest import References
from .data_helpers import write_digits_parquet, write_tokens_folder_in_blocks
from .test_data_sources import parquet_job, run_with_faults, text_job
from .test_elastic import check_run
from .test_s3 import S3, s3  # noqa: F401  (the module's S3 server: a fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def upload(s3: S3, local: Path, name: str) -> str:  # noqa: F811
    """The files of the folder `local` under s3://<a new bucket>/<name>/, byte for byte; its URL."""
    bucket = s3.new_bucket()
    for path in sorted(local.iterdir()):
        s3.fs.put_file(str(path), f"{bucket}/{name}/{path.name}")
    return f"s3://{bucket}/{name}"


@pytest.fixture(scope="module")
def s3_sources(s3: S3, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # noqa: F811
    """Where each source lies on S3, by its kind."""
    parquet = write_digits_parquet(tmp_path_factory.mktemp("parquet")).removeprefix("file://")
    tokens = write_tokens_folder_in_blocks(tmp_path_factory.mktemp("tokens") / "train")
    return {"parquet": upload(s3, Path(parquet), "digits"), "datasets": upload(s3, Path(tokens), "tokens")}


def s3_source_job(s3: S3, url: str, source: str, policy: str) -> ElasticJob:  # noqa: F811
    pipeline = "data_servers" if source == "parquet" else "compute_workers"
    job = parquet_job if source == "parquet" else text_job
    made = job(url, policy, storage_options=s3.storage, data_pipeline=pipeline)
    return made.model_copy(update={"job_id": f"s3-{source}-{policy}"})


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
@pytest.mark.parametrize("source", ["parquet", "datasets"])
def test_a_source_on_s3_with_a_worker_killed_and_one_added(
    s3: S3,  # noqa: F811
    s3_sources: dict[str, str],
    cluster: LocalElasticCluster,
    reference: References,
    source: str,
    policy: str,
) -> None:
    job = s3_source_job(s3, s3_sources[source], source, policy)
    prepared = prepare(job)
    assert (prepared.dataset.kind, prepared.dataset.object_store) == (source, True)
    assert prepared.dataset.blocks.count(100) >= 6, "blocks of 100 rows"
    assert prepared.schedule.block_rows == 100, "shuffled by blocks"
    assert prepared.batches.on_compute == (source == "datasets")
    result = run_with_faults(cluster, job, seed=21)
    check_run(result, reference(job), policy)  # type: ignore[arg-type]
