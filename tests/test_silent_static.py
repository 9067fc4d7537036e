"""Static workers silent for a moment are not lost. The controller takes a static worker the scheduler
has not heard from lately for lost, so that a cut or frozen one's roles move within seconds; but a worker
(or the scheduler) starved of CPU is silent too. CI's chaos soak, on 2 cores, saw the coordinator's worker
and both data servers' silent at once: the coordinator was rebuilt, with every data server taken for lost,
and a job that had lost nothing failed for want of a live shard. Where silence would cost a shard its last
copy, the silent data servers are now asked first, and those that answer keep their roles.

Here the silence is a SIGSTOP of 8 seconds (more than the 2.5 heartbeats, 1.25 s, after which the
scheduler's view calls a worker silent; less than `call_timeout`), of the static workers of two roles at
once, with a standby that is heard."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator

import pytest

from prefect_elastic import ElasticJob, TrainResult, train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.messages import EventKind, Progress

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job, top_up
from .models import GATE

pytestmark = [pytest.mark.cluster, pytest.mark.heavy, pytest.mark.timeout(300)]

FREEZE_S = 8.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalElasticCluster]:
    """4 static workers: roles for up to 3 data servers (the coordinator beside data server 0), and a
    standby at least."""
    with LocalElasticCluster(static_workers=4, elastic_workers=2) as cluster:
        yield cluster


class FreezeWhenSnapshotted:
    """Holds training (`tests.models:gated_slow_mlp`) at step `at` or later until a snapshot of where it
    stands is confirmed, then SIGSTOPs the static workers of data servers `indices` together and SIGCONTs
    them `seconds` later. Records the first and the last progress."""

    def __init__(
        self, cluster: LocalElasticCluster, indices: tuple[int, ...], at: int = 12, seconds: float = FREEZE_S
    ) -> None:
        self.cluster, self.indices, self.at, self.seconds = cluster, indices, at, seconds
        self.frozen: list[str] = []
        self.first: Progress | None = None
        self.last: Progress | None = None
        self.wake = threading.Timer(seconds, self.wake_all)

    def wake_all(self) -> None:
        for worker in self.frozen:
            self.cluster.kill_worker(worker, sig=signal.SIGCONT)

    def __call__(self, progress: Progress) -> None:
        self.first = self.first or progress
        self.last = progress
        if self.frozen or progress.committed_steps < self.at:
            return
        GATE.touch()
        if progress.snapshot_step >= self.at:
            self.frozen = sorted({progress.data_servers[i] for i in self.indices})
            for worker in self.frozen:
                self.cluster.kill_worker(worker, sig=signal.SIGSTOP)
            self.wake.start()
            GATE.unlink(missing_ok=True)


def run_frozen(
    cluster: LocalElasticCluster, job_id: str, indices: tuple[int, ...], digits_url: str, **overrides: object
) -> tuple[FreezeWhenSnapshotted, ElasticJob, TrainResult]:
    top_up(cluster, 2)
    job = make_job(
        digits_url, "rollback", job_id=job_id, model="tests.models:gated_slow_mlp", epochs=4, **overrides
    )
    freeze = FreezeWhenSnapshotted(cluster, indices)
    try:
        result = train(job, cluster=cluster, on_progress=freeze)
    finally:
        GATE.unlink(missing_ok=True)
        freeze.wake.cancel()
        freeze.wake_all()  # (again: a SIGCONT to a running process changes nothing)
    return freeze, job, result


def test_the_coordinators_worker_and_a_data_servers_silent_together_keep_every_shard(
    cluster: LocalElasticCluster, reference: References, digits_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's worker (with data server 0) and data server 1's, silent together: the coordinator
    is taken for lost and rebuilt on the standby that is heard. Its first rebuild, with both data servers
    taken for lost, has no live shard; they are asked, answer once woken, and the rebuild takes them in.
    (Before: the job failed, "the coordinator died with every data server".)"""
    with caplog.at_level(logging.WARNING, logger="prefect_elastic.training"):
        freeze, job, result = run_frozen(cluster, "silent-coordinator", (0, 1), digits_url)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    first, last = freeze.first, freeze.last
    assert first is not None and last is not None and len(freeze.frozen) == 2
    assert first.coordinator_at in freeze.frozen
    assert last.data_servers == first.data_servers, "both data servers kept their roles"
    assert last.coordinator_at in first.standbys, "the coordinator was rebuilt on a standby"
    kinds = [e.kind for e in result.events]
    assert kinds.count(EventKind.COORDINATOR_REBUILT) == 1 and EventKind.PROMOTED not in kinds
    assert result.counters["promotions"] == 0 and result.counters["coordinator_rebuilds"] == 1
    # (Not a rebuild that began after the freeze ended: the data servers were asked, and answered.)
    assert "data servers [0, 1] answered: not lost" in caplog.text


def test_two_data_servers_silent_together_keep_their_roles_where_a_promotion_would_lose_a_shard(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Of 3 data servers, 1 and 2 silent together: data server 1's replica is held by data server 2, so
    promoting both would lose shard 1 (the job would fail without a checkpoint). Data server 1 is asked,
    answers once woken, and keeps its role; data server 2 keeps its role too, or (seen silent first, a
    heartbeat before the other, with its replica on data server 0) is promoted to the standby. The
    coordinator, never silent, stays where it is."""
    freeze, job, result = run_frozen(cluster, "silent-shards", (1, 2), digits_url, data_servers=3)

    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    first, last = freeze.first, freeze.last
    assert first is not None and last is not None and len(freeze.frozen) == 2
    assert len(first.data_servers) == 3 and first.coordinator_at not in freeze.frozen
    assert last.data_servers[:2] == first.data_servers[:2] and last.coordinator_at == first.coordinator_at
    kept = {int(e.reason.split()[2]) for e in result.events if e.kind is EventKind.KEPT}
    promoted = {int(e.reason.split()[2]) for e in result.events if e.kind is EventKind.PROMOTED}
    assert 1 in kept and kept | promoted == {1, 2} and not kept & promoted, (kept, promoted)
    assert result.counters["promotions"] == len(promoted)
    assert (last.data_servers[2] == first.data_servers[2]) == (2 in kept)
    assert EventKind.COORDINATOR_REBUILT not in [e.kind for e in result.events]
