"""Worker processes forked from one that has imported everything already: a local cluster's fork server.

Every Dask worker of the local harness imports distributed, torch and this package before it can register:
about 3.3 s of CPU, and its first optimizer step imports torch._dynamo for 1.7 s more. A cluster of four
workers with nannies spends some 18 s of CPU starting, and a test session starts hundreds of them. With
``LocalElasticCluster(fork_server=True)`` one process per cluster (this module run as ``python -m``) pays
the imports once; each worker (or nanny) is then a `fork` of it that runs ``dask worker`` with its own
arguments, environment, log and session, so that a test can still kill it, or its whole group, with a real
signal. A nanny forks its worker process in turn (`multiprocessing-method: fork`), so that process starts
with the imports done too.

What differs from a worker started with ``dask worker`` from a shell, and why the harness keeps both: a
forked worker's imports were done before its environment was set, so settings read at import time come
from the cluster's environment (the same for every worker of a cluster, given to the fork server), and
the per-worker ones (preloads, the process-group marker, the parent to die with) are read after the fork,
when `dask.config.refresh` runs. `/proc/<pid>/environ` of a forked process shows the fork server's
environment: its group marker is the fork server's, which `processes.signal_group` accepts. And forked
processes share the fork server's string-hash seed, where plainly started ones each draw their own: code
that wrongly expects two processes to iterate a set of strings in the same order would pass here. Users'
clusters start their workers from the command line; the tests of what a user meets start theirs that way.

The protocol on the fork server's stdin and stdout is one JSON object a line: a request ``{"id", "argv",
"env", "log", "cwd"}`` is answered ``{"id", "pid"}`` (or ``{"id", "error"}``), and every child that exits
is reported ``{"exit": pid, "code": c}`` (`subprocess` conventions: ``-N`` for a signal). The server
exits when its stdin closes: the process that owns the cluster is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .processes import GROUP_ENV, log_tail, mark_group

__all__ = [
    "FORKED_IMPORTS",
    "FORK_SERVER_ENV",
    "ForkServer",
    "ForkedProcess",
    "fork_server_wanted",
    "shared_fork_server",
]

# "1": the local clusters that are not told otherwise fork their workers from a fork server (the test suite
# sets it, for itself and the processes it starts).
FORK_SERVER_ENV = "PREFECT_ELASTIC_FORK_SERVER"

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

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class ForkServer:
    """One fork server: started with the environment every worker of a cluster shares, it imports
    `imports` once and then forks a process for each `spawn`."""

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
        self._proc: subprocess.Popen[bytes] | None = None
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
        """Whether the server has exited (then it forks nothing more)."""
        return self._gone.is_set()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the fork server is not started"
        return self._proc.pid

    def start(self) -> None:
        """Start the server; it imports in the background (`spawn` waits for it)."""
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, *self.imports],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env={**self.env, GROUP_ENV: self.marker},
                cwd=self.cwd,
                start_new_session=True,
            )
        threading.Thread(target=self._read_replies, name="fork-server-replies", daemon=True).start()

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: str | os.PathLike[str]
    ) -> ForkedProcess:
        """Fork a process that runs ``python -m argv...`` in `cwd` with `env`, its output added to `log`."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None, "the fork server is not started"
        if not self._ready.wait(_READY_TIMEOUT_S) or self._gone.is_set():
            raise RuntimeError(f"the fork server did not start\n{log_tail(self.log)}")
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            line = json.dumps(
                {"id": request_id, "argv": list(argv), "env": dict(env), "log": str(log), "cwd": str(cwd)}
            )
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
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
            child._exit(early)
        return child

    def close(self, grace: float = 5.0) -> None:
        """Stop the server (its stdin closed, then SIGKILL after `grace`); stop its children first."""
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

    def _read_replies(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for raw in proc.stdout:
            message = json.loads(raw)
            if message.get("ready"):
                self._ready.set()
                continue
            with self._lock:
                if "exit" in message:
                    pid, code = int(message["exit"]), int(message["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code
                    else:
                        child._exit(code)
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
            child._exit(-signal.SIGKILL)


# ---------------------------------------------------------------------------------------- the server side


def fork_server_wanted(given: bool | None) -> bool:
    """A cluster's `fork_server` setting: as given, or from `FORK_SERVER_ENV` when None."""
    return os.environ.get(FORK_SERVER_ENV) == "1" if given is None else given


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_fork_server(env: Mapping[str, str], cwd: str | os.PathLike[str]) -> ForkServer:
    """This process's fork server, started (with `env`) by the first cluster that asks, for every cluster
    after it: its imports are paid once a process, not once a cluster. Each forked process gets its own
    environment and directory; only what the server imported (distributed, torch, this package) and the
    settings those read at import time come from the first cluster's `env`."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.gone:
            log_dir = Path(tempfile.mkdtemp(prefix="prefect-elastic-fork-server-"))
            server = ForkServer(FORKED_IMPORTS, log=log_dir / "fork-server.log", env=env, cwd=cwd)
            server.start()
            atexit.register(server.close)
            _shared = server
        return _shared


def _send(message: dict[str, Any]) -> None:
    # Straight to the descriptor: no buffered stream whose lock a child could inherit half-taken.
    os.write(1, json.dumps(message).encode() + b"\n")


def _serve() -> dict[str, Any] | None:
    """Answer requests until stdin closes (return None), or return the request a forked child runs."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup pipe
    pending = b""
    _send({"ready": True})
    while True:
        readable, _, _ = select.select([0, wakeup_r], [], [])
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
            _reap()
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _send({"id": request["id"], "error": repr(exc)})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wakeup_r)
                os.close(wakeup_w)
                return dict(request)
            _send({"id": request["id"], "pid": pid})


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any]) -> None:
    """In the forked child: take the request's session, output, directory and environment."""
    os.setsid()
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # The import path as `python -m` from there with that PYTHONPATH would have begun: the directory, then
    # PYTHONPATH's entries; the server's own entries (the interpreter's) after them.
    given = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    rest = [entry for entry in sys.path[1:] if entry not in given]
    sys.path[:] = [os.getcwd(), *given, *rest]
    import dask.config

    dask.config.refresh()  # the worker's own settings (its preloads) come from the environment just set
    sys.argv = [request["argv"][0], *request["argv"][1:]]


def main(imports: Sequence[str]) -> int:
    for name in imports:
        importlib.import_module(name)
    # What the imports made lives as long as any fork: out of the collector's sight, a fork's collections
    # neither scan it nor write its headers (which would copy the pages it shares with this process).
    gc.collect()
    gc.freeze()
    request = _serve()
    if request is None:
        return 0
    _become(request)
    module = request["argv"][0]
    import runpy
    import warnings

    # As `python -m module args...`: the module runs as __main__ and ends with its own sys.exit. It was
    # imported here already (that is the point), which runpy warns about; running it again is what we want.
    warnings.filterwarnings("ignore", ".*found in sys.modules after import of package", RuntimeWarning)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = _exit_code(done.code)
    # What the interpreter's exit does first: wait for the threads that are not daemons, run the atexit
    # functions, flush. Not what it does next, free every object: in a fork that touches, and so copies,
    # every page it shares with the fork server (2 to 3 s of CPU for each worker of a closing cluster).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status `sys.exit(code)` gives a process (a message: printed, and 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
