"""A Dask cluster started as a user starts one: `dask scheduler` and `dask worker` from the command line.

No preload, no harness settings (`LocalElasticCluster` preloads the engine and tunes the workers, which can
hide what a user meets): a scheduler on 127.0.0.1, static workers with `--resources static=1`, elastic
workers with nothing but `--nthreads 1`, each its own process group, killed with real signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from distributed import Client

from prefect_elastic.cluster import CpuShare
from prefect_elastic.cluster.cores import cpu_mounts

DASK = str(Path(sys.executable).with_name("dask"))


class CliCluster:
    """`dask scheduler` and `dask worker` processes:

    `with CliCluster(static=2, elastic=2) as cluster: train(job, address=cluster.address)`."""

    def __init__(
        self,
        static: int = 2,
        elastic: int = 2,
        nanny: bool = False,
        cgroup: Path | None = None,
        elastic_host: str = "",
        memory_limit: str | None = None,
    ) -> None:
        self.nanny = nanny
        self.cgroup = cgroup  # (where given, the workers run in this cgroup: `cpu_quota_cgroup`)
        # (Where given, the elastic workers listen there: another loopback address is another host's
        # address to Dask, on this same machine.)
        self.elastic_host = elastic_host
        # (Where given, the static workers' `--memory-limit`: with a nanny, one that goes over it is killed.)
        self.memory_limit = memory_limit
        self.folder = Path(tempfile.mkdtemp(prefix="prefect-elastic-cli-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # by worker name ("scheduler" too)
        self.address = ""
        self._wanted = (static, elastic)

    def __enter__(self) -> CliCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: tuple[type[BaseException], BaseException, TracebackType] | None) -> None:
        self.close()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115  (the process keeps it)
        # The tests' signal files and PYTHONPATH reach the workers through the environment, as a user's do.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        command = [DASK, *args]
        if self.cgroup is not None and name != "scheduler":
            command = in_cgroup(self.cgroup, command)
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def _start(self) -> None:
        file = self.folder / "scheduler.json"
        self._spawn(
            "scheduler",
            [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(file),
            ],
        )
        deadline = time.monotonic() + 60
        while not file.exists() or not file.read_text().strip():
            if time.monotonic() > deadline or self.procs["scheduler"].poll() is not None:
                raise RuntimeError(f"dask scheduler did not start: {self.log('scheduler')[-2000:]}")
            time.sleep(0.1)
        self.address = json.loads(file.read_text())["address"]
        static, elastic = self._wanted
        for i in range(static):
            self.add_worker(f"static-{i}", static=True, wait=False)
        for i in range(elastic):
            self.add_worker(f"elastic-{i}", wait=False)
        self.wait_for_workers(static + elastic)

    def add_worker(self, name: str, static: bool = False, wait: bool = True) -> None:
        args = ["worker", self.address, "--name", name, "--nthreads", "1", "--no-dashboard"]
        args += ["--nanny"] if self.nanny else ["--no-nanny"]
        if static:
            args += ["--resources", "static=1"]
            if self.memory_limit is not None:
                args += ["--memory-limit", self.memory_limit]
        elif self.elastic_host:
            args += ["--host", self.elastic_host]
        self._spawn(name, args)
        if wait:
            self.wait_for_workers(len(self.names()) + 1)

    def client(self) -> Client:
        return Client(self.address, set_as_default=False, timeout=30)

    def workers(self) -> dict[str, str]:
        """Worker name -> address, as the scheduler lists them."""
        with self.client() as client:
            info = client.scheduler_info(n_workers=-1)["workers"]
        return {str(w["name"]): address for address, w in info.items()}

    def names(self) -> list[str]:
        return sorted(self.workers())

    def wait_for_workers(self, n: int, timeout: float = 120.0) -> None:
        with self.client() as client:
            client.wait_for_workers(n, timeout=timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the worker `name`'s whole process group (its nanny too, if it has one)."""
        os.killpg(self.procs[name].pid, sig)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


# What `cluster.cpu_share` reads in a process of its own (`python -c`), as one line of JSON: `probed_share`.
CPU_SHARE_PROBE = (
    "import json, prefect_elastic.cluster as c; s = c.cpu_share(); "
    "print(json.dumps([sorted(s.cpus), s.quotas, s.machine]))"
)


def probed_share(output: str) -> CpuShare:
    cpus, quotas, machine = json.loads(output.strip().splitlines()[-1])
    return CpuShare(frozenset(cpus), tuple((str(g), float(q)) for g, q in quotas), str(machine))


def in_cgroup(cgroup: Path, command: list[str]) -> list[str]:
    """`command` started in `cgroup`: a shell moves itself there, then becomes the command (same pid; its
    children follow it into the cgroup). A shell, not a `preexec_fn`: this process has threads."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *command]


@contextlib.contextmanager
def cpu_quota_cgroup(cores: float) -> Iterator[Path]:
    """A cgroup of this machine's cpu hierarchy whose processes get `cores` cores' worth of CPU time (the
    quota `docker run --cpus` sets), removed at the end once its processes are gone. Needs root."""
    mounts = cpu_mounts(Path("/proc/self/mountinfo").read_text())
    if not mounts:
        raise RuntimeError("no cgroup hierarchy with the cpu controller is mounted on this machine")
    mount = mounts[0]
    cgroup = mount.point / f"prefect-elastic-test-{uuid.uuid4().hex[:8]}"
    period = 100_000
    if mount.unified:
        with contextlib.suppress(OSError):  # (already on, or the kernel refuses: the next write says so)
            (mount.point / "cgroup.subtree_control").write_text("+cpu")
    cgroup.mkdir()
    try:
        if mount.unified:
            (cgroup / "cpu.max").write_text(f"{int(cores * period)} {period}")
        else:
            (cgroup / "cpu.cfs_period_us").write_text(str(period))
            (cgroup / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
        yield cgroup
    except BaseException:
        _remove_cgroup(cgroup, strict=False)  # (the failure that got here is the one to see)
        raise
    _remove_cgroup(cgroup, strict=True)


def _remove_cgroup(cgroup: Path, strict: bool) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            cgroup.rmdir()
            return
        except OSError:  # (its last processes are still exiting)
            if time.monotonic() > deadline:
                if strict:
                    raise
                return
            time.sleep(0.2)
