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
check is what the rest of the system sees. How each process is started is `launch.ClusterProcesses`'.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import distributed
from distributed.security import Security

from ..cluster.static import is_static_worker
from .forkserver import fork_server_wanted
from .launch import POLL_S, ClusterProcesses
from .processes import Service, signal_group, stop_groups

if TYPE_CHECKING:
    from .netns import NetworkNamespace

__all__ = ["LocalElasticCluster"]

log = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 30.0
_TERM_GRACE_S = 5.0


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
    ``fork_server=True`` forks workers from a process that imported their modules once (`forkserver`);
    None: as the environment variable ``PREFECT_ELASTIC_FORK_SERVER`` says ("1"), off otherwise.
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
        fork_server: bool | None = None,
    ) -> None:
        if static_workers < 0 or elastic_workers < 0:
            raise ValueError(
                f"worker counts must be >= 0, got static_workers={static_workers}, "
                f"elastic_workers={elastic_workers}"
            )
        self.static_workers = static_workers
        self.elastic_workers = elastic_workers
        self.nanny = nanny
        self.static_resource = static_resource
        self.startup_timeout = startup_timeout
        # How every process is started (`launch.py` says what each setting does there).
        self._processes = ClusterProcesses(
            threads_per_worker=threads_per_worker,
            nanny=nanny,
            static_resource=static_resource,
            memory_limit=memory_limit,
            env=dict(env or {}),
            startup_timeout=startup_timeout,
            worker_ttl=worker_ttl,
            log_dir=Path(log_dir) if log_dir is not None else None,
            preload=tuple(preload),
            security=security,
            host=host,
            max_restarts=max_restarts,
            restart_delay=restart_delay,
            fork_server=fork_server_wanted(fork_server),
        )
        self._lock = self._processes.lock
        self._worker_pids: dict[str, int] = {}
        self._client: distributed.Client | None = None
        self._started = False

    @property
    def log_dir(self) -> Path | None:
        """The folder of every process's log (and of their scratch files while the cluster runs)."""
        return self._processes.log_dir

    @property
    def security(self) -> Security | None:
        """The clients' `Security` of a cluster started with `security`; None without TLS."""
        return self._processes.security

    @property
    def _closed(self) -> bool:
        return self._processes.closed

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
            self._processes.prepare()
            self._processes.start_scheduler()
            spawn = self._processes.spawn_worker
            names = [spawn(static=True) for _ in range(self.static_workers)]
            names += [spawn(static=False) for _ in range(self.elastic_workers)]
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
            self._processes.close()
            client, self._client = self._client, None
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        self._processes.stop(_TERM_GRACE_S)

    cleanup = close  # as every local service ends (``with`` calls it)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "not started")
        address, spawned = self._processes.scheduler_address, len(self._processes.workers)
        return f"<LocalElasticCluster {address or '-'} {state}, {spawned} spawned>"

    # ------------------------------------------------------------------ public queries

    @property
    def scheduler_address(self) -> str:
        """The scheduler's address, ``tcp://HOST:PORT`` (``tls://`` with `security`)."""
        address = self._processes.scheduler_address
        if address is None:
            raise RuntimeError("the cluster is not started; call start() or use it as a context manager")
        return address

    @property
    def scheduler_pid(self) -> int | None:
        """The scheduler process's pid (for tests that kill it); None before `start`."""
        proc = self._processes.scheduler
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
        return dict(identity.get("workers", {}))

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
            time.sleep(POLL_S)

    @property
    def requested(self) -> set[str]:
        """Names of the worker processes this cluster started that still run (as `SpecCluster.requested`:
        a name missing from the scheduler is a worker on its way)."""
        return self._processes.running()

    def wait_for_pending(self, timeout: float | None = None) -> None:
        """Wait until every worker process this cluster started and that still runs has registered (a
        worker added with `wait=False` joins a few seconds later)."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            known = {str(info["name"]) for info in self.workers_info().values()}
            pending = self._processes.pending(known)
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"workers {pending} did not register with {self.scheduler_address} in {timeout:.0f} s\n"
                    + self._processes.logs_of(pending)
                )
            time.sleep(POLL_S)

    def netns_of(self, name_or_address: str) -> NetworkNamespace | None:
        """The network namespace the worker was started in (`add_worker(netns=...)`); None if it was not,
        or if no worker of that name or live address is known."""
        try:
            name = self._resolve_name(name_or_address)
        except ValueError:
            return None
        spec = self._processes.specs.get(name)
        return None if spec is None else spec[1]

    def pid_of(self, name: str) -> int | None:
        """The pid of the spawned process of that worker: the nanny's, or the worker's without a nanny."""
        proc = self._processes.worker(name)
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
        name = self._processes.spawn_worker(static=static, netns=netns)
        if supervise:
            self._processes.supervise(name)
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
        proc = self._processes.worker(name)
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
        self._processes.unsupervise(name)  # a retired worker is meant to stay gone
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
        proc = self._processes.worker(name)
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
                self._processes.raise_if_exited(name)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"workers {missing} did not register with {self.scheduler_address} "
                    f"within {timeout:.0f} s\n" + self._processes.logs_of(missing)
                )
            time.sleep(POLL_S)

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
            time.sleep(POLL_S)

    def wait_for_restart(self, name: str, old_address: str, timeout: float | None = None) -> str:
        """Wait until the worker ``name`` is registered under an address other than ``old_address``."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            addr = self.address_of(name)
            if addr is not None and addr != old_address:
                return addr
            self._processes.raise_if_exited(name)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"worker {name!r} did not come back under a new address within {timeout:.0f} s\n"
                    + self._processes.log_tail_of(name)
                )
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ internals

    def _require_running(self) -> None:
        if self._closed:
            raise RuntimeError("this LocalElasticCluster is closed")
        if self._processes.scheduler_address is None:
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

    def restarts(self, name: str) -> list[float]:
        """When (`time.time()`) the supervisor of worker `name` started it again, oldest first."""
        return self._processes.restarts(name)

    def _resolve_live(self, name_or_address: str) -> tuple[str, dict[str, Any]]:
        for addr, info in self.workers_info().items():
            if name_or_address in (addr, str(info["name"])):
                return addr, info
        raise ValueError(f"no live worker named or addressed {name_or_address!r} on {self.scheduler_address}")

    def _resolve_name(self, name_or_address: str) -> str:
        with self._lock:
            if name_or_address in self._processes.workers:
                return name_or_address
        return str(self._resolve_live(name_or_address)[1]["name"])
