"""The engine's promises on clusters started as a user starts them: `dask scheduler` and `dask worker` from
the command line, with or without a nanny, no preload and no harness settings (`tests/cli_cluster.py`).

- A run with no fault reports no membership change but its start and its end: no worker is taken for lost
  while it imports torch (which a plain `dask worker` does at its first task).
- A static worker SIGKILLed while the job starts (its data server being made) is survived: the start is
  tried again on the static workers left, and the result is the one-worker, no-fault run's.
- A layer split across both data servers, read in place and joined by loops on the shards' machine (whole,
  or bucket by bucket during forward with the gradients leaving during backward), through a SIGKILLed
  compute worker and one added: the one-worker, no-fault run's bits.
- A big model's `overlap_push` left to the engine is decided from the workers' cores, as on the harness's
  cluster.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from prefect_elastic import TrainResult, train
from prefect_elastic.errors import ElasticError
from prefect_elastic.messages import EventKind, Progress

from .cli_cluster import CliCluster
from .conftest import assert_ledger_exactly_once, assert_same_state, make_job, wait_for
from .test_async import check_async
from .test_overlap_push import assert_pushed_as_the_cores_allow, default_overlap_job
from .test_split import BIG, WIDE, holders_of


@pytest.mark.parametrize("nanny", [False, True], ids=["no-nanny", "nanny"])
def test_a_run_with_no_fault_reports_no_membership_change_but_its_start_and_end(
    digits_url: str, reference: Any, nanny: bool
) -> None:
    job = make_job(digits_url, epochs=1, job_id=f"cli-quiet-{nanny}")
    with CliCluster(static=2, elastic=2, nanny=nanny) as cluster:
        result = train(job, address=cluster.address)
    kinds = [e.kind for e in result.events]
    # Snapshots are not membership changes; a worker taken for lost at the start was a rollback, a waiting
    # and a second start (before `connect.load_engine`).
    changes = [k for k in kinds if k is not EventKind.SNAPSHOT]
    assert changes == [EventKind.START, EventKind.DONE], result.events
    assert len(result.events[0].workers) == 2  # both compute workers from the start
    assert result.counters["rollbacks"] == result.counters["reassigns"] == 0
    assert_ledger_exactly_once(result)
    assert_same_state(result.state_dict, reference(job).state_dict)


class KillAndAdd:
    """`on_progress`: SIGKILLs the compute worker `elastic-0` once step `at` is committed, and starts
    `elastic-2` in its place."""

    def __init__(self, cluster: CliCluster, at: int = 8) -> None:
        self.cluster, self.at = cluster, at
        self.killed_at = -1

    def __call__(self, progress: Progress) -> None:
        if self.killed_at < 0 and progress.committed_steps >= self.at:
            self.killed_at = progress.committed_steps
            self.cluster.kill("elastic-0")
            self.cluster.add_worker("elastic-2", wait=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "buckets"])
def test_a_layer_split_across_data_servers_trains_to_one_workers_bits_through_a_kill_and_a_join(
    digits_url: str, reference: Any, overlap: bool
) -> None:
    """Each data server holds part of the 256 KB layer; every loop runs on their machine, reads the halves in
    place and joins them into the tensor it keeps from step to step (`compute/bucket_pull.py`)."""
    job = make_job(
        digits_url, "reassign", model=WIDE, epochs=3, overlap_push=overlap, overlap_pull=overlap,
        job_id=f"cli-split-{overlap}",
    )  # fmt: skip
    with CliCluster(static=2, elastic=2) as cluster:
        kill = KillAndAdd(cluster)
        result = train(job, address=cluster.address, on_progress=kill)
    assert kill.killed_at >= 8, "the job ended before the kill"
    assert holders_of(result, BIG) == [0, 1], result.shard_plan
    assert [e for e in result.membership_events() if e.left], "the killed worker left"
    assert_ledger_exactly_once(result)
    assert_same_state(result.state_dict, reference(job).state_dict)
    if overlap:
        assert sum(loop.pulled for loop in result.loops) > 0, result.loops


def test_left_to_the_engine_a_big_model_pushes_as_the_machines_cores_allow(digits_url: str) -> None:
    """`overlap_push=None` on workers started by `dask worker`: the controller reads their CPU sets (a call to
    each, with nothing of the engine to import) and decides as on a `LocalElasticCluster`."""
    with CliCluster(static=2, elastic=2) as cluster:
        result = train(default_overlap_job(digits_url, "cli-overlap-auto"), address=cluster.address)
    assert_ledger_exactly_once(result)
    assert_pushed_as_the_cores_allow(result, loops=2)


def _data_server_started_on(cluster: CliCluster, worker: str) -> bool:
    """Whether the scheduler has sent the worker `worker` the task that makes a data server."""

    def on_scheduler(dask_scheduler: Any, address: str) -> bool:
        ws = dask_scheduler.workers.get(address)
        return ws is not None and any("data-server" in str(ts.key) for ts in ws.processing)

    with cluster.client() as client:
        address = cluster.workers()[worker]
        return bool(client.run_on_scheduler(on_scheduler, address=address))


@pytest.mark.heavy
@pytest.mark.parametrize(
    "mode,policy", [("sync", "rollback"), ("sync", "reassign"), ("async", "reassign")], ids=lambda v: v
)
def test_a_static_worker_sigkilled_during_the_start_is_survived(
    digits_url: str, reference: Any, mode: str, policy: str
) -> None:
    # (Async mode: epochs enough for its loss to fall as far as `check_async` asks.)
    epochs = 1 if mode == "sync" else 3
    job = make_job(digits_url, policy, epochs=epochs, mode=mode, job_id=f"cli-start-{mode}-{policy}")
    # 3 static workers: data server 0 and the coordinator on static-0, data server 1 on static-1, a standby.
    with CliCluster(static=3, elastic=2) as cluster:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = train(job, address=cluster.address)
            except BaseException as exc:  # (asserted below)
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        # The worker with the most roles, killed while its data server is being made: before any step.
        wait_for(
            "data server 0's start on static-0",
            lambda: _data_server_started_on(cluster, "static-0"),
            poll=0.05,
        )
        cluster.kill("static-0")
        thread.join(timeout=240)
        assert not thread.is_alive(), "train() hung after a static worker died during the start"
    error = outcome.get("error")
    assert error is None or isinstance(error, ElasticError), repr(error)
    assert error is None, f"the start was not tried again on the static workers left: {error!r}"
    result: TrainResult = outcome["result"]
    assert result.events[0].kind is EventKind.START and result.events[0].step == 0
    if mode == "sync":
        assert_ledger_exactly_once(result)
        assert_same_state(result.state_dict, reference(job).state_dict)
    else:
        check_async(result, reference(job.model_copy(update={"mode": "sync"})))


class FreezeDataServer:
    """`on_progress`: once step `at` is committed and snapshotted, SIGSTOPs the static worker of data server
    `index` and SIGCONTs it `seconds` later; records the committed steps then and at the wake-up."""

    def __init__(self, cluster: CliCluster, index: int, seconds: float, at: int = 8) -> None:
        self.cluster, self.index, self.seconds, self.at = cluster, index, seconds, at
        self.frozen = ""  # the worker's name
        self.at_freeze = self.at_wake = -1
        self.last: Progress | None = None
        self.wake = threading.Timer(seconds, self.wake_up)

    def wake_up(self) -> None:
        if self.frozen:
            self.at_wake = self.last.committed_steps if self.last is not None else -1
            self.cluster.kill(self.frozen, signal.SIGCONT)

    def __call__(self, progress: Progress) -> None:
        self.last = progress
        if self.frozen or progress.snapshot_step < self.at:
            return
        names = {address: name for name, address in self.cluster.workers().items()}
        self.frozen = names[progress.data_servers[self.index]]
        self.at_freeze = progress.committed_steps
        self.cluster.kill(self.frozen, signal.SIGSTOP)
        self.wake.start()


@pytest.mark.heavy
def test_a_data_servers_worker_frozen_for_longer_than_call_timeout_costs_no_more_than_a_killed_one(
    digits_url: str, reference: Any
) -> None:
    """3 static workers; the one that holds only data server 1 is frozen (SIGSTOP) for longer than the call
    timeout. Its role goes to the standby within seconds, and the compute loops leave their connections to
    it at once (`compute.leave_links`): a frozen process's kernel keeps them open, and before, every loop
    waited out its call timeout there (the job stood still for the whole freeze)."""
    job = make_job(digits_url, epochs=4, call_timeout=10.0, job_id="cli-frozen-data-server")
    with CliCluster(static=3, elastic=2) as cluster:
        freeze = FreezeDataServer(cluster, index=1, seconds=12.0)
        try:
            result = train(job, address=cluster.address, on_progress=freeze)
        finally:
            freeze.wake.cancel()
            freeze.wake_up()
    assert freeze.frozen == "static-1"
    assert_same_state(result.state_dict, reference(job).state_dict)
    assert_ledger_exactly_once(result)
    assert EventKind.PROMOTED in [e.kind for e in result.events], "data server 1's role went to the standby"
    assert freeze.at_wake > freeze.at_freeze, "steps were committed while the worker was frozen"
    assert sum(loop.timeouts for loop in result.loops) == 0, "a compute loop waited out its call timeout"
