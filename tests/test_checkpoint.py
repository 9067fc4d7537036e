"""Persistent checkpoints: atomic, loadable without pickle, refused for another job or model; a job whose
controller was SIGKILLed resumes from its last checkpoint with the same final parameters; each mode's
cadence, and an async run's mid-run checkpoint resumed by async runs alone. (A checkpoint folder that fills
up or turns read-only mid-run: test_checkpoint_failures.py.)"""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from prefect_elastic import CheckpointMismatchError, ElasticJob, JobConfigError, TrainingStopped, train
from prefect_elastic.checkpoint import (
    AsyncCheckpoints,
    Checkpoint,
    CheckpointStore,
    Persistence,
    SyncCheckpoints,
    fingerprint,
)
from prefect_elastic.errors import FatalError
from prefect_elastic.ledger import LedgerEntry
from prefect_elastic.local.cluster import LocalElasticCluster

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    held_training,
    make_job,
    top_up,
)

NOWHERE = "tcp://127.0.0.1:9"


def checkpointed_job(digits_url: str, tmp_path: Path, **overrides: object) -> ElasticJob:
    """`make_job` with a checkpoint folder under `tmp_path`, written every 2 snapshots (2 kept)."""
    fields: dict[str, object] = {
        "liveness_interval": 0.3,
        "checkpoint": f"file://{tmp_path}/ckpt",
        "checkpoint_every": 2,
        "checkpoint_keep": 2,
        "job_id": "ckpt",
    }
    fields.update(overrides)
    return make_job(digits_url, **fields)


