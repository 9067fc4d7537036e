"""LocalElasticCluster with real scheduler and worker processes, killed with real signals."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest

from prefect_elastic.local.cluster import LocalElasticCluster

pytestmark = pytest.mark.cluster


def _wait_pid_gone(pid: int, timeout: float = 10.0) -> None:
    # A SIGKILLed nanny's worker child is reparented and reaped by init; until then it is a zombie that
    # os.kill(pid, 0) still finds, so poll instead of checking once.
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"process {pid} is still alive {timeout} s after it should have ended")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalElasticCluster]:
    with LocalElasticCluster(static_workers=1, elastic_workers=2, memory_limit="1GiB") as c:
        yield c


@pytest.mark.timeout(120)
def test_names_and_resources_as_the_scheduler_sees_them(cluster: LocalElasticCluster) -> None:
    assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    assert "static-0" in cluster.worker_names(static=True)
    assert {"elastic-0", "elastic-1"} <= set(cluster.worker_names(static=False))
    # Ask through an independent client: what the rest of the system sees, not this object's bookkeeping.
    with cluster.client() as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    by_name = {info["name"]: (addr, info) for addr, info in workers.items()}
    assert by_name["static-0"][1]["resources"] == {"static": 1.0}
    for name in ("elastic-0", "elastic-1"):
        addr, info = by_name[name]
        assert info["resources"] == {}
        assert info["nthreads"] == 1
        assert addr in cluster.elastic_addresses()
        assert cluster.address_of(name) == addr
    assert by_name["static-0"][0] not in cluster.elastic_addresses()
    assert cluster.address_of("no-such-worker") is None


@pytest.mark.timeout(120)
def test_sigkill_without_restart_removes_the_worker_and_its_processes(cluster: LocalElasticCluster) -> None:
    name = cluster.add_worker()
    nanny_pid = cluster.pid_of(name)
    worker_pid = cluster.worker_pid(name)
    assert nanny_pid is not None and nanny_pid != worker_pid

    cluster.kill_worker(name, signal.SIGKILL)
    cluster.wait_until_gone([name], timeout=10)

    assert name not in cluster.worker_names()
    _wait_pid_gone(nanny_pid)
    _wait_pid_gone(worker_pid)


@pytest.mark.timeout(120)
def test_kill_with_restart_brings_back_the_same_name_at_a_new_address(cluster: LocalElasticCluster) -> None:
    name = cluster.add_worker()
    old_address = cluster.address_of(name)
    assert old_address is not None
    nanny_pid = cluster.pid_of(name)
    old_worker_pid = cluster.worker_pid(name)

    cluster.kill_worker(old_address, signal.SIGKILL, restart=True)
    new_address = cluster.wait_for_restart(name, old_address, timeout=30)

    assert new_address != old_address
    assert cluster.address_of(name) == new_address
    assert name in cluster.worker_names(static=False)
    _wait_pid_gone(old_worker_pid)
    assert cluster.worker_pid(name) != old_worker_pid
    assert cluster.pid_of(name) == nanny_pid  # the same nanny did the restart
    os.kill(nanny_pid, 0)


@pytest.mark.timeout(120)
def test_add_worker_registers_an_elastic_or_static_worker(cluster: LocalElasticCluster) -> None:
    elastic = cluster.add_worker()
    static = cluster.add_worker(static=True)

    assert elastic.startswith("elastic-") and static.startswith("static-")
    assert elastic in cluster.worker_names(static=False)
    assert static in cluster.worker_names(static=True)
    info = cluster.workers_info()
    assert info[cluster.address_of(static) or ""]["resources"] == {"static": 1.0}
    assert info[cluster.address_of(elastic) or ""]["resources"] == {}

    # A name is never reused, even after its worker is gone.
    cluster.kill_worker(elastic)
    cluster.wait_until_gone([elastic], timeout=10)
    again = cluster.add_worker(wait=False)
    assert again != elastic
    cluster.wait_for_workers([again], timeout=30)


@pytest.mark.timeout(120)
def test_retire_worker_removes_it_and_its_processes(cluster: LocalElasticCluster) -> None:
    name = cluster.add_worker()
    nanny_pid = cluster.pid_of(name)
    worker_pid = cluster.worker_pid(name)
    assert nanny_pid is not None

    cluster.retire_worker(name, timeout=30)

    assert name not in cluster.worker_names()
    _wait_pid_gone(nanny_pid)
    _wait_pid_gone(worker_pid)


@pytest.mark.timeout(120)
def test_bad_worker_option_fails_startup_with_the_log_tail() -> None:
    cluster = LocalElasticCluster(0, 1, memory_limit="not-a-size", startup_timeout=30)
    with pytest.raises(RuntimeError, match=r"elastic-0.*\n.*last \d+ lines") as excinfo:
        cluster.start()
    assert "memory_limit" in str(excinfo.value)
    # start() cleans up after itself: the scheduler it had started is gone.
    assert cluster.scheduler_pid is not None
    _wait_pid_gone(cluster.scheduler_pid)


@pytest.mark.timeout(120)
def test_no_nanny_cluster_passes_env_and_path_and_close_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module importable only through this process's sys.path: the workers must import it by name.
    (tmp_path / "pe_cluster_probe.py").write_text(
        "import os\n\ndef probe():\n    return os.environ.get('PE_CLUSTER_PROBE'), os.getpid()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import pe_cluster_probe

    cluster = LocalElasticCluster(
        1, 1, nanny=False, env={"PE_CLUSTER_PROBE": "yes"}, memory_limit="1GiB", worker_ttl="7s"
    )
    with cluster:
        assert sorted(cluster.worker_names()) == ["elastic-0", "static-0"]
        with cluster.client() as client:
            value, pid = client.submit(pe_cluster_probe.probe, pure=False).result(timeout=30)
            ttl = client.run_on_scheduler(lambda: dask.config.get("distributed.scheduler.worker-ttl"))
        assert value == "yes"
        assert ttl == "7s"
        assert pid in {cluster.worker_pid(n) for n in cluster.worker_names()}
        with pytest.raises(ValueError, match="nanny=True"):
            cluster.kill_worker("elastic-0", restart=True)
        assert cluster.scheduler_pid is not None
        pids = [cluster.scheduler_pid]
        pids += [cluster.worker_pid(n) for n in cluster.worker_names()]
        assert cluster.pid_of("elastic-0") == cluster.worker_pid("elastic-0")  # no nanny in between
    for pid in pids:
        _wait_pid_gone(pid)
    cluster.close()  # idempotent
    assert cluster.log_dir is not None and (cluster.log_dir / "scheduler.log").exists()
    with pytest.raises(RuntimeError, match="closed"):
        cluster.add_worker()


def _import_on_worker(module: str) -> tuple[str, list[str]]:
    import importlib

    return str(importlib.import_module(module).VALUE), os.environ["PYTHONPATH"].split(os.pathsep)


@pytest.mark.timeout(120)
def test_pythonpath_given_in_env_comes_before_this_process_path(tmp_path: Path) -> None:
    # A module importable only through the PYTHONPATH given to the cluster, not through this process's
    # sys.path; the function that imports it is this test module's, found through this process's sys.path.
    user_path = tmp_path / "user-path"
    user_path.mkdir()
    (user_path / "pe_user_path_probe.py").write_text("VALUE = 'from the user path'\n")
    with pytest.raises(ImportError):
        __import__("pe_user_path_probe")

    cluster = LocalElasticCluster(0, 1, nanny=False, env={"PYTHONPATH": str(user_path)}, memory_limit="1GiB")
    with cluster, cluster.client() as client:
        future = client.submit(_import_on_worker, "pe_user_path_probe", pure=False)
        value, pythonpath = future.result(timeout=30)
    assert value == "from the user path"
    rootdir = str(Path(__file__).resolve().parents[1])
    assert pythonpath[0] == str(user_path), "the given entries first"
    assert rootdir in pythonpath, "then this process's sys.path"
