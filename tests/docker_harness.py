"""A private Docker engine for the compose test, and the docker-compose commands it runs.

`DockerEngine` starts its own `dockerd` (no bridge, no iptables rules: the stack runs with host networking
on 127.0.0.1) with its socket, pid file and exec root in a fresh temporary folder, and stops it with every
process it started. Its data root is kept under the cache folder of scripts/build-image.sh, so the image
built on one run is there on the next. `Compose` runs docker-compose for one project name against it.

Used by tests/test_compose.py only; it needs root, and the packages of scripts/install-docker.sh.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bounds of the waits below; none of them is a timing assertion.
ENGINE_START_S = 60.0
ENGINE_STOP_S = 30.0


def cache_dir() -> Path:
    """The cache of scripts/build-image.sh (rootfs, wheelhouse); the engine's data root is kept there too."""
    given = os.environ.get("PREFECT_ELASTIC_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "prefect-elastic"


def missing_tools() -> list[str]:
    return [tool for tool in ("dockerd", "docker", "docker-compose", "debootstrap") if not shutil.which(tool)]


class DockerEngine:
    """One `dockerd` of this test session; `env` is what a docker client needs to talk to it."""

    def __init__(self, data_root: Path) -> None:
        self.data_root = data_root
        # A short path: a unix socket path is limited to about 100 characters.
        self.run_dir = Path(tempfile.mkdtemp(prefix="pe-docker-"))
        self.socket = self.run_dir / "docker.sock"
        self.log_path = self.run_dir / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        # The classic builder: BuildKit needs the buildx plugin, which Debian's docker.io does not have.
        env["DOCKER_BUILDKIT"] = "0"
        env["COMPOSE_DOCKER_CLI_BUILD"] = "0"
        return env

    def start(self) -> DockerEngine:
        self.data_root.mkdir(parents=True, exist_ok=True)
        args = [
            "dockerd",
            "--iptables=false",
            "--ip-masq=false",
            "--bridge=none",
            "--data-root",
            str(self.data_root),
            "--exec-root",
            str(self.run_dir / "exec"),
            "--pidfile",
            str(self.run_dir / "dockerd.pid"),
            "-H",
            f"unix://{self.socket}",
        ]
        with open(self.log_path, "wb") as log:
            # Its own session: stop() can signal everything it started (its containerd included) as a group.
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ENGINE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            done = subprocess.run(["docker", "version"], env=self.env, capture_output=True, check=False)
            if done.returncode == 0:
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"dockerd did not answer within {ENGINE_START_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(ENGINE_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(ENGINE_STOP_S)
        if proc is not None:
            # Whatever of its session is left (a containerd that outlived it): only processes it started.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        # dockerd leaves its default network namespace bind-mounted under the exec root.
        for mount in reversed(_mounts_under(self.run_dir)):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no dockerd log)"

    def __enter__(self) -> DockerEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _mounts_under(folder: Path) -> list[str]:
    """Mount points at or below `folder`, parents first (from /proc/self/mountinfo)."""
    prefix = str(folder)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [line.split()[4] for line in lines if len(line.split()) > 4]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


class Compose:
    """docker-compose for one project (`-p name`) with the given compose files, against one engine."""

    def __init__(
        self, engine: DockerEngine, project: str, files: Sequence[Path], env: dict[str, str]
    ) -> None:
        self.engine = engine
        self.project = project
        self.files = list(files)
        self.env = engine.env | env

    def run(self, *args: str, timeout: float = 300.0, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        done = subprocess.run(
            [*cmd, *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def docker(self, *args: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=True
        )
        return done.stdout

    def containers(self, service: str) -> list[str]:
        """Ids of the running containers of one service."""
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        return self.docker(
            "ps", "-q", *(a for label in labels for a in ("--filter", f"label={label}"))
        ).split()

    def container_log(self, container: str) -> str:
        """All a container wrote, stdout and stderr together."""
        done = subprocess.run(
            ["docker", "logs", container],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
            check=False,
        )
        return done.stdout

    def logs(self, tail: int = 60) -> str:
        return self.run("logs", "--no-color", f"--tail={tail}", check=False, timeout=60)

    @contextlib.contextmanager
    def up(self, *args: str, timeout: float = 300.0) -> Iterator[Compose]:
        """`up -d ARGS` for the block, then `down -t 3 -v`, whatever happened in it."""
        try:
            self.run("up", "-d", *args, timeout=timeout)
            yield self
        finally:
            self.run("down", "-t", "3", "-v", "--remove-orphans", check=False, timeout=180)