def sample(j: ElasticJob, step: int) -> Checkpoint:
    layout, tensors = j.initial_tensors()
    return Checkpoint(
        job_id=j.job_id,
        fingerprint=fingerprint(j.checkpoint_spec, layout, tensors),
        generation=3,
        committed_steps=step,
        ledger=[LedgerEntry(b, b // 4, 3, "w", staleness=b % 3) for b in range(4 * step)],
        history=[1.0 / (s + 1) for s in range(step)],
        tensors=tensors,
        optimizers=[{"state": {}, "param_groups": []}],
    )


def test_checkpoint_round_trip_and_pruning(digits_url: str, tmp_path: Path) -> None:
    j = checkpointed_job(digits_url, tmp_path)
    store = CheckpointStore(str(j.checkpoint), keep=2)
    for step in (2, 5, 9):
        store.write(sample(j, step))
    assert store.names() == ["ckpt-000000005.pt", "ckpt-000000009.pt"], "pruned to keep=2"
    assert not [p for p in os.listdir(tmp_path / "ckpt") if not p.startswith("ckpt-")], "no temporary left"
    found = store.latest()
    assert found is not None
    loaded, where = found
    assert where.endswith("ckpt-000000009.pt")
    original = sample(j, 9)
    # (Async mode's staleness included: the result's staleness histogram counts entries from before a
    # resume too.)
    assert loaded.ledger == original.ledger and loaded.history == original.history
    assert all(torch.equal(loaded.tensors[k], original.tensors[k]) for k in original.tensors)


def test_a_checkpoint_written_before_staleness_was_kept_reads_as_staleness_0(
    digits_url: str, tmp_path: Path
) -> None:
    original = sample(checkpointed_job(digits_url, tmp_path), 3)
    payload = torch.load(io.BytesIO(original.to_bytes()), weights_only=True)
    payload["ledger"] = payload["ledger"][:, :3]  # batch id, step, generation: format 1's layout
    payload["format"] = 1
    older = io.BytesIO()
    torch.save(payload, older)
    loaded = Checkpoint.from_bytes(older.getvalue(), "older.pt")
    assert [e.staleness for e in loaded.ledger] == [0] * len(original.ledger)
    assert [(e.batch_id, e.step, e.worker) for e in loaded.ledger] == [
        (e.batch_id, e.step, e.worker) for e in original.ledger
    ]


def test_checkpoints_on_an_object_store_like_filesystem(digits_url: str) -> None:
    """fsspec's in-memory filesystem has no directories and no atomic rename, like an object store."""
    j = checkpointed_job(digits_url, Path("/unused"), checkpoint=f"memory://ckpt-{os.getpid()}/job")
    store = CheckpointStore(str(j.checkpoint), keep=2)
    store.check_writable()
    for step in (1, 4, 6):
        store.write(sample(j, step))
    assert store.names() == ["ckpt-000000004.pt", "ckpt-000000006.pt"]
    found = store.latest()
    assert found is not None and found[0].committed_steps == 6 and found[1].startswith("memory://")


def test_a_dead_writers_temporary_is_ignored_then_pruned(digits_url: str, tmp_path: Path) -> None:
    """A writer killed between its upload and its move leaves `.tmp-<hex>.pt` (here: half a checkpoint):
    readers never look at it, and the next write's prune removes it (tests/test_s3.py does this on S3)."""
    j = checkpointed_job(digits_url, tmp_path)
    store = CheckpointStore(str(j.checkpoint), keep=2)
    store.write(sample(j, 2))
    whole = sample(j, 8).to_bytes()
    (tmp_path / "ckpt" / f".tmp-{'ab' * 16}.pt").write_bytes(whole[: len(whole) // 2])
    assert store.names() == ["ckpt-000000002.pt"]
    found = store.latest()
    assert found is not None and found[0].committed_steps == 2
    store.write(sample(j, 3))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000000002.pt", "ckpt-000000003.pt"]


# (torch warns that the crafted file's pickle protocol is not the one it writes: that is the point here.)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_pickle_is_never_loaded(digits_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()

    class Boom:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (folder / "ckpt-000000001.pt").write_bytes(pickle.dumps({"format": 1, "x": Boom()}))
    with pytest.raises(FatalError, match="cannot be read"):
        CheckpointStore(f"file://{folder}").latest()
    assert not (tmp_path / "pwned").exists()


def test_unwritable_checkpoint_url_fails_before_cluster_work(digits_url: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(JobConfigError) as err:
        train(checkpointed_job(digits_url, tmp_path, checkpoint=f"file://{blocker}/ckpt"), address=NOWHERE)
    assert err.value.field == "checkpoint" and "a-file" in str(err.value)


def test_checkpoint_of_another_model_or_job_is_refused(digits_url: str, tmp_path: Path) -> None:
    j = checkpointed_job(digits_url, tmp_path)
    CheckpointStore(str(j.checkpoint)).write(sample(j, 3))
    with pytest.raises(CheckpointMismatchError, match="another model"):
        train(checkpointed_job(digits_url, tmp_path, model="tests.models:cnn_bn"), address=NOWHERE)
    with pytest.raises(CheckpointMismatchError, match="batch_size"):
        train(checkpointed_job(digits_url, tmp_path, batch_size=8), address=NOWHERE)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_stopped_job_resumes_to_the_same_parameters(
    cluster: LocalElasticCluster, reference: References, digits_url: str, tmp_path: Path
) -> None:
    top_up(cluster, 2)
    j = checkpointed_job(digits_url, tmp_path)
    stop = threading.Event()
    with pytest.raises(TrainingStopped) as stopped:
        train(j, cluster=cluster, stop=stop, on_progress=lambda p: p.committed_steps >= 15 and stop.set())
    assert stopped.value.checkpoint is not None and os.path.exists(stopped.value.checkpoint)
    result = train(j, cluster=cluster)
    assert result.resumed_from == stopped.value.checkpoint
    assert_same_parameters(result, reference(j))
    assert_ledger_exactly_once(result)
    assert result.history == reference(j).history
    assert result.checkpoint is not None and result.checkpoint.endswith(f"ckpt-{result.total_steps:09d}.pt")


CONTROLLER = textwrap.dedent(
    """
    import sys
    from prefect_elastic import ElasticJob, train
    job = ElasticJob.from_yaml(sys.argv[1])
    train(job, address=sys.argv[2], on_progress=lambda p: print("step", p.committed_steps, flush=True))
    """
)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_controller_sigkilled_then_run_again_resumes(
    cluster: LocalElasticCluster, reference: References, digits_url: str, tmp_path: Path
) -> None:
    """The whole controller process dies (as a flow process would); the same job run again picks up at
    its last checkpoint, trains no committed batch twice, and ends with the same parameters."""
    top_up(cluster, 2)
    # A checkpoint at every snapshot: a job that stands still is snapshotted once where it stands.
    j = checkpointed_job(
        digits_url, tmp_path, job_id="ckpt-killed", model="tests.models:held_mlp", checkpoint_every=1
    )
    spec = tmp_path / "job.yaml"
    spec.write_text(j.to_yaml())
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    store = CheckpointStore(str(j.checkpoint))
    with held_training():  # the job stands at a step until the controller is dead
        proc = subprocess.Popen(
            [sys.executable, str(script), str(spec), cluster.scheduler_address],
            stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd(),
        )  # fmt: skip
        assert proc.stdout is not None
        for _ in proc.stdout:
            found = store.latest()
            if found is not None and found[0].committed_steps > 0:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    written = store.latest()
    assert written is not None
    resumed_at = written[0].committed_steps
    assert 0 < resumed_at < reference(j).steps, "the checkpoint is of a step before the end"

    deadline = time.monotonic() + 60
    while True:  # the dead controller's client leaves the scheduler within its heartbeat
        try:
            result = train(j, cluster=cluster)
            break
        except FatalError as exc:
            if "already training" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert result.resumed_from == written[1]
    assert_same_parameters(result, reference(j))
    assert_ledger_exactly_once(result)
    assert min(e.step for e in result.ledger if e.generation > written[0].generation) >= resumed_at, (
        "batches committed before the checkpoint were not trained again"
    )


def test_each_mode_has_its_cadence() -> None:
    """Sync mode writes every `checkpoint_every`-th snapshot; async mode's coordinator snapshots only
    every `checkpoint_every` checks, so each of its snapshots is written."""
    assert SyncCheckpoints().snapshots_per_checkpoint(10) == 10
    assert AsyncCheckpoints().snapshots_per_checkpoint(10) == 1


def mid_run_async(j: ElasticJob, step: int) -> Checkpoint:
    """A checkpoint an async run wrote mid-run: its two shards at versions of their own."""
    whole = sample(j, step)
    versions, applied = (step, step + 1), (tuple(range(step)), tuple(range(step + 1)))
    return replace(whole, optimizers=whole.optimizers * 2, versions=versions, applied=applied)


def test_only_an_async_run_goes_on_from_a_checkpoint_an_async_run_wrote_mid_run(
    digits_url: str, tmp_path: Path
) -> None:
    j = checkpointed_job(digits_url, tmp_path)
    CheckpointStore(str(j.checkpoint)).write(mid_run_async(j, 6))
    layout, tensors = j.initial_tensors()
    with pytest.raises(CheckpointMismatchError, match=r"mid-run by an async run .* versions \[6, 7\]"):
        Persistence(j.checkpoint_spec, layout, tensors, SyncCheckpoints())
    resumed = Persistence(j.checkpoint_spec, layout, tensors, AsyncCheckpoints())
    assert resumed.resumed is not None and resumed.resumed.versions == (6, 7)
    assert resumed.shard_start(1, []).version == 7, "each shard resumes at its own version"
    SyncCheckpoints().check_resumable(sample(j, 6), "here")  # (a sync run's: every shard at step 6)
