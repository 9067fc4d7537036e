"""A throwaway SLURM cluster on this machine: `slurmctld` and two `slurmd` nodes on 127.0.0.1.

`LocalSlurm` writes a `slurm.conf` into a temporary folder (state, spool, logs and pid files all there),
makes sure `munged` runs (starting one if none answers), starts `slurmctld` and one `slurmd` per node in
the foreground as our children, and waits (bounded) until every node is idle. `env` holds `SLURM_CONF`
for the commands (`sbatch`, `squeue`, `scancel`, and dask-jobqueue's calls to them); `activate()` sets it
in this process's environment while the cluster is up. On exit it cancels every job, waits (bounded) for
them to end, stops the daemons it started (and the `munged` if it started that one) and removes the folder.

For tests and for trying a job on SLURM locally (`dask_jobqueue.SLURMCluster`); it is no way to run a real
SLURM site: everything runs as root, on one host, with no accounting. The daemons run in the foreground
(`-D`, munged `-F`) rather than as the daemons `slurmctld` starts by default, so that a test process that
dies takes them with it (`processes.start_group(die_with_parent=True)`) instead of leaving them running.
The packages come from `scripts/install-slurm.sh`; if they are missing the error says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from . import processes
from .prefect_server import free_port

__all__ = ["LocalSlurm", "SlurmUnavailableError"]

log = logging.getLogger(__name__)

_DAEMONS = ("slurmctld", "slurmd", "munged")
_COMMANDS = ("sbatch", "squeue", "scancel", "sinfo", "munge")
_INSTALL_HINT = (
    "install SLURM and munge: `scripts/install-slurm.sh` (Debian/Ubuntu: `apt-get install -y "
    "--no-install-recommends slurmctld slurmd slurm-client munge`)"
)


class SlurmUnavailableError(RuntimeError):
    """SLURM's daemons or commands, or munge, are missing on this machine (or we are not root)."""


def _find(name: str) -> str:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise SlurmUnavailableError(f"{name} not found; {_INSTALL_HINT}")
    return found


