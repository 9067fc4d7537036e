"""A local Dask cluster of real processes, for users on a laptop and for fault-injection tests.

`LocalElasticCluster` owns one scheduler process and any number of worker processes on 127.0.0.1:
*static* workers (named ``static-N``, carrying the static resource) and *elastic* workers (named
``elastic-N``). Each process runs in its own session, so a test can kill a worker with a real signal, either
for good (the nanny and its worker process together) or only its worker process so that the nanny restarts
it. Every wait is bounded and fails with a `RuntimeError` that carries the tail of the process's log.

For partition tests, ``host=`` puts the scheduler and the workers on another address of this machine (the
bridge of a `netns.HostNetwork`), and `add_worker(netns=...)` starts a worker inside a network namespace,
whose link the test can cut. ``supervise=True`` starts a worker again when its process exits, as systemd
or SLURM would (a Dask worker cut off from its scheduler exits, and does not come back by itself).

The live membership always comes from the scheduler, never from this object's bookkeeping: what the tests
check is what the rest of the system sees.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import distributed
from distributed.security import Security

from ..cluster.static import is_static_worker
from .processes import Service, log_tail, signal_group, start_group, stop_groups

if TYPE_CHECKING:
    from .netns import NetworkNamespace

__all__ = ["LocalElasticCluster"]

log = logging.getLogger(__name__)

_POLL_S = 0.05
_RPC_TIMEOUT_S = 30.0
_TERM_GRACE_S = 5.0
_PARENT_ENV = "PREFECT_ELASTIC_CLUSTER_PARENT"

# Loaded by every scheduler and nanny (or nanny-less worker) as a preload file. atexit does not run when the
# process that owns the cluster is SIGKILLed (a CI timeout, a killed flow run); without this the scheduler
# and workers would live on and hold the CPUs. A reparented process means its parent is gone.
_WATCHDOG_SOURCE = f'''"""Ends this process group once the process that started it is gone."""
import os
import signal
import threading
import time


def dask_setup(server):
    parent = int(os.environ.get("{_PARENT_ENV}", "0") or 0)
    if not parent:
        return

    def watch():
        while True:
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="prefect-elastic-parent-watchdog", daemon=True).start()
'''


def _status_name(dask_worker: Any) -> str:
    return str(dask_worker.status.name)


class LocalElasticCluster(Service):
    """A Dask scheduler with N static and M elastic worker processes on ``host`` (127.0.0.1).

    Nothing starts until `start()` or ``with``. Workers are named ``static-0, static-1, ...`` and
    ``elastic-0, elastic-1, ...``; a name is never reused, except by a nanny restarting its own worker,
    or by a supervisor starting a whole worker again (``add_worker(supervise=True)``).
    Every process inherits this process's environment updated with ``env``, and an import path of the
    ``PYTHONPATH`` given in ``env`` (if any) followed by this process's `sys.path`. With
    ``security=True`` every connection (the scheduler, the workers, their clients, the step path) is TLS
    with a self-signed authority made for this cluster; `security` is then the clients' `Security`.
    """

    def __init__(
        self,
        static_workers: int = 2,
        elastic_workers: int = 2,
        *,
        threads_per_worker: int = 1,
        nanny: bool = True,
        static_resource: str = "static",
        memory_limit: str = "4GiB",
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        worker_ttl: str | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        preload: tuple[str, ...] = ("prefect_elastic.compute",),
        security: bool | Security = False,
        host: str = "127.0.0.1",
        max_restarts: int = 3,
        restart_delay: float = 1.0,
    ) -> None:
        if static_workers < 0 or elastic_workers < 0:
            raise ValueError(
                f"worker counts must be >= 0, got static_workers={static_workers}, "
                f"elastic_workers={elastic_workers}"
            )
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0, got {startup_timeout}")
        if max_restarts < 0 or restart_delay < 0:
            raise ValueError(
                f"max_restarts and restart_delay must be >= 0, got {max_restarts}, {restart_delay}"
            )
        self.static_workers = static_workers
        self.elastic_workers = elastic_workers
        self.threads_per_worker = threads_per_worker
        self.nanny = nanny
        self.static_resource = static_resource
        self.memory_limit = memory_limit
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.worker_ttl = worker_ttl
        # Where the scheduler and every worker outside a network namespace listen (a `HostNetwork`'s
        # address makes them reachable from its namespaces; 127.0.0.1 is not).
        self.host = host
        # A supervised worker (`add_worker(supervise=True)`) that exits is started again, under the same
        # name, `restart_delay` seconds later, at most `max_restarts` times.
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        # Imported by each worker process before it registers, so that a worker that joins is ready to
        # train at once instead of spending its first seconds importing torch.
        self.preload = tuple(preload)
        self._given_log_dir = Path(log_dir) if log_dir is not None else None
        self.log_dir: Path | None = None
        # TLS between every process of the cluster and its clients: `True` makes a self-signed authority
        # and one certificate for every role (Dask's `Security.temporary`); a `Security` is used as given.
        self._security_wanted = security
        self.security: Security | None = None
        self._tls_args: list[str] = []

        self._lock = threading.RLock()
        self._scheduler_proc: subprocess.Popen[bytes] | None = None
        self._scheduler_address: str | None = None
        self._workers: dict[str, subprocess.Popen[bytes]] = {}
        self._counters = {"static": 0, "elastic": 0}
        self._worker_pids: dict[str, int] = {}
        self._specs: dict[str, tuple[bool, NetworkNamespace | None]] = {}  # name -> (static, netns)
        self._supervised: set[str] = set()
        self._restarts: dict[str, list[float]] = {}  # name -> when its supervisor started it again
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._client: distributed.Client | None = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LocalElasticCluster:
        """Start the scheduler and all workers; return once every worker registered with the scheduler."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this LocalElasticCluster was closed; create a new one")
            if self._started:
                return self
            self._started = True
        atexit.register(self.close)
        try:
            self._prepare_dirs()
            self._prepare_tls()
            self._start_scheduler()
            names = [self._spawn_worker(static=True) for _ in range(self.static_workers)]
            names += [self._spawn_worker(static=False) for _ in range(self.elastic_workers)]
            # Spawned together and waited for together: startup is paid once, not once per worker.
            self.wait_for_workers(names, timeout=self.startup_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process this cluster started: SIGTERM, then SIGKILL after a few seconds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping.set()
            client, self._client = self._client, None
            workers = list(self._workers.values())
            scheduler = self._scheduler_proc
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        # Workers first so that they do not spend the grace period reconnecting to a dead scheduler.
        stop_groups(workers, _TERM_GRACE_S)
        if scheduler is not None:
            stop_groups([scheduler], _TERM_GRACE_S)
        supervisor = self._supervisor
        if supervisor is not None:
            # It starts nothing once `_closed` is set (checked under the lock it spawns under).
            supervisor.join(timeout=_TERM_GRACE_S)
        if self.log_dir is not None:
            # Spilled data and scratch files can be large; the logs stay for post-mortems.
            shutil.rmtree(self.log_dir / "scratch", ignore_errors=True)

    def cleanup(self) -> None:
        """`close`, as every local service ends (``with`` calls it)."""
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "not started")
        return f"<LocalElasticCluster {self._scheduler_address or '-'} {state}, {len(self._workers)} spawned>"

    # ------------------------------------------------------------------ public queries

    @property
    def scheduler_address(self) -> str:
        """The scheduler's address, ``tcp://HOST:PORT`` (``tls://`` with `security`)."""
        if self._scheduler_address is None:
            raise RuntimeError("the cluster is not started; call start() or use it as a context manager")
        return self._scheduler_address

    @property
    def scheduler_pid(self) -> int | None:
        """The scheduler process's pid (for tests that kill it); None before `start`."""
        proc = self._scheduler_proc
        return None if proc is None else proc.pid

    def client(self, **kwargs: Any) -> distributed.Client:
        """A new Client connected to this cluster; the caller closes it."""
        kwargs.setdefault("timeout", self.startup_timeout)
        kwargs.setdefault("security", self.security)
        return distributed.Client(self.scheduler_address, **kwargs)

    def workers_info(self) -> dict[str, dict[str, Any]]:
        """The scheduler's view of every live worker: address -> info (``name``, ``resources``, ...)."""
        client = self._get_client()
        identity = client.sync(
            self._scheduler_rpc(client).identity, n_workers=-1, callback_timeout=_RPC_TIMEOUT_S
        )
        workers: dict[str, dict[str, Any]] = identity.get("workers", {})
        return workers

    def worker_names(self, static: bool | None = None) -> list[str]:
        """Names of the live workers, as the scheduler sees them; ``static`` filters by kind."""
        names = [
            str(info["name"])
            for info in self.workers_info().values()
            if static is None or is_static_worker(info, self.static_resource) == static
        ]
        return sorted(names)

    def address_of(self, name: str) -> str | None:
        """Current address of the worker with that name (it changes when a nanny restarts the worker)."""
        for addr, info in self.workers_info().items():
            if str(info["name"]) == name:
                return addr
        return None

    def elastic_addresses(self) -> list[str]:
        """Addresses of the live workers that do not carry the static resource."""
        return self._addresses(static=False)

    def static_addresses(self) -> list[str]:
        """Addresses of the live workers that carry the static resource."""
        return self._addresses(static=True)

    def _addresses(self, static: bool) -> list[str]:
        workers = self.workers_info().items()
        return sorted(a for a, info in workers if is_static_worker(info, self.static_resource) == static)

    def worker_pid(self, name_or_address: str) -> int:
        """The pid of the live worker process itself (a nanny's child), asked of the worker."""
        addr, _ = self._resolve_live(name_or_address)
        with self._lock:
            pid = self._worker_pids.get(addr)
        if pid is None:
            client = self._get_client()
            # The scheduler's worker info carries no pid in this Dask version, so ask the worker. `_run` is
            # what `Client.run` wraps; calling it through `sync` is what bounds the wait on a frozen worker.
            result = client.sync(client._run, os.getpid, workers=[addr], callback_timeout=_RPC_TIMEOUT_S)
            pid = int(result[addr])
            with self._lock:
                self._worker_pids[addr] = pid
        return pid

    def _wait_nanny_started(self, name_or_address: str) -> None:
        # A worker registers with the scheduler a moment before its nanny has finished starting; killing
        # the worker in that moment makes the nanny give up ("Nanny failed to start") instead of restarting.
        addr, _ = self._resolve_live(name_or_address)
        client = self._get_client()
        deadline = time.monotonic() + _RPC_TIMEOUT_S
        while True:
            status = client.sync(
                client._run, _status_name, workers=[addr], nanny=True, callback_timeout=_RPC_TIMEOUT_S
            )
            if "running" in status.values():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the nanny of {name_or_address} did not finish starting: {status}")
            time.sleep(_POLL_S)

    @property
    def requested(self) -> set[str]:
        """Names of the worker processes this cluster started that still run (as `SpecCluster.requested`:
        a name missing from the scheduler is a worker on its way)."""
        with self._lock:
            return {name for name, proc in self._workers.items() if proc.poll() is None}

    def wait_for_pending(self, timeout: float | None = None) -> None:
        """Wait until every worker process this cluster started and that still runs has registered (a
        worker added with `wait=False` joins a few seconds later)."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            known = {str(info["name"]) for info in self.workers_info().values()}
            with self._lock:
                # A process that exits meanwhile is not on its way (a worker retired or killed a moment
                # ago: its nanny lingers a few seconds after it left the scheduler).
                pending = sorted(n for n, p in self._workers.items() if p.poll() is None and n not in known)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"workers {pending} did not register with {self.scheduler_address} in {timeout:.0f} s\n"
                    + "\n".join(self._log_tail_of(name) for name in pending)
                )
            time.sleep(_POLL_S)

    def netns_of(self, name_or_address: str) -> NetworkNamespace | None:
        """The network namespace the worker was started in (`add_worker(netns=...)`); None if it was not,
        or if no worker of that name or live address is known."""
        try:
            name = self._resolve_name(name_or_address)
        except ValueError:
            return None
        with self._lock:
            spec = self._specs.get(name)
        return None if spec is None else spec[1]

    def pid_of(self, name: str) -> int | None:
        """The pid of the spawned process of that worker: the nanny's, or the worker's without a nanny."""
        with self._lock:
            proc = self._workers.get(name)
        return None if proc is None else proc.pid

    # ------------------------------------------------------------------ membership changes

    def slow_worker(self, name_or_address: str, factor: float) -> None:
        """Make one compute worker a straggler: its compute takes `factor` times as long from now on (1:
        normal again). One straggler at a time; see `prefect_elastic.local.slow`."""
        from .slow import Straggler, register

        self._require_running()
        with self.client() as client:
            register(client, Straggler(name_or_address, factor))

    def add_worker(
        self,
        static: bool = False,
        wait: bool = True,
        timeout: float | None = None,
        *,
        netns: NetworkNamespace | None = None,
        supervise: bool = False,
    ) -> str:
        """Start one more worker process and return its name; if ``wait``, return once it registered.

        ``netns``: in that network namespace, listening on its address (the cluster's ``host`` must be
        reachable from it: a `HostNetwork`'s address). ``supervise``: whenever its process group exits
        (not retired, the cluster not closing) start it again under the same name, after `restart_delay`
        seconds, at most `max_restarts` times (`restarts`)."""
        self._require_running()
        name = self._spawn_worker(static=static, netns=netns)
        if supervise:
            self._supervise(name)
        if wait:
            self.wait_for_workers([name], timeout=timeout)
        return name

    def kill_worker(self, name_or_address: str, sig: int = signal.SIGKILL, restart: bool = False) -> None:
        """Send ``sig`` to a worker.

        ``restart=False``: to the whole process group (nanny and worker process), so it is gone for good.
        ``restart=True`` (needs ``nanny=True``): to the worker process only, so that its nanny starts it
        again under the same name and a new address. Neither waits for the scheduler to notice; use
        `wait_until_gone` / `wait_for_workers` (a SIGSTOPped worker is noticed only after the worker TTL).
        A supervised worker (``add_worker(supervise=True)``) is started again by its supervisor.
        """
        self._require_running()
        if restart:
            if not self.nanny:
                raise ValueError("kill_worker(restart=True) needs a cluster started with nanny=True")
            self._wait_nanny_started(name_or_address)
            os.kill(self.worker_pid(name_or_address), sig)
            return
        name = self._resolve_name(name_or_address)
        with self._lock:
            proc = self._workers.get(name)
        if proc is None:
            raise ValueError(f"worker {name!r} was not started by this cluster; cannot kill its processes")
        signal_group(proc, sig)
        if sig == signal.SIGKILL:
            # Reap the leader now so that its pid is really free (not a zombie) when this returns.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_TERM_GRACE_S)

    def retire_worker(
        self, name_or_address: str, timeout: float | None = None, exit_timeout: float = 10.0
    ) -> None:
        """Retire a worker gracefully (`Client.retire_workers`); wait until it left and its processes exited.

        A worker that is running a task leaves the scheduler at once (the task is rescheduled elsewhere, or
        waits for a worker if it is restricted to this one) but its process exits only once that task's
        thread returns, and a nanny lingers about 2 s more. A process still alive ``exit_timeout`` seconds
        after the worker left is terminated: it no longer belongs to the cluster, and a long-running task
        (a compute loop) may never return.
        """
        self._require_running()
        timeout = self.startup_timeout if timeout is None else timeout
        addr, info = self._resolve_live(name_or_address)
        name = str(info["name"])
        with self._lock:
            self._supervised.discard(name)  # a retired worker is meant to stay gone
        client = self._get_client()
        retired = client.sync(
            self._scheduler_rpc(client).retire_workers,
            workers=[addr],
            close_workers=True,
            callback_timeout=timeout,
        )
        if addr not in (retired or {}):
            raise RuntimeError(
                f"the scheduler refused to retire worker {name!r} ({addr}); it may hold the only copy "
                "of data that no other worker can take"
            )
        self.wait_until_gone([name], timeout=timeout)
        with self._lock:
            proc = self._workers.get(name)
        if proc is not None:
            try:
                proc.wait(timeout=exit_timeout)
            except subprocess.TimeoutExpired:
                stop_groups([proc], _TERM_GRACE_S)

    # ------------------------------------------------------------------ waits

    def wait_for_workers(self, names: Iterable[str], timeout: float | None = None) -> dict[str, str]:
        """Wait until every named worker is registered with the scheduler; return name -> address."""
        wanted = set(names)
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            current = {str(info["name"]): addr for addr, info in self.workers_info().items()}
            if wanted <= current.keys():
                return {name: current[name] for name in wanted}
            missing = sorted(wanted - current.keys())
            for name in missing:
                self._raise_if_exited(name)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"workers {missing} did not register with {self.scheduler_address} "
                    f"within {timeout:.0f} s\n" + "\n".join(self._log_tail_of(name) for name in missing)
                )
            time.sleep(_POLL_S)

    def wait_until_gone(self, names_or_addresses: Iterable[str], timeout: float | None = None) -> None:
        """Wait until none of the given workers (by name or address) is known to the scheduler."""
        wanted = set(names_or_addresses)
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            present = {
                key
                for addr, info in self.workers_info().items()
                for key in (addr, str(info["name"]))
                if key in wanted
            }
            if not present:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"workers {sorted(present)} are still registered with {self.scheduler_address} "
                    f"after {timeout:.0f} s"
                )
            time.sleep(_POLL_S)

    def wait_for_restart(self, name: str, old_address: str, timeout: float | None = None) -> str:
        """Wait until the worker ``name`` is registered under an address other than ``old_address``."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            addr = self.address_of(name)
            if addr is not None and addr != old_address:
                return addr
            self._raise_if_exited(name)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"worker {name!r} did not come back under a new address within {timeout:.0f} s\n"
                    + self._log_tail_of(name)
                )
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ internals

    def _require_running(self) -> None:
        if self._closed:
            raise RuntimeError("this LocalElasticCluster is closed")
        if self._scheduler_address is None:
            raise RuntimeError("the cluster is not started; call start() or use it as a context manager")

    def _get_client(self) -> distributed.Client:
        with self._lock:
            self._require_running()
            if self._client is None:
                self._client = distributed.Client(
                    self.scheduler_address,
                    timeout=self.startup_timeout,
                    set_as_default=False,
                    security=self.security,
                )
            return self._client

    @staticmethod
    def _scheduler_rpc(client: distributed.Client) -> Any:
        if client.scheduler is None:
            raise RuntimeError("the cluster's client lost its scheduler connection")
        return client.scheduler

    def _prepare_dirs(self) -> None:
        if self._given_log_dir is not None:
            self._given_log_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = self._given_log_dir
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="prefect-elastic-cluster-"))
        (self.log_dir / "scratch").mkdir(exist_ok=True)
        (self.log_dir / "parent_watchdog.py").write_text(_WATCHDOG_SOURCE)

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
        env[_PARENT_ENV] = str(os.getpid())
        return env

    def _popen(
        self,
        args: list[str],
        log_name: str,
        netns: NetworkNamespace | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        # `ip netns exec` execs the command in place: the group leader is still the Python process.
        prefix = netns.exec_prefix() if netns is not None else []
        return start_group(
            [*prefix, sys.executable, "-m", *args],
            log=self.log_dir / f"{log_name}.log",
            env={**self._child_env(), **(env or {})},
            cwd=os.getcwd(),
        )

    def _start_scheduler(self) -> None:
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
        )
        with self._lock:
            self._scheduler_proc = proc
        deadline = time.monotonic() + self.startup_timeout
        while True:
            address = self._read_scheduler_file(scheduler_file)
            if address is not None:
                with self._lock:
                    self._scheduler_address = address
                return
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
            time.sleep(_POLL_S)

    @staticmethod
    def _read_scheduler_file(path: Path) -> str | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            # Not written yet, or caught half-written.
            return None
        address = data.get("address") if isinstance(data, dict) else None
        return str(address) if address else None

    def _spawn_worker(
        self, static: bool, netns: NetworkNamespace | None = None, name: str | None = None
    ) -> str:
        assert self.log_dir is not None
        kind = "static" if static else "elastic"
        if name is None:
            with self._lock:
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
        proc = self._popen(args, name, netns, env)
        with self._lock:
            self._workers[name] = proc
            self._specs[name] = (static, netns)
        return name

    # ------------------------------------------------------------------ supervision

    def restarts(self, name: str) -> list[float]:
        """When (`time.time()`) the supervisor of worker `name` started it again, oldest first."""
        with self._lock:
            return list(self._restarts.get(name, []))

    def _supervise(self, name: str) -> None:
        with self._lock:
            self._supervised.add(name)
            self._restarts.setdefault(name, [])
            if self._supervisor is None:
                self._supervisor = threading.Thread(
                    target=self._supervise_loop, name="local-cluster-supervisor", daemon=True
                )
                self._supervisor.start()

    def _supervise_loop(self) -> None:
        exited: dict[str, float] = {}  # name -> when its exit was seen
        while not self._stopping.wait(_POLL_S * 2):
            with self._lock:
                watched = [(n, self._workers[n]) for n in sorted(self._supervised)]
            for name, proc in watched:
                if proc.poll() is None:
                    exited.pop(name, None)
                    continue
                now = time.monotonic()
                seen = exited.setdefault(name, now)
                if now - seen < self.restart_delay:
                    continue
                exited.pop(name, None)
                with self._lock:
                    if self._closed or name not in self._supervised:
                        continue
                    if len(self._restarts[name]) >= self.max_restarts:
                        self._supervised.discard(name)
                        log.warning(
                            "worker %s exited with code %s; not started again (max_restarts=%d reached)",
                            name, proc.returncode, self.max_restarts,
                        )  # fmt: skip
                        continue
                    static, netns = self._specs[name]
                    self._restarts[name].append(time.time())
                    # Whatever its group left behind (a worker process that outlived its nanny) goes first.
                    signal_group(proc, signal.SIGKILL)
                    log.warning("worker %s exited with code %s; its supervisor starts it again",
                                name, proc.returncode)  # fmt: skip
                    try:
                        self._spawn_worker(static=static, netns=netns, name=name)
                    except Exception:
                        log.exception("the supervisor could not start worker %s again", name)

    def _resolve_live(self, name_or_address: str) -> tuple[str, dict[str, Any]]:
        for addr, info in self.workers_info().items():
            if name_or_address in (addr, str(info["name"])):
                return addr, info
        raise ValueError(f"no live worker named or addressed {name_or_address!r} on {self.scheduler_address}")

    def _resolve_name(self, name_or_address: str) -> str:
        with self._lock:
            if name_or_address in self._workers:
                return name_or_address
        return str(self._resolve_live(name_or_address)[1]["name"])

    def _raise_if_exited(self, name: str) -> None:
        with self._lock:
            proc = self._workers.get(name)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"worker {name!r} exited with code {proc.returncode} before registering\n"
                + self._log_tail_of(name)
            )

    def _log_tail_of(self, name: str) -> str:
        assert self.log_dir is not None
        return log_tail(self.log_dir / f"{name}.log")
