"""Datasets and checkpoints on S3 for real: a local S3 server (moto's `moto_server`, started here on
127.0.0.1 and stopped at the end), s3fs through fsspec, and the job's `storage_options` carrying the
endpoint and keys to every process that opens the storage (the controller here, the data servers on the
cluster's static workers).

What is tested is what docs/storage.md promises: a job trains from `s3://` and checkpoints to `s3://`; a
stopped run resumes from its S3 checkpoint to the same parameters as an uninterrupted run; a reader never
sees part of a checkpoint (the store shows an object only once it is complete, a temporary key is never
read, and one a dead writer left behind is pruned); pruning keeps `checkpoint_keep`; a checkpoint written
by another process is seen; bad input (a missing bucket, a wrong endpoint, options not under a protocol)
fails before any cluster work with an error that names the value and what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import httpx
import pytest
import torch

from prefect_elastic import ElasticJob, JobConfigError, TrainingStopped, train
from prefect_elastic.checkpoint import Checkpoint, CheckpointStore, fingerprint
from prefect_elastic.ledger import LedgerEntry
from prefect_elastic.local import processes
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.prefect_server import free_port

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job, top_up

pytestmark = pytest.mark.timeout(300)

MOTO = Path(sys.executable).with_name("moto_server")
NOWHERE = "tcp://127.0.0.1:9"  # no scheduler: the tests of bad input fail before any cluster work


class S3:
    """The local S3 server, the job options that reach it, and a filesystem to look at it with."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # moto takes any keys; they are in the job here because the cluster's workers were started before
        # this module, so no environment set now would reach them.
        self.options: dict[str, Any] = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        self.storage = {"s3": self.options}
        self.fs = fsspec.filesystem("s3", **self.options)

    def new_bucket(self) -> str:
        name = f"elastic-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)
        return name

    def keys(self, prefix: str) -> list[str]:
        """The object names under `prefix`, as the server has them now."""
        self.fs.invalidate_cache()
        return sorted(str(p).rsplit("/", 1)[-1] for p in self.fs.ls(prefix, detail=False))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """`moto_server` on a free port of 127.0.0.1, up (bounded wait) before the tests and stopped after."""
    if not MOTO.exists():
        pytest.fail(f"{MOTO} is missing: pip install 'moto[server]' s3fs (the dev extras) into this venv")
    folder = tmp_path_factory.mktemp("moto")
    port = free_port()
    proc = processes.start_group(
        [str(MOTO), "-H", "127.0.0.1", "-p", str(port)],
        log=folder / "moto.log",
        env=os.environ,
        cwd=folder,
        die_with_parent=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                assert proc.poll() is None, "moto_server exited\n" + processes.log_tail(folder / "moto.log")
                try:
                    http.get(endpoint)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "moto_server did not answer within 60 s"
                    time.sleep(0.2)
        yield S3(endpoint)
    finally:
        processes.stop_groups([proc])


@pytest.fixture(scope="module")
def s3_digits(s3: S3, digits_url: str) -> str:
    """The tests' digits dataset (the same 3 shards, byte for byte) under s3://<bucket>/digits/."""
    bucket = s3.new_bucket()
    local = digits_url.removeprefix("file://")
    for name in sorted(os.listdir(local)):
        s3.fs.put_file(os.path.join(local, name), f"{bucket}/digits/{name}")
    return f"s3://{bucket}/digits"


def s3_job(s3: S3, s3_digits: str, folder: str, **overrides: object) -> ElasticJob:
    """test_checkpoint's checkpointed job (a checkpoint every 2 snapshots, 2 kept), with its dataset and
    its checkpoints on S3."""
    fields: dict[str, object] = {
        "liveness_interval": 0.3,
        "checkpoint": f"{s3_digits.rsplit('/', 1)[0]}/{folder}",
        "checkpoint_every": 2,
        "checkpoint_keep": 2,
        "job_id": "s3",
        "storage_options": s3.storage,
    }
    fields.update(overrides)
    return make_job(s3_digits, **fields)


def on_local_disk(job: ElasticJob, digits_url: str) -> ElasticJob:
    """The same job reading the local copy of the dataset: what an uninterrupted run is compared with."""
    return job.model_copy(update={"dataset": digits_url, "storage_options": {}})


def sample(job: ElasticJob, step: int, padding: int = 0) -> Checkpoint:
    """A checkpoint of `job` at `step` whose tensors are the model's plus `padding` float32 values (a
    bigger checkpoint takes longer to upload, so more reads fall during a write)."""
    layout, tensors = job.initial_tensors()
    extra = {"padding": torch.full((padding,), float(step))} if padding else {}
    return Checkpoint(
        job_id=job.job_id,
        fingerprint=fingerprint(job.checkpoint_spec, layout, tensors),
        generation=1,
        committed_steps=step,
        ledger=[LedgerEntry(b, b // 4, 1, "w") for b in range(4 * step)],
        history=[1.0 / (s + 1) for s in range(step)],
        tensors={**tensors, **extra},
        optimizers=[{"state": {}, "param_groups": []}],
    )


# ---- a job on S3 ------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_job_on_s3_stopped_then_resumed_matches_an_uninterrupted_run(
    s3: S3, s3_digits: str, cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Dataset and checkpoints on S3: the data servers on the static workers read their partitions from
    S3, the controller writes checkpoints there; stopped mid-run, the job resumes from its S3 checkpoint,
    trains every batch id exactly once, and ends bitwise equal to an uninterrupted run that read the same
    dataset from local disk."""
    top_up(cluster, 2)
    job = s3_job(s3, s3_digits, "runs/resume")
    stop = threading.Event()
    with pytest.raises(TrainingStopped) as stopped:
        train(job, cluster=cluster, stop=stop, on_progress=lambda p: p.committed_steps >= 15 and stop.set())
    written = stopped.value.checkpoint
    assert written is not None and written.startswith(f"{job.checkpoint}/ckpt-"), written
    assert s3.fs.exists(written)

    result = train(job, cluster=cluster)
    uninterrupted = reference(on_local_disk(job, digits_url))
    assert result.resumed_from == written
    assert_same_parameters(result, uninterrupted)
    assert_ledger_exactly_once(result)
    assert result.history == uninterrupted.history
    assert result.checkpoint == f"{job.checkpoint}/ckpt-{result.total_steps:09d}.pt"

    keys = s3.keys(str(job.checkpoint).removeprefix("s3://"))
    assert len(keys) == job.checkpoint_keep, f"pruned to checkpoint_keep: {keys}"
    assert all(k.startswith("ckpt-") for k in keys), f"no temporary or probe object is left: {keys}"


# ---- the checkpoint store on S3 ---------------------------------------------------------------------------


def test_a_reader_never_sees_part_of_a_checkpoint(s3: S3, s3_digits: str) -> None:
    """While checkpoints are written, a reader in another thread only ever finds whole ones (a part of
    one would fail to load); temporaries are never listed; pruning keeps `keep`."""
    job = s3_job(s3, s3_digits, f"runs/{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(str(job.checkpoint), keep=2, storage_options=job.storage_for(str(job.checkpoint)))
    root = str(job.checkpoint).removeprefix("s3://")
    store.check_writable()
    assert store.latest() is None and not s3.fs.find(root), "the probe leaves nothing, no folder object"

    steps = range(1, 7)
    padding = 2**20  # 4 MiB more per checkpoint
    reader = CheckpointStore(str(job.checkpoint), storage_options=job.storage_for(str(job.checkpoint)))
    done = threading.Event()
    seen: list[int] = []
    problems: list[BaseException] = []

    def read_until_done() -> None:
        for _ in range(10_000):  # bounded; `done` ends it long before
            try:
                assert all(n.startswith("ckpt-") for n in reader.names())
                found = reader.latest()  # a part of a checkpoint would fail to load here
                if found is not None:
                    checkpoint, _ = found
                    expected = torch.full((padding,), float(checkpoint.committed_steps))
                    assert torch.equal(checkpoint.tensors["padding"], expected)
                    seen.append(checkpoint.committed_steps)
            except BaseException as exc:
                problems.append(exc)
                return
            if done.is_set():
                return

    thread = threading.Thread(target=read_until_done)
    thread.start()
    try:
        for step in steps:
            store.write(sample(job, step, padding))
    finally:
        done.set()
        thread.join(120)
    assert not thread.is_alive()
    assert not problems, f"a reader saw an incomplete checkpoint: {problems[0]!r}"
    assert seen == sorted(seen) and set(seen) <= set(steps), "only whole, written checkpoints, in order"
    assert store.names() == ["ckpt-000000005.pt", "ckpt-000000006.pt"], "pruned to keep=2"
    assert s3.keys(root) == store.names(), "no temporary left"


def test_an_unfinished_upload_or_a_dead_writers_temporary_is_never_read(s3: S3, s3_digits: str) -> None:
    """What "atomic" rests on: S3 shows an object only when its upload completed (here a multipart upload
    of a final name, stopped midway, is invisible), and a temporary that a writer left when it died between
    upload and move is ignored by readers and removed by the next prune."""
    job = s3_job(s3, s3_digits, f"runs/{uuid.uuid4().hex[:8]}")
    options = job.storage_for(str(job.checkpoint))
    store = CheckpointStore(str(job.checkpoint), keep=2, storage_options=options)
    store.write(sample(job, 3))
    root = str(job.checkpoint).removeprefix("s3://")

    # A writer that died after uploading its temporary (the whole checkpoint, or part of one).
    whole = sample(job, 7).to_bytes()
    dead = f"{root}/.tmp-{uuid.uuid4().hex}.pt"
    s3.fs.pipe_file(dead, whole[: len(whole) // 2])
    # An upload to a final name that has sent a part but not completed: S3 holds no such object yet.
    bucket, key = root.split("/", 1)[0], f"{root.split('/', 1)[1]}/ckpt-000000009.pt"
    upload = s3.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        part = {"Bucket": bucket, "Key": key, "UploadId": upload, "PartNumber": 1}
        s3.fs.call_s3("upload_part", Body=whole, **part)
        assert not s3.fs.exists(f"{root}/ckpt-000000009.pt")
        assert store.names() == ["ckpt-000000003.pt"]
        found = store.latest()
        assert found is not None and found[0].committed_steps == 3
    finally:
        s3.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)

    store.write(sample(job, 4))
    assert s3.keys(root) == ["ckpt-000000003.pt", "ckpt-000000004.pt"], (
        "the dead writer's temporary is pruned"
    )


def test_a_checkpoint_another_process_wrote_is_seen(s3: S3, s3_digits: str) -> None:
    """s3fs caches listings per filesystem object; the store lists afresh, so a checkpoint written through
    another one (as another process would) is found by `latest`."""
    job = s3_job(s3, s3_digits, f"runs/{uuid.uuid4().hex[:8]}")
    options = job.storage_for(str(job.checkpoint))
    here = CheckpointStore(str(job.checkpoint), storage_options=options)
    here.write(sample(job, 2))
    assert here.names() == ["ckpt-000000002.pt"]  # listed, and so cached by s3fs
    elsewhere = CheckpointStore(str(job.checkpoint), storage_options={**options, "skip_instance_cache": True})
    assert elsewhere.fs is not here.fs
    elsewhere.write(sample(job, 5))
    found = here.latest()
    assert found is not None and found[0].committed_steps == 5


def test_fsspec_environment_configuration_reaches_s3(s3: S3, s3_digits: str) -> None:
    """Without `storage_options`, fsspec's own configuration from the environment (FSSPEC_S3_*, read when
    fsspec is imported) gives the endpoint and keys: the other way to configure every process."""
    script = textwrap.dedent(
        """
        import sys
        from prefect_elastic import ElasticJob
        job = ElasticJob(model="tests.models:mlp", dataset=sys.argv[1])
        print("SAMPLES", job.check_inputs()[0].length)
        """
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("FSSPEC_", "AWS_"))},
        "FSSPEC_S3_ENDPOINT_URL": s3.endpoint,
        "FSSPEC_S3_KEY": "testing",
        "FSSPEC_S3_SECRET": "testing",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, s3_digits], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SAMPLES 1797" in done.stdout


# ---- bad input --------------------------------------------------------------------------------------------


def test_a_missing_bucket_is_named(s3: S3, s3_digits: str) -> None:
    absent = f"absent-{uuid.uuid4().hex[:8]}"
    job = s3_job(s3, s3_digits, "unused", dataset=f"s3://{absent}/digits")
    with pytest.raises(JobConfigError) as err:
        train(job, address=NOWHERE)
    assert err.value.field == "dataset" and f"bucket {absent!r} does not exist" in str(err.value)

    job = s3_job(s3, s3_digits, "unused", checkpoint=f"s3://{absent}/ckpt")
    with pytest.raises(JobConfigError) as err:
        train(job, address=NOWHERE)
    assert err.value.field == "checkpoint" and f"bucket {absent!r} does not exist" in str(err.value)
    assert "create the bucket" in str(err.value)
    assert not s3.fs.exists(absent), "a checkpoint URL never creates a bucket"


def test_a_wrong_endpoint_is_named(s3: S3, s3_digits: str) -> None:
    wrong = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    job = s3_job(s3, s3_digits, "unused", storage_options={"s3": {**s3.options, "endpoint_url": wrong}})
    with pytest.raises(JobConfigError) as err:
        train(job, address=NOWHERE)
    assert err.value.field == "dataset"
    assert "cannot be reached" in str(err.value) and f"endpoint_url {wrong!r}" in str(err.value)


def test_storage_options_must_be_under_a_protocol(digits_url: str, tmp_path: Path) -> None:
    flat = {"endpoint_url": "http://127.0.0.1:9000", "key": "k"}
    with pytest.raises(JobConfigError) as err:
        make_job(digits_url, storage_options=flat)
    assert err.value.field == "storage_options"
    assert "not to a mapping of options" in str(err.value) and "'s3'" in str(err.value)
    with pytest.raises(JobConfigError, match="'s4' is not a protocol fsspec knows"):
        make_job(digits_url, storage_options={"s4": {}})
    job = make_job(digits_url, storage_options={"s3": flat})
    (tmp_path / "job.yaml").write_text(job.to_yaml())
    assert ElasticJob.from_yaml(tmp_path / "job.yaml") == job
    assert job.storage_for("s3://b/k") == flat and job.storage_for(digits_url) == {}
    assert job.storage_for("simplecache::s3://b/k") == {"s3": flat}, "a chained URL: options by protocol"


# ---- the data sources on S3 (no cluster: inspected and read in this process) -----------------------------


def test_a_parquet_folder_on_s3_is_inspected_by_its_footers_and_read_by_row_groups(s3: S3) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prefect_elastic.data.sources import inspect_source, only_fields, open_source

    bucket = s3.new_bucket()
    for part in range(2):
        index = np.arange(part * 30, part * 30 + 30)
        data = pa.table({"x": index.astype(np.float32), "y": index % 3, "text": [f"row {i}" for i in index]})
        with s3.fs.open(f"{bucket}/train/part-{part}.parquet", "wb") as out:
            pq.write_table(data, out, row_group_size=8)
    info = inspect_source("dataset", f"s3://{bucket}/train", s3.options)
    assert (info.kind, info.length, info.blocks, info.object_store) == ("parquet", 60, (8, 8, 8, 6) * 2, True)
    assert inspect_source("dataset", f"s3://{bucket}/train/*.parquet", s3.options).detail == info.detail
    source = open_source(info, cache_bytes=2**16)
    assert [item["text"] for item in source.items([59, 0, 31])] == ["row 59", "row 0", "row 31"]
    rows = open_source(only_fields(info, ["x", "y"])).rows([59, 0, 31])
    assert rows is not None and rows["x"].tolist() == [59, 0, 31] and rows["y"].dtype == np.int64

    absent = f"absent-{uuid.uuid4().hex[:8]}"
    with pytest.raises(JobConfigError) as err:
        inspect_source("eval_dataset", f"s3://{absent}/train", s3.options)
    assert err.value.field == "eval_dataset" and f"bucket {absent!r} does not exist" in str(err.value)


def test_a_datasets_folder_on_s3_is_read_by_the_byte_ranges_of_its_batches(s3: S3, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from prefect_elastic.data.sources import inspect_source, open_source

    ids = [list(range(i % 7 + 1)) for i in range(200)]
    written = datasets.Dataset.from_dict({"input_ids": ids, "label": [i % 2 for i in range(200)]})
    written.save_to_disk(str(tmp_path / "hf"), max_shard_size="1KB")
    bucket = s3.new_bucket()
    for path in sorted((tmp_path / "hf").iterdir()):
        s3.fs.put_file(str(path), f"{bucket}/hf/{path.name}")
    info = inspect_source("dataset", f"s3://{bucket}/hf", s3.options)
    assert (info.kind, info.length, info.object_store) == ("datasets", 200, True)
    assert len(info.detail[0]) > 1 and info.detail[2] is None  # (several files, none local)
    items = open_source(info).items([199, 0, 100])
    assert [item["input_ids"].tolist() for item in items] == [ids[199], ids[0], ids[100]]
    assert [int(item["label"]) for item in items] == [1, 0, 0]