class LocalSlurm(processes.Service):
    """SLURM with `nodes` nodes (`n1`, `n2`, ...) of `cpus` CPUs each, all on 127.0.0.1; a context manager.

    `kill_wait` is SLURM's `KillWait`: the seconds between the SIGTERM of a cancelled (or pre-empted, or
    timed out) job and its SIGKILL; a Dask worker must leave within it to leave gracefully.
    """

    def __init__(
        self,
        *,
        nodes: int = 2,
        cpus: int = 8,
        memory_mb: int = 8000,
        kill_wait: int = 5,
        startup_timeout: float = 60.0,
    ) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailableError("LocalSlurm runs slurmd, which needs root to launch jobs")
        self.paths = {name: _find(name) for name in (*_DAEMONS, *_COMMANDS)}
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.kill_wait = kill_wait
        self.startup_timeout = startup_timeout
        self.folder: Path | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._munged: subprocess.Popen[bytes] | None = None

    # -- what callers use ---------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        if self.folder is None:
            raise RuntimeError("SLURM is not started")
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with `SLURM_CONF` pointing at our cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Set `SLURM_CONF` in this process while inside, so that dask-jobqueue's `sbatch` finds us."""
        before = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before

    def command(self, *args: str, timeout: float = 30.0) -> str:
        """Run a SLURM command (`squeue`, `scancel`, `sbatch`, ...) against this cluster; its stdout."""
        name, *rest = args
        done = subprocess.run(
            [self.paths.get(name, name), *rest],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> dict[str, str]:
        """The jobs SLURM knows, running or pending: job id -> state (`RUNNING`, `PENDING`, ...)."""
        out = self.command("squeue", "-h", "-o", "%i %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job_of(self, pid: int) -> str | None:
        """The SLURM job id a process on this host runs in (from its environment), or None."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        for item in environ:
            if item.startswith(b"SLURM_JOB_ID="):
                return item.split(b"=", 1)[1].decode()
        return None

    def wait_until(self, predicate: object, timeout: float, what: str, poll: float = 0.25) -> None:
        """Poll `predicate()` until it is true, for at most `timeout` seconds."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(poll)

    def log_tail(self, lines: int = 20) -> str:
        if self.folder is None:
            return ""
        return "\n".join(processes.log_tail(p, lines) for p in sorted((self.folder / "log").glob("*.log")))

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> LocalSlurm:
        if self._procs:
            raise RuntimeError("SLURM is already started")
        # Under the system's temporary folder: slurmd's job steps and the jobs read from it.
        self.folder = Path(tempfile.mkdtemp(prefix="prefect-elastic-slurm-"))
        try:
            for sub in ("state", "log", "run"):
                (self.folder / sub).mkdir()
            self._write_conf()
            self._ensure_munged()
            env = self.env
            logs = self.folder / "log"
            self._procs.append(
                processes.start_group(
                    [self.paths["slurmctld"], "-D", "-f", str(self.conf)],
                    log=logs / "slurmctld.out",
                    env=env,
                    cwd=self.folder,
                    die_with_parent=True,
                )
            )
            for node in self.nodes:
                self._procs.append(
                    processes.start_group(
                        [self.paths["slurmd"], "-D", "-f", str(self.conf), "-N", node],
                        log=logs / f"slurmd-{node}.out",
                        env=env,
                        cwd=self.folder,
                        die_with_parent=True,
                    )
                )
            self.wait_until(self._nodes_idle, self.startup_timeout, f"SLURM nodes {self.nodes} idle")
        except BaseException:
            self.cleanup()
            raise
        log.info("SLURM with nodes %s in %s", ", ".join(self.nodes), self.folder)
        return self

    def _write_conf(self) -> None:
        assert self.folder is not None
        d = self.folder
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=prefect-elastic-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            # Every process of a job is tracked by its parentage: no cgroups needed on a test machine.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # Nodes may claim more CPUs than the host has (several small jobs per node).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MinJobAge=30",
            f"KillWait={self.kill_wait}",
        ]
        for node in self.nodes:
            # RealMemory must be set: dask-jobqueue asks for --mem with every job.
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} RealMemory={self.memory_mb}"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _munge_answers(self) -> bool:
        # `munge -n` rather than looking for the process: a dead munged can linger as a zombie.
        done = subprocess.run(
            [self.paths["munge"], "-n"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10
        )
        return done.returncode == 0

    def _ensure_munged(self) -> None:
        """munged must answer before slurmd starts: a slurmd without it retries forever, deaf to SIGTERM."""
        if self._munge_answers():
            return  # the system's munged, or another harness's: used, never stopped here
        assert self.folder is not None
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, user="munge", group="munge")
        # Started as the munge user by Popen itself, not through `runuser`: runuser forks, and a munged
        # orphaned by its end would stay a zombie under an init that does not reap.
        with open(self.folder / "log" / "munged.out", "ab") as out:
            self._munged = subprocess.Popen(
                [self.paths["munged"], "-F"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,
                user="munge",
                group="munge",
                extra_groups=[],
                preexec_fn=processes.end_with_parent,
            )
        self.wait_until(self._munge_answers, 30.0, "munged answering `munge -n`", poll=0.1)

    def _nodes_idle(self) -> bool:
        try:
            out = self.command("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            return False  # slurmctld not answering yet
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every job and wait for them to end (their `slurmstepd`s are not our children: the jobs
        must end through SLURM), then stop the daemons we started."""
        if self._procs and self.folder is not None:
            with contextlib.suppress(Exception):
                self.command("scancel", "--user", "root", timeout=10)
            with contextlib.suppress(Exception):
                self.wait_until(lambda: not self.jobs(), timeout, "every SLURM job ended", poll=0.2)
        procs, self._procs = self._procs, []
        processes.stop_groups(procs, grace=10.0)
        munged, self._munged = self._munged, None
        if munged is not None:
            processes.stop_groups([munged], grace=5.0)

    def cleanup(self) -> None:
        self.stop()
        folder, self.folder = self.folder, None
        if folder is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(folder)
