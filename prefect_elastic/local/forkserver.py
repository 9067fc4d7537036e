"""Worker processes forked from one that has imported everything already: a local cluster's fork server.

Every Dask worker of the local harness imports distributed, torch and this package before it can register:
about 3.3 s of CPU, and its first optimizer step imports torch._dynamo for 1.7 s more. A cluster of four
workers with nannies spends some 18 s of CPU starting, and a test session starts hundreds of them. With
``LocalElasticCluster(fork_server=True)`` one process (`forkserver_process`, run as ``python -m``) pays the
imports once; each worker (or nanny) is then a `fork` of it that runs ``dask worker`` with its own
arguments, environment, log and session, so that a test can still kill it, or its whole group, with a real
signal. A nanny forks its worker process in turn (`multiprocessing-method: fork`), so that process starts
with the imports done too.

One fork server serves a process and the processes it starts: the process that starts it says where its
socket is (`FORK_SERVER_SOCKET_ENV`), and a flow or command that a test runs in a subprocess connects there
instead of starting its own (`shared_fork_server`). What each connection forked ends with it.

What differs from a worker started with ``dask worker`` from a shell, and why the harness keeps both: a
forked worker's imports were done before its environment was set, so settings read at import time come
from the environment of the process that started the fork server (the same for every worker it forks),
and the per-worker ones (preloads, the process-group marker, the parent to die with) are read after the
fork, when `dask.config.refresh` runs. `/proc/<pid>/environ` of a forked process shows the fork server's
environment: its group marker is the fork server's, which `processes.signal_group` accepts. And forked
processes share the fork server's string-hash seed, where plainly started ones each draw their own: code
that wrongly expects two processes to iterate a set of strings in the same order would pass here. Users'
clusters start their workers from the command line; the tests of what a user meets start theirs that way.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .processes import GROUP_ENV, log_tail, mark_group

__all__ = [
    "FORKED_IMPORTS",
    "FORK_SERVER_ENV",
    "FORK_SERVER_SOCKET_ENV",
    "ForkServer",
    "ForkedProcess",
    "fork_server_wanted",
    "shared_fork_server",
]

# "1": the local clusters that are not told otherwise fork their workers from a fork server (the test suite
# sets it, for itself and the processes it starts).
FORK_SERVER_ENV = "PREFECT_ELASTIC_FORK_SERVER"
# Where this process's fork server listens: set by the process that started it, for the processes it starts.
FORK_SERVER_SOCKET_ENV = "PREFECT_ELASTIC_FORK_SERVER_SOCKET"

# What the fork server imports for every process it forks: the Dask worker's command line, the compute
# loop's and the data server's modules (torch with them), and torch._dynamo, which the first optimizer step
# of a process imports (1.7 s of CPU that each static worker would pay again).
FORKED_IMPORTS = [
    "distributed.cli.dask_worker",
    "prefect_elastic.compute",
    "prefect_elastic.data_server",
    "torch._dynamo",
]

_READY_TIMEOUT_S = 120.0  # the imports take 3 to 5 s on an idle machine, much longer on a loaded one
_REPLY_TIMEOUT_S = 60.0


class ForkedProcess:
    """A process forked by a `ForkServer`, with the parts of `subprocess.Popen` the harness uses.

    It is not this process's child: the fork server reaps it and reports its exit code, which `poll` and
    `wait` return (None while it runs)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        """The fork server reported this child's end with `code`."""
        self.returncode = code
        self._exited.set()


