"""Starting and stopping the process groups of the local harness.

Every process that `LocalElasticCluster` (a scheduler, a nanny or worker) or `PrefectServer` (uvicorn and
the services it starts) runs is the leader of a session of its own, so that one signal to its process group
reaches everything it started, and so that a test can signal one worker without touching the rest. This
module owns that: `start_group` starts a leader with its output in a log file, `signal_group` signals the
whole group, `stop_groups` ends groups (SIGTERM, a grace period, then SIGKILL) and `log_tail` reads the
end of a log for an error message. Its callers decide what to start and when; nothing here knows Dask or
Prefect.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

import psutil

__all__ = ["GROUP_ENV", "Leader", "log_tail", "mark_group", "signal_group", "start_group", "stop_groups"]

_REAP_S = 5.0  # how long to wait for a leader to be reaped after its SIGKILL
# Every process of a group started here inherits this variable, with a value of that group's own.
GROUP_ENV = "PREFECT_ELASTIC_PROCESS_GROUP"


class Leader(Protocol):
    """A group's leading process as the functions here use it: a `subprocess.Popen`, or a process that a
    fork server started and reaps (`forkserver.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# A leader: its group's marker (not keyed by pid, which the kernel reuses).
_MARKERS: weakref.WeakKeyDictionary[Leader, str] = weakref.WeakKeyDictionary()


def mark_group(leader: Leader, marker: str) -> None:
    """Record the value of `GROUP_ENV` that the members of `leader`'s group show in their environment."""
    _MARKERS[leader] = marker


def end_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the child when the thread that started it ends (even by SIGKILL of the process)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_group(
    command: list[str],
    *,
    log: Path,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `command` as the leader of a new session, its stdout and stderr appended to `log`.

    ``die_with_parent`` (Linux only) makes the kernel SIGTERM the leader when the *thread* that started it
    ends, so start such groups from the main thread or they go with the thread.
    """
    marker = uuid.uuid4().hex
    with open(log, "ab") as out:
        # The child keeps its own copy of the descriptor; ours can be closed at once.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, GROUP_ENV: marker},
            cwd=cwd,
            start_new_session=True,
            preexec_fn=end_with_parent if die_with_parent and sys.platform == "linux" else None,
        )
    _MARKERS[proc] = marker
    return proc


def signal_group(proc: Leader, sig: int) -> None:
    """Send `sig` to the process group that `proc` leads; a group that is gone already is no error."""
    if proc.poll() is None:
        # The leader lives (or is an unreaped zombie): the group's id is still its pid, and ours.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        return
    # The group outlives its leader while a child is alive (a nanny's worker, uvicorn's services), so its
    # members are signalled even when the leader has exited. But once every member is gone the kernel may
    # give the number to a new process, which can lead a group of its own (another cluster's worker: this
    # machine's pid_max is 32768, and a test session starts thousands of processes). So only the members
    # that carry this group's marker in their environment are signalled, one by one.
    marker = _MARKERS.get(proc)
    for member in _members(proc.pid):
        try:
            if marker is not None and member.environ().get(GROUP_ENV) == marker:
                member.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def _members(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            if os.getpgid(process.pid) == pgid:
                found.append(process)
    return found


def stop_groups(procs: Iterable[Leader], grace: float = 5.0) -> None:
    """End the groups that `procs` lead: SIGTERM, up to `grace` seconds for all of them together to exit,
    then SIGKILL to each whole group (which also reaches children that outlived their leader)."""
    procs = list(procs)
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
        # A SIGSTOPped group would hold the SIGTERM pending until the SIGKILL; let it act on it now.
        signal_group(proc, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_REAP_S)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log, under a line that names it, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"--- last {lines} lines of {path} ---\n{tail}"


class Service:
    """A process this harness runs for a test or a demo (a Prefect server, PostgreSQL, SLURM): `start()`
    returns it running, `cleanup()` stops it and removes what it left; ``with`` does both."""

    def start(self) -> Self:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
