"""A throwaway PostgreSQL server on 127.0.0.1, for a Prefect server that should not run on SQLite.

`LocalPostgres` makes a fresh cluster with `initdb` in a temporary folder, runs `postgres` on a free port
(TCP on 127.0.0.1 only, its Unix socket in that folder), creates a user and a database for Prefect, and
gives their SQLAlchemy URL (`url`, `postgresql+asyncpg://...`) to hand to `PrefectServer(database_url=...)`.
On exit it stops the server and removes the folder. Used by the tests and by anyone who wants to try the
Prefect server on Postgres locally; it is no way to run a production database (trust authentication).

It runs `postgres` itself rather than `pg_ctl start`: pg_ctl daemonizes the server, so a test process that
is SIGKILLed would leave it running; as our child in its own process group it gets SIGTERM when we die
(`processes.start_group(die_with_parent=True)`), and `stop` ends the whole group.

PostgreSQL refuses to run as root: as root, every PostgreSQL command runs as the `postgres` user through
`runuser`, and the folder is made outside pytest's private temporary folders (0700, which that user
cannot enter). The binaries are found in `/usr/lib/postgresql/<newest>/bin` (Debian's layout) or on PATH;
if they are missing the error says what to install.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from . import processes
from .prefect_server import free_port

__all__ = ["LocalPostgres", "PostgresUnavailableError", "find_postgres_bin"]

log = logging.getLogger(__name__)

_TOOLS = ("initdb", "postgres", "pg_isready", "psql")
_INSTALL_HINT = (
    "install the PostgreSQL server (Debian/Ubuntu: `apt-get install -y postgresql-15`, which puts them in "
    "/usr/lib/postgresql/15/bin; other systems: the postgresql server package) or pass bin_dir="
)
_SERVER_USER = "postgres"  # the account Debian's package creates; PostgreSQL will not run as root


class PostgresUnavailableError(RuntimeError):
    """The PostgreSQL server binaries, or a user to run them as, are missing on this machine."""


def find_postgres_bin(bin_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding initdb, postgres, pg_isready and psql: `bin_dir` if given, else the newest
    `/usr/lib/postgresql/*/bin`, else the folder of `initdb` on PATH."""
    if bin_dir is not None:
        candidates = [Path(bin_dir)]
    else:
        found = glob.glob("/usr/lib/postgresql/*/bin")
        # Newest major version first; "9.6" < "15" compares right as numbers, not as strings.
        candidates = [Path(p) for p in sorted(found, key=_major_version, reverse=True)]
        on_path = shutil.which("initdb")
        if on_path:
            candidates.append(Path(on_path).parent)
    for folder in candidates:
        if all((folder / tool).is_file() for tool in _TOOLS):
            return folder
    where = str(bin_dir) if bin_dir is not None else "/usr/lib/postgresql/*/bin or on PATH"
    raise PostgresUnavailableError(
        f"PostgreSQL server binaries ({', '.join(_TOOLS)}) not found in {where}; {_INSTALL_HINT}"
        "'/path/to/postgresql/bin'"
    )


def _major_version(path: str) -> float:
    try:
        return float(Path(path).parent.name)
    except ValueError:
        return -1.0


class LocalPostgres(processes.Service):
    """`postgres` on 127.0.0.1:<port> with a fresh cluster in a temporary folder; a context manager.

    `url` is the SQLAlchemy URL of database `database` owned by `user` (password `password`), for asyncpg.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        bin_dir: str | os.PathLike[str] | None = None,
        user: str = "prefect",
        password: str = "prefect",
        database: str = "prefect",
        startup_timeout: float = 60.0,
    ) -> None:
        self.bin = find_postgres_bin(bin_dir)
        self.port = port if port is not None else free_port()
        self.user = user
        self.password = password
        self.database = database
        self.startup_timeout = startup_timeout
        self.folder: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        # As root, every PostgreSQL command runs as the server's own account (initdb refuses root).
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(_SERVER_USER)
            except KeyError:
                raise PostgresUnavailableError(
                    f"PostgreSQL will not run as root, and there is no {_SERVER_USER!r} user to run it as; "
                    f"{_INSTALL_HINT.split(' or pass')[0]} (it creates that user), or run as another user"
                ) from None
            self._as_user = ["runuser", "-u", _SERVER_USER, "--"]

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    @property
    def log_path(self) -> Path:
        if self.folder is None:
            raise RuntimeError("PostgreSQL is not started")
        return self.folder / "postgres.log"

    def log_tail(self, lines: int = 40) -> str:
        return processes.log_tail(self.log_path, lines)

    def start(self) -> LocalPostgres:
        if self._proc is not None:
            raise RuntimeError("PostgreSQL is already started")
        # Under the system's temporary folder (world-traversable), not pytest's 0700 one.
        self.folder = Path(tempfile.mkdtemp(prefix="prefect-elastic-pg-"))
        try:
            if self._as_user:
                shutil.chown(self.folder, user=_SERVER_USER)
            self._initdb()
            started = time.monotonic()
            command = [*self._as_user, str(self.bin / "postgres"), "-D", str(self.folder / "data")]
            # The Unix socket in our folder, away from the shared /var/run/postgresql; TCP on loopback only.
            command += ["-p", str(self.port), "-k", str(self.folder), "-c", "listen_addresses=127.0.0.1"]
            # A throwaway database: durability is not wanted, speed is.
            command += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
            self._proc = processes.start_group(
                command,
                log=self.log_path,
                env=_clean_environ(),
                cwd=self.folder,
                die_with_parent=True,
            )
            self._wait_ready(started)
            self._psql(
                f"CREATE USER \"{self.user}\" PASSWORD '{self.password}'",
                f'CREATE DATABASE "{self.database}" OWNER "{self.user}"',
            )
        except BaseException:
            self.cleanup()
            raise
        log.info("PostgreSQL on 127.0.0.1:%d in %s", self.port, self.folder)
        return self

    def _run(self, command: list[str], what: str, timeout: float = 60.0) -> None:
        assert self.folder is not None
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=_clean_environ(), cwd=self.folder
        )
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {done.returncode}): {done.stdout}{done.stderr}")

    def _initdb(self) -> None:
        assert self.folder is not None
        command = [*self._as_user, str(self.bin / "initdb"), "-D", str(self.folder / "data")]
        command += ["-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-sync"]
        self._run(command, "initdb")

    def _psql(self, *statements: str) -> None:
        command = [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
        command += ["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-q"]
        for statement in statements:
            command += ["-c", statement]
        self._run(command, "psql")

    def _wait_ready(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.startup_timeout
        check = [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"postgres exited with code {code} before accepting connections\n" + self.log_tail()
                )
            if subprocess.run(check, env=_clean_environ(), timeout=30).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"postgres did not accept connections on 127.0.0.1:{self.port} within "
                    f"{self.startup_timeout:.0f} s\n" + self.log_tail()
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group (its clients are gone by now: a smart shutdown is quick),
        and SIGKILL what is left of it after `timeout` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None:
            processes.stop_groups([proc], grace=timeout)

    def cleanup(self) -> None:
        self.stop()
        folder, self.folder = self.folder, None
        if folder is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(folder)


def _clean_environ() -> dict[str, str]:
    """The inherited environment without PG* settings, which would point psql at another server."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}
