"""The fork server's own process (run as ``python -m``): import once, then fork a worker per request.

The owner (the process that started it) speaks on its stdin and stdout; other processes may connect to its
Unix socket (``--listen PATH``) and speak the same protocol there. That is how the flows and commands a
test runs in a subprocess fork their workers from the test session's fork server instead of starting one
of their own (6.5 s of CPU for its imports, on each such test's critical path). The protocol is one JSON
object a line:

- the server says ``{"ready": true, "marker": ...}`` once it has imported (to a connection: on accept),
  the marker being the process-group marker that every fork shows in its environment;
- a request ``{"id", "argv", "env", "log", "cwd"}`` is answered ``{"id", "pid"}`` (or ``{"id", "error"}``);
- every child that exits is reported ``{"exit": pid, "code": c}`` (`subprocess` conventions: ``-N`` for
  a signal) to the connection that asked for it.

A connection that closes takes its children with it (SIGKILL to each one's group): the process that owned
them is gone, as the watchdog of a plainly started worker would see. The server exits when its stdin
closes; its forks then see their parent change, and their watchdogs end them.
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
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .processes import GROUP_ENV


@dataclass
class _Connection:
    """One client of the server: the owner's stdin and stdout, or an accepted socket."""

    read_fd: int
    write_fd: int
    sock: socket.socket | None = None
    pending: bytes = b""
    children: set[int] = field(default_factory=set)

    def send(self, message: dict[str, Any]) -> bool:
        """Write one line (straight to the descriptor: no buffered stream whose lock a child could inherit
        half-taken); False if the other end is gone."""
        data = json.dumps(message).encode() + b"\n"
        try:
            while data:
                data = data[os.write(self.write_fd, data) :]
        except OSError:
            return False
        return True


def _ready() -> dict[str, Any]:
    return {"ready": True, "marker": os.environ.get(GROUP_ENV, "")}


def _serve(listener: socket.socket | None) -> dict[str, Any] | None:
    """Answer requests until stdin closes (return None), or return the request a forked child runs."""
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup pipe
    owner = _Connection(0, 1)
    connections = {0: owner}
    owner.send(_ready())
    while True:
        watched = [wakeup_r, *connections, *([listener.fileno()] if listener is not None else [])]
        readable, _, _ = select.select(watched, [], [])
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
            _reap(connections)
        if listener is not None and listener.fileno() in readable:
            sock, _ = listener.accept()
            connection = _Connection(sock.fileno(), sock.fileno(), sock)
            connections[sock.fileno()] = connection
            connection.send(_ready())
        for fd in readable:
            client = connections.get(fd)
            if client is None:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if client is owner:
                    return None
                _drop(connections.pop(fd))
                continue
            client.pending += chunk
            while b"\n" in client.pending:
                line, client.pending = client.pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    client.send({"id": request["id"], "error": repr(exc)})
                    continue
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd_ in (wakeup_r, wakeup_w):
                        os.close(fd_)
                    for other in connections.values():
                        if other.sock is not None:
                            other.sock.close()
                    if listener is not None:
                        listener.close()
                    return dict(request)
                client.children.add(pid)
                client.send({"id": request["id"], "pid": pid})


def _reap(connections: dict[int, _Connection]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for connection in connections.values():
            if pid in connection.children:
                connection.children.discard(pid)
                connection.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                break


def _drop(connection: _Connection) -> None:
    """A client is gone: end what it started (each fork leads a session of its own, and a nanny's worker
    is in its nanny's group), and forget it. The exits are reaped as they come."""
    for pid in connection.children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # one that had not taken its own session yet
    assert connection.sock is not None
    connection.sock.close()


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


def main(imports: Sequence[str], listen: str | None = None) -> int:
    listener = None
    if listen is not None:
        # Bound before the imports, so that a client may connect at once; it is answered once they are done.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(listen)
        os.chmod(listen, 0o600)
        listener.listen(64)
    for name in imports:
        importlib.import_module(name)
    # What the imports made lives as long as any fork: out of the collector's sight, a fork's collections
    # neither scan it nor write its headers (which would copy the pages it shares with this process).
    gc.collect()
    gc.freeze()
    request = _serve(listener)
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
    args = sys.argv[1:]
    listen_at = None
    if args[:1] == ["--listen"]:
        listen_at, args = args[1], args[2:]
    sys.exit(main(args, listen_at))
