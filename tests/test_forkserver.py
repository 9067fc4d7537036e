"""The fork server the test suite's clusters start their workers from: each worker is a process of its own,
in a session of its own, with its own environment, directory and import path, that real signals end and
whose end its handle reports; the server's end ends its workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prefect_elastic.local import forkserver
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.forkserver import FORKED_IMPORTS, ForkedProcess, ForkServer
from prefect_elastic.local.launch import PARENT_ENV

pytestmark = pytest.mark.cluster


def _identity() -> tuple[int, int, str, str, list[str], bool]:
    import sys as sys_

    return (
        os.getpid(),
        os.getsid(0),
        os.getcwd(),
        os.environ.get("FORK_TEST_MARK", ""),
        list(sys_.path),
        "torch._dynamo" in sys_.modules,
    )


def _wait_gone(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() >= deadline:
            raise AssertionError(f"process {pid} still runs {timeout} s after its parent was killed")
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_two_clusters_fork_their_workers_from_one_server_each_with_its_own_settings(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    clusters = [
        LocalElasticCluster(
            1, 1, nanny=nanny, fork_server=True, env={"FORK_TEST_MARK": mark, "PYTHONPATH": str(extra)}
        )
        for nanny, mark in ((True, "a"), (False, "b"))
    ]
    with clusters[0] as first, clusters[1] as second:
        server = forkserver.shared_fork_server({}, os.getcwd())
        for cluster, mark in ((first, "a"), (second, "b")):
            with cluster.client() as client:
                seen = client.run(_identity)
            assert len(seen) == 2
            for pid, sid, cwd, worker_mark, path, dynamo in seen.values():
                # Its own session (a signal to its group reaches nothing else), environment and path; the
                # imports done before the fork.
                assert sid != os.getsid(0)
                assert cwd == os.getcwd()
                assert worker_mark == mark
                # (Dask puts the worker's local directories first, as for any worker.)
                start = path.index(os.getcwd())
                assert path[start : start + 2] == [os.getcwd(), str(extra)]
                assert dynamo
                # A nanny's worker is its child; a worker without one, the server's.
                leader = psutil.Process(pid) if cluster is second else psutil.Process(pid).parent()
                assert leader is not None
                parent = leader.parent()
                assert parent is not None and parent.pid == server.pid


@pytest.mark.timeout(180)
def test_a_forked_worker_killed_is_reported_with_its_signal_and_restarted_by_its_nanny() -> None:
    with LocalElasticCluster(0, 2, fork_server=True) as cluster:
        leader = cluster._processes.worker("elastic-0")
        assert isinstance(leader, ForkedProcess)
        # Only its worker process: the nanny starts it again, forked from itself.
        old = cluster.worker_pid("elastic-0")
        cluster.kill_worker("elastic-0", restart=True)
        _wait_gone(old)
        deadline = time.monotonic() + 60
        while True:
            try:
                new = cluster.worker_pid("elastic-0")
            except (KeyError, ValueError, RuntimeError):
                new = old
            if new != old:
                break
            assert time.monotonic() < deadline, "the nanny did not start its worker again"
            time.sleep(0.2)
        assert psutil.Process(new).parent().pid == leader.pid  # type: ignore[union-attr]
        # The whole group, for good: the handle reports the signal as `Popen` would.
        cluster.kill_worker("elastic-0")
        assert leader.wait(timeout=10) == -signal.SIGKILL
        cluster.wait_until_gone(["elastic-0"], timeout=60)
        _wait_gone(new)
        assert cluster.worker_names(static=False) == ["elastic-1"]


@pytest.mark.timeout(180)
def test_the_fork_servers_end_ends_the_workers_it_forked(tmp_path: Path) -> None:
    # A fork server of its own: the session's serves every other cluster of this test run.
    with LocalElasticCluster(0, 0, fork_server=True) as cluster:
        assert cluster.log_dir is not None
        server = ForkServer(FORKED_IMPORTS, log=tmp_path / "fs.log", env=dict(os.environ), cwd=os.getcwd())
        server.start()
        try:
            worker = server.spawn(
                ["distributed.cli.dask_worker", cluster.scheduler_address, "--name", "private-0",
                 "--nthreads", "1", "--no-nanny", "--no-dashboard",
                 "--preload", str(cluster.log_dir / "parent_watchdog.py")],
                env={**os.environ, PARENT_ENV: str(server.pid)},
                log=tmp_path / "worker.log",
                cwd=os.getcwd(),
            )  # fmt: skip
            cluster.wait_for_workers(["private-0"], timeout=120)
            os.killpg(server.pid, signal.SIGKILL)
            # Its watchdog sees its parent gone and ends its group; the handle cannot be told the code.
            _wait_gone(worker.pid)
            assert worker.wait(timeout=10) == -signal.SIGKILL
            assert server.gone
            cluster.wait_until_gone(["private-0"], timeout=60)
        finally:
            server.close()


def test_python_runs_as_it_would_from_the_command_line(tmp_path: Path) -> None:
    """A forked process runs its module as ``python -m`` would: as __main__, with its arguments, ending
    with the module's own exit code."""
    module = tmp_path / "echo_args.py"
    module.write_text("import sys\nprint('args', sys.argv[1:], __name__)\nsys.exit(7)\n")
    server = forkserver.shared_fork_server({}, os.getcwd())
    log = tmp_path / "echo.log"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    child = server.spawn(["echo_args", "x", "y"], env=env, log=log, cwd=str(tmp_path))
    assert child.wait(timeout=30) == 7
    assert "args ['x', 'y'] __main__" in log.read_text()


# A flow or command a test runs in a subprocess: its cluster's processes, and a module run to its end.
_SUBPROCESS = """
import os, sys, time
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.forkserver import shared_fork_server
server = shared_fork_server({}, os.getcwd())
echo = server.spawn(["echo_args"], env=dict(os.environ), log=sys.argv[1], cwd=os.path.dirname(sys.argv[1]))
cluster = LocalElasticCluster(0, 1, fork_server=True).start()
print(server.pid, echo.wait(timeout=30), cluster._processes.scheduler.pid, cluster.worker_pid("elastic-0"),
      flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(180)
def test_a_subprocess_forks_from_the_sessions_server_and_its_forks_end_with_it(tmp_path: Path) -> None:
    """A process started from one that has a fork server connects to it (no imports of its own); what it
    forked there is reported to it, and ends when it is SIGKILLed."""
    session = forkserver.shared_fork_server({}, os.getcwd())
    (tmp_path / "echo_args.py").write_text("import sys\nsys.exit(7)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert env[forkserver.FORK_SERVER_SOCKET_ENV] == str(session.socket_path)
    with subprocess.Popen(
        [sys.executable, "-c", _SUBPROCESS, str(tmp_path / "echo.log")],
        stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd(),
    ) as child:  # fmt: skip
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, "the subprocess ended before its cluster started"
        server_pid, echo_code, scheduler_pid, worker_pid = map(int, line.split())
        assert server_pid == session.pid
        assert echo_code == 7
        for pid in (scheduler_pid, worker_pid):
            assert session.pid in [p.pid for p in psutil.Process(pid).parents()]
        child.kill()
        child.wait(timeout=30)
        _wait_gone(scheduler_pid)
        _wait_gone(worker_pid)
