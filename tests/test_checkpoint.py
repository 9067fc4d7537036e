"""Persistent checkpoints: atomic, loadable without pickle, refused for another job or model; a job whose
controller was SIGKILLed resumes from its last checkpoint with the same final parameters; a checkpoint folder
that fills up or turns read-only mid-run delays checkpoints, and past the job's limit ends it with the final
parameters kept."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
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
    WriteFailures,
    fingerprint,
)
from prefect_elastic.errors import CheckpointWriteError, FatalError
from prefect_elastic.ledger import LedgerEntry
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, MembershipEvent, Progress

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


# -- a checkpoint folder that fills up or turns read-only mid-run ---------------------------------------


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `folder` (the tests run as root), unmounted at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@contextlib.contextmanager
def immutable(folder: Path) -> Iterator[None]:
    """`folder` made immutable (`chattr +i`: nothing created or removed in it, even by root) in the block."""
    subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def fill(disk: Path, room: int = 0) -> Path:
    """Fill the file system of `disk` with a file, up to `room` bytes left; the file, to remove later."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - room))
    return filler


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


def test_write_failures_end_the_job_only_past_the_limit() -> None:
    failures = WriteFailures()
    for _ in range(2):
        failures = failures.after("OSError: [Errno 28] No space left on device")
    assert failures.in_a_row == 2 and failures.last.startswith("OSError")
    assert not failures.ends_job(2) and failures.ends_job(1)
    assert failures.after(None) == WriteFailures(), "a write that succeeds starts the count again"
    assert WriteFailures().after("PermissionError").ends_job(0), "0 allowed: the first failure ends it"
    assert not WriteFailures().after(None).ends_job(0)


