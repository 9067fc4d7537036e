"""A checkpoint folder that fills up or turns read-only mid-run: a failed write leaves the last checkpoint as
it was and only delays checkpoints, and past the job's limit of failures in a row the job ends with the
final parameters kept, from which a new run resumes to the no-fault result."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_elastic import ElasticJob, train
from prefect_elastic.checkpoint import CheckpointStore, WriteFailures
from prefect_elastic.errors import CheckpointWriteError
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, MembershipEvent, Progress

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, top_up
from .test_checkpoint import checkpointed_job, sample


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
