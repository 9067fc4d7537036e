"""The processes of one `LocalElasticCluster`: how each is started, and the ones it started.

`ClusterProcesses` owns the command lines (a scheduler, a worker with or without its nanny, in a network
namespace or not), what every process inherits (the environment, the import path, the TLS files, the
watchdog that ends the processes once their owner is gone), the log folder, the worker processes it
started by name, and their supervision (a worker whose process exits is started again, as systemd or SLURM
would). It never asks the scheduler anything: `LocalElasticCluster` does, and decides what to start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.security import Security

from .forkserver import ForkServer, shared_fork_server
from .processes import Leader, log_tail, signal_group, start_group, stop_groups

if TYPE_CHECKING:
    from .netns import NetworkNamespace

log = logging.getLogger(__name__)

POLL_S = 0.05
PARENT_ENV = "PREFECT_ELASTIC_CLUSTER_PARENT"

# Loaded by every scheduler and nanny (or nanny-less worker) as a preload file. atexit does not run when the
# process that owns the cluster is SIGKILLed (a CI timeout, a killed flow run); without this the scheduler
# and workers would live on and hold the CPUs. A reparented process means its parent is gone.
WATCHDOG_SOURCE = f'''"""Ends this process group once the process that started it is gone."""
import os
import signal
import threading
import time


def dask_setup(server):
    parent = int(os.environ.get("{PARENT_ENV}", "0") or 0)
    if not parent:
        return

    def watch():
        while True:
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="prefect-elastic-parent-watchdog", daemon=True).start()
'''


class ClusterProcesses:
    """The scheduler and worker processes of one local cluster, started with its settings.

    `lock` guards everything here and is the cluster's lock too: `closed` is set under it, and the
    supervisor starts a worker again only under it, so nothing starts once the cluster closes."""

    def __init__(
        self,
        *,
        threads_per_worker: int,
        nanny: bool,
        static_resource: str,
        memory_limit: str,
        env: dict[str, str],
        startup_timeout: float,
        worker_ttl: str | None,
        log_dir: Path | None,
        preload: tuple[str, ...],
        security: bool | Security,
        host: str,
        max_restarts: int,
        restart_delay: float,
        fork_server: bool = False,
    ) -> None:
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0, got {startup_timeout}")
        if max_restarts < 0 or restart_delay < 0:
            raise ValueError(
                f"max_restarts and restart_delay must be >= 0, got {max_restarts}, {restart_delay}"
            )
        self.threads_per_worker = threads_per_worker
        self.nanny = nanny
        self.static_resource = static_resource
        self.memory_limit = memory_limit
        self.env = env
        self.startup_timeout = startup_timeout
        self.worker_ttl = worker_ttl
        self.host = host
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        self.preload = preload
        self.fork_server = fork_server
        self._given_log_dir = log_dir
        self.log_dir: Path | None = None
        self._security_wanted = security
        self.security: Security | None = None
        self._tls_args: list[str] = []

        self.lock = threading.RLock()
        self.closed = False
        self.scheduler: Leader | None = None
        self.scheduler_address: str | None = None
        self.workers: dict[str, Leader] = {}
        self.specs: dict[str, tuple[bool, NetworkNamespace | None]] = {}  # name -> (static, netns)
        self._counters = {"static": 0, "elastic": 0}
        self._supervised: set[str] = set()
        self._restarts: dict[str, list[float]] = {}  # name -> when its supervisor started it again
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ what every process gets

    def prepare(self) -> None:
        """The log folder (with its scratch folder and the watchdog) and the TLS files."""
        if self._given_log_dir is not None:
            self._given_log_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = self._given_log_dir
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="prefect-elastic-cluster-"))
        (self.log_dir / "scratch").mkdir(exist_ok=True)
        (self.log_dir / "parent_watchdog.py").write_text(WATCHDOG_SOURCE)
        self._prepare_tls()
        if self.fork_server:
            # Started by the first cluster of this process, it imports while the scheduler starts.
            self._server()

    def _prepare_tls(self) -> None:
        """Write the certificates the processes are started with (`--tls-*` take files)."""
        wanted = self._security_wanted
        if wanted is False:
            return
        assert self.log_dir is not None
        given: Any = Security.temporary() if wanted is True else wanted  # (its tls_* are set at run time)
        folder = self.log_dir / "tls"
        folder.mkdir(mode=0o700, exist_ok=True)

        def as_file(value: str | None, name: str, what: str) -> str:
            if not value:
                raise ValueError(f"security: the Security given has no {what}; a local cluster needs one")
            if "-----BEGIN" not in value:
                return value  # a path already
            path = folder / name
            path.write_text(value)
            path.chmod(0o600)
            return str(path)

        ca = as_file(given.tls_ca_file, "ca.pem", "tls_ca_file")
        cert = as_file(given.tls_worker_cert or given.tls_client_cert, "cert.pem", "certificate")
        key = as_file(given.tls_worker_key or given.tls_client_key, "key.pem", "key")
        client_cert = as_file(given.tls_client_cert or given.tls_worker_cert, "client.pem", "client cert")
        client_key = as_file(given.tls_client_key or given.tls_worker_key, "client.key", "client key")
        self._tls_args = ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]
        self.security = Security(
            tls_ca_file=ca, tls_client_cert=client_cert, tls_client_key=client_key, require_encryption=True
        )

    def _server(self) -> ForkServer:
        """This process's fork server, asked again each time: one that is gone is replaced by a new one."""
        return shared_fork_server(self._child_env(), os.getcwd())

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        # The workers unpickle the user's functions and models by module name; give them the same import
        # path as this process (the test rootdir, the script's directory) so those modules import there too,
        # after the entries of a PYTHONPATH given in `env`, which come first.
        given = [entry for entry in self.env.get("PYTHONPATH", "").split(os.pathsep) if entry]
        entries: list[str] = list(given)
        seen = {os.path.abspath(entry) for entry in given}
        for entry in sys.path:
            path = os.path.abspath(entry or os.getcwd())
            if os.path.isdir(path) and path not in seen:
                entries.append(path)
                seen.add(path)
        env["PYTHONPATH"] = os.pathsep.join(entries)
        if self.worker_ttl is not None:
            env["DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL"] = self.worker_ttl
        env[PARENT_ENV] = str(os.getpid())
        return env

    def _popen(
        self,
        args: list[str],
        log_name: str,
        netns: NetworkNamespace | None = None,
        env: dict[str, str] | None = None,
        fork: bool = False,
    ) -> Leader:
        assert self.log_dir is not None
        server = self._server() if fork and netns is None else None
        if server is not None:
            forked_env = {**self._child_env(), **(env or {})}
            # Its parent, the one whose loss its watchdog watches for, is the fork server; and a nanny forks
            # its worker process in turn, so that the imports are done there too.
            forked_env[PARENT_ENV] = str(server.pid)
            forked_env["DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD"] = "fork"
            return server.spawn(args, env=forked_env, log=self.log_dir / f"{log_name}.log", cwd=os.getcwd())
        # `ip netns exec` execs the command in place: the group leader is still the Python process.
        prefix = netns.exec_prefix() if netns is not None else []
        return start_group(
            [*prefix, sys.executable, "-m", *args],
            log=self.log_dir / f"{log_name}.log",
            env={**self._child_env(), **(env or {})},
            cwd=os.getcwd(),
        )

    # ------------------------------------------------------------------ the scheduler

    def start_scheduler(self) -> str:
        """Start the scheduler; return its address once it wrote it (bounded by `startup_timeout`)."""
        assert self.log_dir is not None
        scheduler_file = self.log_dir / "scheduler.json"
        proc = self._popen(
            [
                "distributed.cli.dask_scheduler",
                "--host",
                f"tls://{self.host}" if self._tls_args else self.host,
                *self._tls_args,
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(scheduler_file),
                "--preload",
                str(self.log_dir / "parent_watchdog.py"),
            ],
            "scheduler",
            # Forked too once the fork server has imported (a later cluster of this process): not waited for.
            fork=self.fork_server and self._server().ready,
        )
        with self.lock:
            self.scheduler = proc
        deadline = time.monotonic() + self.startup_timeout
        while True:
            address = read_scheduler_file(scheduler_file)
            if address is not None:
                with self.lock:
                    self.scheduler_address = address
                return address
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the scheduler exited with code {proc.returncode} during startup\n"
                    + log_tail(self.log_dir / "scheduler.log")
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the scheduler did not start within {self.startup_timeout:.0f} s\n"
                    + log_tail(self.log_dir / "scheduler.log")
                )
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ workers

    def spawn_worker(
        self, static: bool, netns: NetworkNamespace | None = None, name: str | None = None
    ) -> str:
        """Start a worker process (a new name unless `name` is given); it registers a few seconds later."""
        assert self.log_dir is not None and self.scheduler_address is not None
        kind = "static" if static else "elastic"
        if name is None:
            with self.lock:
                name = f"{kind}-{self._counters[kind]}"
                self._counters[kind] += 1
        host = netns.address if netns is not None else self.host
        watchdog = str(self.log_dir / "parent_watchdog.py")
        args = [
            "distributed.cli.dask_worker",
            self.scheduler_address,
            "--host",
            host,
            "--name",
            name,
            "--nthreads",
            str(self.threads_per_worker),
            "--memory-limit",
            self.memory_limit,
            "--no-dashboard",
            "--local-directory",
            str(self.log_dir / "scratch"),
            *self._tls_args,
        ]
        # The worker's preloads go through Dask's config, not `--preload`: the CLI imports every `--preload`
        # module in the process it starts in, only to look for click options, so each nanny imported
        # torch for nothing (2 s of CPU per worker; a cluster of 4 workers started 4 s sooner without it).
        preloads = list(self.preload) if self.nanny else [watchdog, *self.preload]
        args += ["--nanny", "--preload-nanny", watchdog] if self.nanny else ["--no-nanny"]
        if static:
            args += ["--resources", f"{self.static_resource}=1"]
        env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps(preloads)}
        proc = self._popen(args, name, netns, env, fork=self.fork_server)
        with self.lock:
            self.workers[name] = proc
            self.specs[name] = (static, netns)
        return name

    def worker(self, name: str) -> Leader | None:
        """The process started for worker `name` (its nanny's, or its own without a nanny)."""
        with self.lock:
            return self.workers.get(name)

    def pending(self, registered: set[str]) -> list[str]:
        """The workers started here whose process runs and that are not `registered` yet. A process that
        exits meanwhile is not on its way (a worker retired or killed a moment ago: its nanny lingers a few
        seconds after it left the scheduler)."""
        with self.lock:
            return sorted(n for n, p in self.workers.items() if p.poll() is None and n not in registered)

    def running(self) -> set[str]:
        """The names of the worker processes started here that still run."""
        with self.lock:
            return {name for name, proc in self.workers.items() if proc.poll() is None}

    def raise_if_exited(self, name: str) -> None:
        with self.lock:
            proc = self.workers.get(name)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"worker {name!r} exited with code {proc.returncode} before registering\n"
                + self.log_tail_of(name)
            )

    def log_tail_of(self, name: str) -> str:
        assert self.log_dir is not None
        return log_tail(self.log_dir / f"{name}.log")

    def logs_of(self, names: list[str]) -> str:
        return "\n".join(self.log_tail_of(name) for name in names)

    # ------------------------------------------------------------------ supervision

    def restarts(self, name: str) -> list[float]:
        """When (`time.time()`) the supervisor of worker `name` started it again, oldest first."""
        with self.lock:
            return list(self._restarts.get(name, []))

    def supervise(self, name: str) -> None:
        """Start worker `name` again whenever its process group exits, until `unsupervise` or the close."""
        with self.lock:
            self._supervised.add(name)
            self._restarts.setdefault(name, [])
            if self._supervisor is None:
                self._supervisor = threading.Thread(
                    target=self._supervise_loop, name="local-cluster-supervisor", daemon=True
                )
                self._supervisor.start()

    def unsupervise(self, name: str) -> None:
        with self.lock:
            self._supervised.discard(name)

    def close(self) -> None:
        """Mark the processes closing: the supervisor starts nothing from now on."""
        with self.lock:
            self.closed = True
            self._stopping.set()

    def stop(self, grace: float) -> None:
        """Stop every process started here (after `close`): SIGTERM, then SIGKILL after `grace` seconds."""
        with self.lock:
            workers, scheduler = list(self.workers.values()), self.scheduler
        # Workers first so that they do not spend the grace period reconnecting to a dead scheduler.
        stop_groups(workers, grace)
        if scheduler is not None:
            stop_groups([scheduler], grace)
        supervisor = self._supervisor
        if supervisor is not None:
            # It starts nothing once `closed` is set (checked under the lock it spawns under).
            supervisor.join(timeout=grace)
        if self.log_dir is not None:
            # Spilled data and scratch files can be large; the logs stay for post-mortems.
            shutil.rmtree(self.log_dir / "scratch", ignore_errors=True)

    def _supervise_loop(self) -> None:
        exited: dict[str, float] = {}  # name -> when its exit was seen
        while not self._stopping.wait(POLL_S * 2):
            with self.lock:
                watched = [(n, self.workers[n]) for n in sorted(self._supervised)]
            for name, proc in watched:
                if proc.poll() is None:
                    exited.pop(name, None)
                    continue
                now = time.monotonic()
                seen = exited.setdefault(name, now)
                if now - seen < self.restart_delay:
                    continue
                exited.pop(name, None)
                with self.lock:
                    if self.closed or name not in self._supervised:
                        continue
                    if len(self._restarts[name]) >= self.max_restarts:
                        self._supervised.discard(name)
                        log.warning(
                            "worker %s exited with code %s; not started again (max_restarts=%d reached)",
                            name, proc.returncode, self.max_restarts,
                        )  # fmt: skip
                        continue
                    static, netns = self.specs[name]
                    self._restarts[name].append(time.time())
                    # Whatever its group left behind (a worker process that outlived its nanny) goes first.
                    signal_group(proc, signal.SIGKILL)
                    log.warning("worker %s exited with code %s; its supervisor starts it again",
                                name, proc.returncode)  # fmt: skip
                    try:
                        self.spawn_worker(static=static, netns=netns, name=name)
                    except Exception:
                        log.exception("the supervisor could not start worker %s again", name)


def read_scheduler_file(path: Path) -> str | None:
    """The address in a scheduler file; None while it is not written yet, or caught half-written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    address = data.get("address") if isinstance(data, dict) else None
    return str(address) if address else None
