"""A worker's CPU share read in real cgroups (the quota `docker run --cpus` and Kubernetes CPU limits set),
and the engine's default for the overlapped step deciding by it on a cluster started by `dask worker`.
Makes cgroups of this machine's cpu hierarchy: needs root, as the netns and Docker tests do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from prefect_elastic import train
from prefect_elastic.cluster import CpuShare, machine_cores

from .cli_cluster import CPU_SHARE_PROBE, CliCluster, cpu_quota_cgroup, in_cgroup, probed_share
from .conftest import assert_ledger_exactly_once, make_job
from .test_overlap_push import cores_here


def share_in(cgroup: Path | None) -> CpuShare:
    """`cpu_share` as a process started in `cgroup` (None: where this one runs) reads it."""
    command = [sys.executable, "-c", CPU_SHARE_PROBE]
    done = subprocess.run(
        command if cgroup is None else in_cgroup(cgroup, command),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return probed_share(done.stdout)


def test_a_process_reads_its_cgroups_quota_and_processes_of_one_cgroup_share_it() -> None:
    with cpu_quota_cgroup(1.5) as one, cpu_quota_cgroup(0.5) as other:
        first, second, apart, outside = share_in(one), share_in(one), share_in(other), share_in(None)
        stat = one.stat()
    assert first.quotas == ((f"{stat.st_dev}:{stat.st_ino}", 1.5),), first
    assert second == first
    assert apart.quota == 0.5 and apart.quotas[0][0] != first.quotas[0][0], apart
    # A process elsewhere is in neither cgroup.
    assert not {g for g, _ in outside.quotas} & {first.quotas[0][0], apart.quotas[0][0]}, outside
    assert first.cpus == frozenset(os.sched_getaffinity(0))
    assert first.machine == Path("/proc/sys/kernel/random/boot_id").read_text().strip() == apart.machine
    at = {"a": "box", "b": "box", "c": "box"}
    # Two workers of one cgroup share its quota; a third in a cgroup of its own adds its quota.
    assert machine_cores({"a": first, "b": second}, at) == {"box": 1.5}
    assert machine_cores({"a": first, "b": second, "c": apart}, at) == {"box": min(2.0, len(first.cpus))}


@pytest.mark.parametrize(
    "quota,elastic_host",
    [(1.5, ""), (None, ""), (1.5, "127.0.0.2")],
    ids=["quota-1.5-cores", "no-quota", "quota-1.5-cores-loop-at-another-address"],
)
def test_left_to_the_engine_a_big_model_pushes_whole_where_the_workers_cgroup_allows_too_little_cpu(
    digits_url: str, quota: float | None, elastic_host: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`overlap_push=None`, a model of 19 MB on one data server (`min_shard_bytes` 16 MiB) and one compute
    loop of one thread: they want 2 cores. Started by `dask worker` in a cgroup whose quota gives them 1.5
    cores' worth of CPU time (every core in their CPU set), the engine pushes whole; with no quota, by
    their CPU set alone. The compute worker listening on another address (as a container with a network
    of its own has) is on the same machine all the same: its kernel's boot id says so."""
    job = make_job(
        digits_url, "reassign", model="tests.models:big_mlp", overlap_push=None, overlap_pull=None, epochs=1,
        min_shard_bytes=16 * 2**20, job_id=f"cli-quota-{quota}",
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="prefect_elastic.training.actors")
    with ExitStack() as stack:
        cgroup = None if quota is None else stack.enter_context(cpu_quota_cgroup(quota))
        cluster = stack.enter_context(
            CliCluster(static=2, elastic=1, cgroup=cgroup, elastic_host=elastic_host)
        )
        if elastic_host:
            assert any(a.startswith(f"tcp://{elastic_host}:") for a in cluster.workers().values())
        # (What the workers may use: inside a quota of this process's too, if any.)
        share = share_in(cgroup)
        cores = cores_here(share)
        assert quota is None or (share.quota is not None and share.quota <= quota), share
        result = train(job, address=cluster.address)
    assert_ledger_exactly_once(result)
    trained = [loop for loop in result.loops if loop.steps]
    assert trained, result.loops
    if cores < 2:
        assert all(loop.parts == 0 for loop in trained), result.loops
        # The controller says where, and why: what the loop and the data server want against what is there.
        assert f"(2 wanted, {cores:g} there)" in caplog.text, caplog.text
    else:
        assert all(loop.parts >= 2 * loop.steps for loop in trained), result.loops