def test_a_write_to_a_full_disk_leaves_the_last_checkpoint_as_it_was(digits_url: str, tmp_path: Path) -> None:
    """Half a checkpoint fits: the write fails, its temporary is gone (the room is free again for the next
    try), and the newest checkpoint is still the last one written, whole."""
    with small_disk(tmp_path / "disk", size="256k") as disk:
        j = checkpointed_job(digits_url, tmp_path, checkpoint=f"file://{disk}/ckpt")
        store = CheckpointStore(str(j.checkpoint), keep=2)
        store.write(sample(j, 2))
        filler = fill(disk, room=len(sample(j, 5).to_bytes()) // 2)
        with pytest.raises(OSError) as full:
            store.write(sample(j, 5))
        assert full.value.errno == errno.ENOSPC
        assert sorted(os.listdir(disk / "ckpt")) == ["ckpt-000000002.pt"], "no temporary left behind"
        found = store.latest()
        assert found is not None and found[0].committed_steps == 2
        filler.unlink()
        store.write(sample(j, 5))
        assert store.names() == ["ckpt-000000002.pt", "ckpt-000000005.pt"]


class BrokenFolder:
    """Callbacks of a run whose checkpoint folder breaks (`breaks`: fills up, turns read-only) once a
    checkpoint past step 0 is written, and is mended (`mends`) after `mend_after` failed writes (never
    with None). Training is held at the gate (`tests.models:gated_slow_mlp`) at each step the test waits
    for a checkpoint of, so each write is tried where the test expects it, however fast training is."""

    def __init__(
        self,
        store: CheckpointStore,
        breaks: contextlib.AbstractContextManager[object],
        mend_after: int | None,
    ) -> None:
        self.store = store
        self.breaks = breaks
        self.mend_after = mend_after
        self.broken = False
        self.broke_at = -1  # the step of the last checkpoint written before the folder broke
        self.after_step = 0  # training is held at the first step past this one (-1: not held)
        self.failures: list[MembershipEvent] = []
        self.newest: list[int] = []  # at each failure: the step of the newest checkpoint that loads
        self.temporaries: list[str] = []  # at each failure: what the folder held that is not a checkpoint

    def on_progress(self, p: Progress) -> None:
        from .models import GATE

        # (Open again below it: a membership change on a loaded machine may roll training back there.)
        if self.after_step >= 0 and p.committed_steps > self.after_step:
            GATE.touch()
        else:
            GATE.unlink(missing_ok=True)

    def on_event(self, e: MembershipEvent) -> None:
        from .models import GATE

        if e.kind is EventKind.SNAPSHOT and self.broke_at < 0:
            found = self.store.latest()
            if found is not None and found[0].committed_steps > 0:
                self.breaks.__enter__()
                self.broken = True
                self.broke_at = self.after_step = found[0].committed_steps
                GATE.unlink(missing_ok=True)
        elif e.kind is EventKind.CHECKPOINT_FAILED:
            self.failures.append(e)
            found = self.store.latest()
            self.newest.append(found[0].committed_steps if found else -1)
            self.temporaries += [n for n in os.listdir(self.store.root) if not n.startswith("ckpt-")]
            if len(self.failures) == self.mend_after:
                self.mend()
                self.after_step = -1  # not held any more
            else:
                self.after_step = e.step
            GATE.unlink(missing_ok=True)

    def mend(self) -> None:
        if self.broken:
            self.broken = False
            self.breaks.__exit__(None, None, None)


@contextlib.contextmanager
def filled(disk: Path) -> Iterator[None]:
    filler = fill(disk)
    try:
        yield
    finally:
        filler.unlink()


def failing_job(digits_url: str, folder: Path, job_id: str) -> ElasticJob:
    """A checkpoint at every snapshot; one failed write in a row allowed."""
    return checkpointed_job(
        digits_url, folder, checkpoint=f"file://{folder}/ckpt", checkpoint_every=1,
        checkpoint_failures_allowed=1, model="tests.models:gated_slow_mlp", job_id=job_id,
    )  # fmt: skip


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_checkpoint_folder_that_fills_up_mid_run_only_delays_checkpoints(
    cluster: LocalElasticCluster, reference: References, digits_url: str, tmp_path: Path
) -> None:
    """The disk of the checkpoint folder fills up (a small tmpfs) after a checkpoint was written: the next
    write fails, which is an event and not the end of the run; training goes on, and once there is room
    again checkpoints are written as before. Nothing is redone, and the result is the no-fault one."""
    from .models import GATE

    top_up(cluster, 2)
    with small_disk(tmp_path / "disk") as disk:
        j = failing_job(digits_url, disk, "ckpt-full")
        store = CheckpointStore(str(j.checkpoint))
        folder = BrokenFolder(store, filled(disk), mend_after=1)
        try:
            result = train(j, cluster=cluster, on_progress=folder.on_progress, on_event=folder.on_event)
        finally:
            GATE.unlink(missing_ok=True)
            folder.mend()
        assert [e.kind for e in folder.failures] == [EventKind.CHECKPOINT_FAILED]
        failed = folder.failures[0]
        assert "No space left on device" in failed.reason and "training goes on" in failed.reason
        assert [e for e in result.events if e.kind is EventKind.CHECKPOINT_FAILED] == folder.failures
        assert folder.newest == [folder.broke_at] and 0 < folder.broke_at < failed.step, (
            "the last checkpoint written before the disk filled up stayed the newest, and loaded"
        )
        assert folder.temporaries == [], "the failed write left no temporary"
        assert_same_parameters(result, reference(j))
        assert_ledger_exactly_once(result)
        found = store.latest()
        assert found is not None and found[0].committed_steps == result.total_steps
        assert result.checkpoint == found[1]


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_checkpoint_writes_that_keep_failing_end_the_job_keeping_the_final_parameters(
    cluster: LocalElasticCluster, reference: References, digits_url: str, tmp_path: Path
) -> None:
    """The checkpoint folder turns read-only (`chattr +i`) and stays so: past `checkpoint_failures_allowed`
    failures in a row the job stops with `CheckpointWriteError`, naming the last checkpoint written (still
    there, and whole) and holding the final parameters; written into the mended folder, a new run resumes
    from them and ends with the no-fault result."""
    from .models import GATE

    top_up(cluster, 2)
    j = failing_job(digits_url, tmp_path, "ckpt-readonly")
    store = CheckpointStore(str(j.checkpoint))
    store.check_writable()  # (the folder exists before it is made read-only)
    folder = BrokenFolder(store, immutable(tmp_path / "ckpt"), mend_after=None)
    try:
        with pytest.raises(CheckpointWriteError) as failed:
            train(j, cluster=cluster, on_progress=folder.on_progress, on_event=folder.on_event)
    finally:
        GATE.unlink(missing_ok=True)
        folder.mend()
    error = failed.value
    assert len(folder.failures) == 2, "one failure allowed: the second ends the job"
    assert "PermissionError" in folder.failures[0].reason and "training stops" in folder.failures[1].reason
    found = store.latest()
    assert found is not None and error.checkpoint == found[1] and found[1] in str(error)
    assert folder.newest == [folder.broke_at] * 2 and found[0].committed_steps == folder.broke_at < error.step
    assert "PermissionError" in str(error) and f"step {error.step}" in str(error)
    assert folder.temporaries == []
    assert list(error.state_dict) == list(reference(j).state_dict)
    assert error.final.committed_steps == error.step >= folder.failures[1].step

    # Nothing trained is lost: the final parameters, written where the job resumes from, give the
    # no-fault result without training a committed batch again.
    store.write(error.final)
    result = train(j, cluster=cluster)
    assert result.resumed_from is not None and result.resumed_from.endswith(f"ckpt-{error.step:09d}.pt")
    assert_same_parameters(result, reference(j))
    assert_ledger_exactly_once(result)
    assert min(e.step for e in result.ledger if e.generation > error.final.generation) >= error.step