class ForkServer:
    """One fork server, seen from a process that uses it: one it started (`start`: with `env`, it imports
    `imports` once) or one it connected to (`connect`); either forks a process for each `spawn`."""

    def __init__(
        self,
        imports: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
    ) -> None:
        self.imports = list(imports)
        self.log = log
        self.env = dict(env)
        self.cwd = cwd
        # Every process forked here shows the server's environment, so this is its group marker too.
        self.marker = uuid.uuid4().hex
        self.socket_path: Path | None = None  # where it listens for other processes (one it started)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._replied = threading.Condition(self._lock)
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # pid -> code, reported before the reply naming the pid
        self._ready = threading.Event()
        self._gone = threading.Event()

    @property
    def ready(self) -> bool:
        """Whether the server has imported and forks at once (False once it is gone)."""
        return self._ready.is_set() and not self._gone.is_set()

    @property
    def gone(self) -> bool:
        """Whether the server has exited, or the connection to it closed (then it forks nothing more)."""
        return self._gone.is_set()

    @property
    def pid(self) -> int:
        assert self._pid, "the fork server is not started"
        return self._pid

    def start(self, listen: Path | None = None) -> None:
        """Start the server; it imports in the background (`spawn` waits for it). With `listen`, it also
        serves other processes on that Unix socket."""
        self.socket_path = listen
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefect_elastic.local.forkserver_process",
                    *(["--listen", str(listen)] if listen is not None else []),
                    *self.imports,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env={**self.env, GROUP_ENV: self.marker},
                cwd=self.cwd,
                start_new_session=True,
            )
        self._pid = self._proc.pid
        assert self._proc.stdout is not None
        self._read_in_background(self._proc.stdout)

    def connect(self, path: str) -> None:
        """Use the fork server listening at `path` (OSError if none does)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            # The server's pid, which its forks' watchdogs watch as their parent, without waiting for it.
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            sock.close()
            raise
        self._pid = struct.unpack("3i", creds)[0]
        self._sock = sock
        self._read_in_background(sock.makefile("rb"))
        # It has imported long ago, as a rule: its greeting is a moment away, and a cluster that sees it
        # ready forks its scheduler too.
        self._ready.wait(1.0)

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: str | os.PathLike[str]
    ) -> ForkedProcess:
        """Fork a process that runs ``python -m argv...`` in `cwd` with `env`, its output added to `log`."""
        assert self._pid, "the fork server is not started"
        if not self._ready.wait(_READY_TIMEOUT_S) or self._gone.is_set():
            raise RuntimeError(f"the fork server did not start\n{log_tail(self.log)}")
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            line = json.dumps(
                {"id": request_id, "argv": list(argv), "env": dict(env), "log": str(log), "cwd": str(cwd)}
            )
            with contextlib.suppress(OSError):  # a server gone is seen below
                self._write(line.encode() + b"\n")
            deadline = time.monotonic() + _REPLY_TIMEOUT_S
            while request_id not in self._replies:
                left = deadline - time.monotonic()
                if self._gone.is_set() or left <= 0:
                    raise RuntimeError(f"the fork server did not fork {argv[0]}\n{log_tail(self.log)}")
                self._replied.wait(left)
            reply = self._replies.pop(request_id)
            if "error" in reply:
                raise RuntimeError(f"the fork server could not fork {argv[0]}: {reply['error']}")
            child = ForkedProcess(int(reply["pid"]), [sys.executable, "-m", *argv])
            mark_group(child, self.marker)
            self._children[child.pid] = child
            early = self._early_exits.pop(child.pid, None)
        if early is not None:
            child.exited(early)
        return child

    def close(self, grace: float = 5.0) -> None:
        """Stop the server (its stdin closed, then SIGKILL after `grace`) and so its children; or close the
        connection to it, which ends the children forked through it."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace)

    def _write(self, data: bytes) -> None:
        if self._sock is not None:
            self._sock.sendall(data)
            return
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def _read_in_background(self, lines: Iterable[bytes]) -> None:
        threading.Thread(
            target=self._read_replies, args=(lines,), name="fork-server-replies", daemon=True
        ).start()

    def _read_replies(self, lines: Iterable[bytes]) -> None:
        with contextlib.suppress(OSError, ValueError):  # a connection closed here, by `close`
            for raw in lines:
                message = json.loads(raw)
                if message.get("ready"):
                    self.marker = message.get("marker") or self.marker
                    self._ready.set()
                    continue
                with self._lock:
                    if "exit" in message:
                        pid, code = int(message["exit"]), int(message["code"])
                        child = self._children.pop(pid, None)
                        if child is None:
                            self._early_exits[pid] = code
                        else:
                            child.exited(code)
                    else:
                        self._replies[int(message["id"])] = message
                        self._replied.notify_all()
        # The server is gone: its children's watchdogs end them (their parent changed); none is reaped here.
        with self._lock:
            self._gone.set()
            self._ready.set()
            children, self._children = list(self._children.values()), {}
            self._replied.notify_all()
        for child in children:
            child.exited(-signal.SIGKILL)


def fork_server_wanted(given: bool | None) -> bool:
    """A cluster's `fork_server` setting: as given, or from `FORK_SERVER_ENV` when None."""
    return os.environ.get(FORK_SERVER_ENV) == "1" if given is None else given


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_fork_server(env: Mapping[str, str], cwd: str | os.PathLike[str]) -> ForkServer:
    """This process's fork server, for every cluster it starts: its imports are paid once, not once a
    cluster. The one that the process that started this one named (`FORK_SERVER_SOCKET_ENV`) if it still
    listens; otherwise one started here, with `env`, which listens for the processes started from here.
    Each forked process gets its own environment and directory; only what the server imported
    (distributed, torch, this package) and the settings those read at import time come from the `env`
    it was started with."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.gone:
            log_dir = Path(tempfile.mkdtemp(prefix="prefect-elastic-fork-server-"))
            server = ForkServer(FORKED_IMPORTS, log=log_dir / "fork-server.log", env=env, cwd=cwd)
            given = os.environ.get(FORK_SERVER_SOCKET_ENV)
            try:
                if not given or (_shared is not None and str(_shared.socket_path) == given):
                    raise OSError("no fork server to connect to")
                server.connect(given)
            except OSError:
                server.start(listen=log_dir / "fork-server.sock")
                os.environ[FORK_SERVER_SOCKET_ENV] = str(server.socket_path)
            atexit.register(server.close)
            _shared = server
        return _shared
