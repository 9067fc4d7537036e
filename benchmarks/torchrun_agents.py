"""The torchrun agents of the torchrun baseline (`torchrun_bench.py`) as processes: a free port, the
workers' environment, the JSON lines their workers append (`StepLog`), and the agents a run started with
every process under them, to kill them all (`Agents`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"})
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class StepLog:
    """Tails the workers' JSON-lines file; `records` holds every complete line read so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.torn = 0
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """Read the lines appended since the last poll and return them."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # a line still being written
        new = []
        for line in lines:
            if not line.strip():
                continue
            try:
                new.append(json.loads(line))
            except ValueError:  # a line torn by a SIGKILL mid-write (writes of a line are one append)
                self.torn += 1
        self.records.extend(new)
        return new

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "step" in r]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == name]

    def wait(self, until: Callable[[StepLog], bool], timeout: float, interval: float = 0.02) -> bool:
        """Poll until `until(self)` holds or `timeout` seconds pass; returns whether it held."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if until(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)


@dataclass
class Agents:
    """The torchrun agents one benchmark started, and how to kill them and all their workers: torchrun
    starts each worker in a session of its own, so killing an agent's process group does not reach them."""

    steplog: StepLog
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    _known: dict[int, psutil.Process] = field(default_factory=dict)

    def start(self, command: list[str], env: dict[str, str], output: Path) -> subprocess.Popen[bytes]:
        with open(output, "ab") as out:
            proc = subprocess.Popen(
                command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        self.commands.append(command)
        self._remember(proc.pid)
        return proc

    def _remember(self, pid: int, worker: bool = False) -> None:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if worker and str(self.steplog.path) not in proc.cmdline():
                return  # that worker is gone and its pid now belongs to someone else
            self._known.setdefault(pid, proc)
            for child in proc.children(recursive=True):
                self._known.setdefault(child.pid, child)

    def refresh(self) -> None:
        """Note every descendant of our agents, and every worker pid the log names, while they live, so
        that `kill_all` can reach them even once orphaned (psutil.Process checks the pid was not reused)."""
        for proc in self.procs:
            self._remember(proc.pid)
        for start in self.steplog.events("start"):
            self._remember(int(start["pid"]), worker=True)

    def kill_agent(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """SIGKILL one agent and its workers at once (a node dying); returns the pids killed."""
        self.refresh()
        victims = [proc.pid]
        with contextlib.suppress(psutil.Error):
            victims += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        return victims

    def kill_all(self) -> None:
        self.refresh()
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for known in self._known.values():
            with contextlib.suppress(psutil.Error):
                known.kill()  # checks the pid still is the process we saw, unlike os.kill
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        psutil.wait_procs(list(self._known.values()), timeout=10)


@contextlib.contextmanager
def agents(steplog: StepLog) -> Iterator[Agents]:
    group = Agents(steplog)
    try:
        yield group
    finally:
        group.kill_all()


def prepare(workdir: Path, name: str) -> tuple[Path, Path, Path]:
    """Fresh log, checkpoint and agent-output paths for one run under `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = workdir / f"{name}.jsonl", workdir / f"{name}.ckpt.pt", workdir / f"{name}.agent.log"
    for path in paths:
        path.unlink(missing_ok=True)
    return paths
