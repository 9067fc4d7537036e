"""The data servers stream their partitions (`data_server/partition.py`: batches read `prefetch_batches`
ahead, within `data_cache_bytes` of decoded blocks) through the faults and the limits of real processes:

- a data server's static worker SIGKILLed while it reads Parquet row groups through a cache of three: its
  standby takes the role and reads on, and the result is the one-worker, no-fault run's bits;
- a checkpointed Parquet run stopped in the middle of an epoch and run again: the resumed run trains only
  the batch ids after the checkpoint, and ends with the uninterrupted run's bits;
- static workers started with `dask worker --memory-limit 1GB` and a nanny (which kills a worker over 95%
  of it) train through 2.1 GB of Parquet that their one data server streams, with no static worker lost,
  to the one-worker run's bits (whose batches of 32 MiB an answer go through sockets: a push behind such
  an answer unread stood still until the call timeout, which an in-process test here shows too).

The model of the last test (`wide_linear`) is named by import path from this module, which worker processes
then import: the suite's helpers are imported inside the tests, so that those processes never import
tests/conftest.py (which points the signal files of `tests.models` elsewhere, and imports Prefect).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from torch import nn

from prefect_elastic import ElasticJob, TrainingStopped, train
from prefect_elastic.checkpoint import CheckpointStore
from prefect_elastic.compute import Pipelined
from prefect_elastic.data.batches import BatchMaker
from prefect_elastic.data.columns import ColumnarSource
from prefect_elastic.messages import EventKind, Progress
from prefect_elastic.training.prepare import prepare
from prefect_elastic.wire import Entry, Frame, ShardLink, ShardServer, memfd

from .cli_cluster import CliCluster
from .data_helpers import write_digits_parquet

if TYPE_CHECKING:
    from prefect_elastic.local.cluster import LocalElasticCluster

    from .conftest import References

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# The digits in row groups of 50 rows (36 blocks of 13,200 bytes decoded); a reader keeps three of them,
# so a batch of 16 samples drawn from a partition's 18 blocks decodes most of its blocks again.
ROW_GROUP = 50
SMALL_CACHE = 3 * ROW_GROUP * (64 * 4 + 8)


@pytest.fixture(scope="module")
def blocks_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_digits_parquet(tmp_path_factory.mktemp("streamed"), files=3, row_group=ROW_GROUP)


def streamed_job(url: str, policy: str, **overrides: object) -> ElasticJob:
    from .conftest import make_job

    fields: dict[str, object] = {"data_cache_bytes": SMALL_CACHE, "prefetch_batches": 2, **overrides}
    return make_job(url, policy, **fields)


def test_the_reader_streams_the_partition_through_a_cache_of_three_blocks(blocks_url: str) -> None:
    """(In this process, the premise of the next tests: a data server's reader lets blocks go and reads them
    again, never holding more than its bound.)"""
    prepared = prepare(streamed_job(blocks_url, "reassign", job_id="stream-premise"))
    maker = BatchMaker(prepared.batches)
    try:
        assert isinstance(maker.source, ColumnarSource)
        cache = maker.source.cache
        for b in (1, 3, 5, 7):  # data server 1's first batches
            maker.make(b)
            assert 0 < cache.cached_bytes <= SMALL_CACHE
        assert cache.loads > 18, "the partition's 18 blocks were let go and read again"
    finally:
        maker.close()


def test_a_push_behind_an_unread_answer_larger_than_the_sockets_buffers_goes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(In this process, no cluster.) A loop asks a shard for its next step's batches before the step
    computes, and pushes the step before reading them. Through a socket (here: shared memory off), batches
    larger than the sockets' buffers (4 MiB each way) used to stand the step still: the shard, writing its
    answer whole before it reads again, waited for the loop to read it, and the loop, writing its push,
    waited for the shard, until the call timeout (the reference run of the memory-limit test below, step
    after step). `Pipelined.deliver` reads what is unread before it pushes."""
    monkeypatch.setenv(memfd.ENV, "0")
    batch = torch.zeros(2**23)  # 32 MiB, as the memory-limit test's answers of 8 batches

    async def shard(frame: Frame) -> Frame:
        return Frame({"ok": True}, [(Entry("field", 0, "x"), batch)] if frame.header["op"] == "ahead" else [])

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ShardServer(shard)
    try:
        address = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1"), loop).result(5)
        link = ShardLink(address, timeout=5)
        link.send(Frame({"op": "ahead"}))
        push = Frame({"op": "push"}, [(Entry("grad", 0, "w"), torch.ones(2**22))])  # 16 MiB
        began = time.monotonic()
        answers = Pipelined().deliver([link], [push], 1, 0, (), [False], 1.0, 5.0)
        assert time.monotonic() - began < 4.0
        assert [len(a.tensors) for a in answers] == [1, 0] and link.pending == 0
        assert torch.equal(answers[0].tensors[0][1], batch)
        link.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.aclose(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.parametrize("policy", ["rollback", "reassign"])
def test_a_data_server_killed_while_it_streams_parquet_is_promoted_on_a_standby(
    static_cluster: LocalElasticCluster, reference: References, blocks_url: str, policy: str
) -> None:
    from .conftest import top_up
    from .test_static_roles import promoted_on_a_standby, top_up_static

    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    # (4 epochs, as tests/test_static_roles.py has it: the shards run ahead of the progress the gate closes
    # on, and a shorter job could end before the kill at step 12.)
    job = streamed_job(
        blocks_url, policy, model="tests.models:gated_slow_mlp", epochs=4, job_id=f"stream-standby-{policy}"
    )
    promoted_on_a_standby(static_cluster, reference, job)


def test_a_checkpointed_run_stopped_mid_epoch_resumes_with_nothing_trained_twice(
    static_cluster: LocalElasticCluster, reference: References, blocks_url: str, tmp_path: Path
) -> None:
    from .conftest import assert_ledger_exactly_once, assert_same_parameters, top_up
    from .test_static_roles import top_up_static

    top_up(static_cluster, 2)
    top_up_static(static_cluster, 3)
    job = streamed_job(
        blocks_url,
        "reassign",
        model="tests.data_helpers:digits_flat_mlp",
        epochs=2,
        checkpoint=f"file://{tmp_path}/ckpt",
        checkpoint_every=2,
        checkpoint_keep=2,
        liveness_interval=0.3,
        job_id="stream-resume",
    )
    schedule = prepare(job).schedule
    per_epoch = schedule.total_steps // 2
    stop = threading.Event()

    def stop_at(progress: Progress) -> None:
        if progress.committed_steps >= 10:  # (of 28 an epoch: the stop lands a few steps later)
            stop.set()

    with pytest.raises(TrainingStopped) as stopped:
        train(job, cluster=static_cluster, stop=stop, on_progress=stop_at)
    found = CheckpointStore(str(job.checkpoint)).latest()
    assert found is not None and found[1] == stopped.value.checkpoint
    saved = found[0]
    at, per_step = saved.committed_steps, schedule.micro_batches
    assert at % per_epoch and 0 < at < schedule.total_steps, f"stopped at step {at}: not mid-epoch"
    assert [e.batch_id for e in saved.ledger] == list(range(at * per_step))

    result = train(job, cluster=static_cluster)
    assert result.resumed_from == stopped.value.checkpoint
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    # The checkpoint's entries are carried over as they were; every later one was committed by the resumed
    # run, whose loops trained none of the steps before the checkpoint (they started at its step).
    carried, resumed = result.ledger[: len(saved.ledger)], result.ledger[len(saved.ledger) :]
    assert carried == saved.ledger
    assert [e.batch_id for e in resumed] == list(range(at * per_step, schedule.total_batches))
    assert all(e.step >= at and e.generation > saved.generation for e in resumed)
    starts = [e for e in result.events if e.kind == EventKind.START]
    assert [e.step for e in starts] == [at]
    assert not [e for e in result.events if e.kind in (EventKind.ROLLBACK, EventKind.REASSIGN)]
    assert result.loops and all(loop.steps <= schedule.total_steps - at for loop in result.loops)


# The last test's samples: 2**17 float32 features (512 KiB) each, 4,000 of them in row groups of 8 (4 MiB):
# 2.1 GB of Parquet, which its one data server streams through a static worker limited to 1 GB. (Measured
# here: a `dask worker` holds 410 MiB once the engine is loaded and its data server started, and 740 MiB at
# most while it serves this job; the nanny kills it at 95% of the limit, 906 MiB, and Dask pauses it at 80%.)
FEATURES = 2**17
SAMPLES = 4000
WIDE_ROW_GROUP = 8
MEMORY_LIMIT = "1GB"


def wide_linear() -> nn.Module:
    """The model of the wide samples: (N, 2**17) floats into 4 classes."""
    return nn.Sequential(nn.Linear(FEATURES, 4))


def write_wide_parquet(folder: Path, files: int = 2) -> str:
    """`SAMPLES` random samples of `FEATURES` float32 in row groups of `WIDE_ROW_GROUP`, uncompressed (random
    numbers do not compress), label y in 0..3: a few seconds. Each row group is a window of a pool of random
    rows (drawing every number would take longer than writing them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4 * WIDE_ROW_GROUP + 1, FEATURES), dtype=np.float32)
    schema = pa.schema([("x", pa.list_(pa.float32(), FEATURES)), ("y", pa.int64())])
    folder.mkdir(parents=True, exist_ok=True)
    groups = SAMPLES // WIDE_ROW_GROUP
    for f in range(files):
        options = {"compression": "none", "use_dictionary": False, "write_statistics": False}
        with pq.ParquetWriter(folder / f"part-{f}.parquet", schema, **options) as writer:
            for g in range(f * groups // files, (f + 1) * groups // files):
                start = g % (3 * WIDE_ROW_GROUP + 1)
                x = pa.FixedSizeListArray.from_arrays(
                    pool[start : start + WIDE_ROW_GROUP].reshape(-1), FEATURES
                )
                y = rng.integers(0, 4, size=WIDE_ROW_GROUP)
                writer.write_table(pa.table({"x": x, "y": y}), row_group_size=WIDE_ROW_GROUP)
    return f"file://{folder}"


def make_wide_job(url: str) -> ElasticJob:
    """One epoch of 63 steps of 8 micro-batches of 8 wide samples (4 MiB each), all from one data server,
    shuffled by blocks: a batch reads from at most two runs of 2 row groups, so a cache of 5 reads each row
    group once."""
    from .conftest import make_job

    return make_job(
        url,
        "reassign",
        model="tests.test_data_streaming:wide_linear",
        batch_size=8,
        micro_batches=8,
        epochs=1,
        data_servers=1,
        shuffle="blocks",
        shuffle_window=2,
        data_cache_bytes=20 * 2**20,
        prefetch_batches=2,
        job_id="stream-memory-limit",
    )


class PeakRss:
    """The largest resident set of each static worker's processes (its nanny's children), sampled every
    50 ms in a thread while the block runs."""

    def __init__(self, cluster: CliCluster, names: list[str]) -> None:
        import psutil

        self.roots = {name: psutil.Process(cluster.procs[name].pid) for name in names}
        self.peak: dict[str, int] = dict.fromkeys(names, 0)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        while not self._done.wait(0.05):
            for name, root in self.roots.items():
                try:
                    for p in [root, *root.children(recursive=True)]:
                        self.peak[name] = max(self.peak[name], p.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.heavy  # (2.1 GB written and read: most of a minute; .ci/run runs it after the main suite)
def test_static_workers_with_a_memory_limit_below_their_partition_train_through_it(
    reference: References, tmp_path: Path
) -> None:
    from dask.utils import parse_bytes

    from .conftest import assert_ledger_exactly_once, assert_same_parameters

    began = time.monotonic()
    url = write_wide_parquet(tmp_path / "wide")
    written = time.monotonic() - began
    try:
        job = make_wide_job(url)
        limit = parse_bytes(MEMORY_LIMIT)
        assert prepare(job).dataset.length * FEATURES * 4 > 2 * limit, "the partition is twice the limit"
        with CliCluster(static=2, elastic=2, nanny=True, memory_limit=MEMORY_LIMIT) as cluster:
            static = ("static-0", "static-1")
            before = {n: a for n, a in cluster.workers().items() if n in static}
            with PeakRss(cluster, list(static)) as rss:
                result = train(job, address=cluster.address)
            after = {n: a for n, a in cluster.workers().items() if n in static}
            restarts = [
                n for n in static if "memory budget" in cluster.log(n) or "Restarting" in cluster.log(n)
            ]
        expected = reference(job)
    finally:
        shutil.rmtree(tmp_path / "wide", ignore_errors=True)
    peaks = {n: f"{b / 2**20:.0f} MiB" for n, b in rss.peak.items()}
    print(
        f"written in {written:.1f} s, trained in {result.elapsed:.1f} s; the static workers' peaks: {peaks}"
    )
    assert_same_parameters(result, expected)
    assert_ledger_exactly_once(result)
    assert after == before and not restarts, f"a static worker was restarted: {restarts or after}"
    assert EventKind.SHARD_LOST not in {e.kind for e in result.events} and result.counters["promotions"] == 0
    assert max(rss.peak.values()) < 0.95 * limit, f"over the nanny's bound: {peaks}"
