"""A local Prefect API server: `prefect server start` on 127.0.0.1, SQLite or PostgreSQL, its own
PREFECT_HOME.

Used by the demo when no Prefect API is configured, and by the tests (which must run against a real server).

`PrefectServer` starts the server as a subprocess in its own process group, with a temporary PREFECT_HOME
(the SQLite database, profiles, UI build and local result storage all live there), analytics and
promotional UI content off, and waits (bounded) until `GET /api/health` answers. On exit it terminates
the whole process group (SIGTERM, then SIGKILL) so no uvicorn or service process is left behind.

Client processes get the server through `server.env()` (merge it into a subprocess environment); code in
the test process itself uses `with server.settings(): ...` (Prefect reads its settings once at import, so
changing `os.environ` afterwards does not reach it).

The database is SQLite in PREFECT_HOME unless `database_url` names another one: a
`postgresql+asyncpg://user:password@host:port/database` URL (`postgres.LocalPostgres().url` gives one
for a throwaway local server). Prefect creates its tables there when the server starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from . import processes

# Settings given to the server process and to every client process.
_COMMON_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # the telemetry service posts to sens-o-matic.prefect.io
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",  # no resource-metric events from flow runs
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
}

# The SQLAlchemy drivers Prefect's server runs on (it needs an async one).
_DATABASE_SCHEMES = ("sqlite+aiosqlite://", "postgresql+asyncpg://")

# Server-only settings: write received events to the database quickly (default flush interval is 5 s),
# so tests that read events back over the REST API wait less.
_SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "0.5",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drain_prefect_workers() -> None:
    """Send the events and logs this process has queued (synchronous callers only)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(RuntimeError):
        APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def _clean_environ() -> dict[str, str]:
    """The inherited environment without any PREFECT_* setting (a developer's profile must not leak in).
    This package's own variables (PREFECT_ELASTIC_*, such as the fork server's) are not Prefect's: kept."""
    ours = "PREFECT_ELASTIC_"
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") or k.startswith(ours)}


def check_database_url(url: str) -> str:
    """`url` if Prefect's server can use it, else a ValueError that names it and says what to give."""
    if not url.startswith(_DATABASE_SCHEMES):
        raise ValueError(
            f"database_url {_shown(url)!r} is not a database Prefect's server can use; give "
            "postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DATABASE (PostgreSQL through asyncpg) or "
            "sqlite+aiosqlite:///PATH (SQLite), or leave it out for SQLite in PREFECT_HOME"
        )
    return url


def _shown(url: str) -> str:
    """`url` with its password, if any, replaced by ***: for messages and logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


class PrefectServer(processes.Service):
    """`prefect server start` on 127.0.0.1:<port> with SQLite in `home`, or the database at
    `database_url`; use as a context manager."""

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        ui: bool = True,
        startup_timeout: float = 120.0,
        extra_env: dict[str, str] | None = None,
        database_url: str | None = None,
    ) -> None:
        self._database_url = check_database_url(database_url) if database_url is not None else None
        self._own_home = home is None
        self.home = Path(home) if home is not None else Path(tempfile.mkdtemp(prefix="prefect-home-"))
        self.port = port if port is not None else free_port()
        self.ui = ui
        self.startup_timeout = startup_timeout
        self.extra_env = dict(extra_env or {})
        self.log_path = self.home / "server.log"
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def ui_url(self) -> str:
        return self.url

    @property
    def database_url(self) -> str:
        if self._database_url is not None:
            return self._database_url
        return f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"

    @property
    def database(self) -> str:
        """Which database the server runs on, without its password: for test ids and messages."""
        return _shown(self.database_url)

    def env(self) -> dict[str, str]:
        """The PREFECT_* variables a client process needs (merge into `os.environ` copies)."""
        return {
            "PREFECT_HOME": str(self.home),
            "PREFECT_PROFILES_PATH": str(self.home / "profiles.toml"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_UI_URL": self.ui_url,
            **_COMMON_ENV,
            **self.extra_env,
        }

    def subprocess_env(self) -> dict[str, str]:
        """A full environment for `subprocess` calls: the inherited one minus PREFECT_*, plus `env()`."""
        return {**_clean_environ(), **self.env()}

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """Point Prefect in *this* (synchronous) process at the server: flows, clients, artifacts, events.

        Three layers, as `prefect.testing.utilities.prefect_test_harness` does it: `os.environ` (for
        subprocesses and fresh `Settings()`), `temporary_settings` (the current thread's context), and
        the process-global settings context, which is what threads started without a copied context see
        (a `threading.Thread` that calls `emit_event` would otherwise use the settings from import time
        and, with no PREFECT_API_URL there, silently start a temporary server of its own). On exit,
        queued events and logs are sent before the settings are restored.
        """
        import prefect.context
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_UI_URL, temporary_settings

        env = self.env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(
                    temporary_settings(
                        updates={
                            PREFECT_API_URL: self.api_url,
                            PREFECT_HOME: str(self.home),
                            PREFECT_UI_URL: self.ui_url,
                        }
                    )
                )
                swap = getattr(prefect.context, "_temporary_global_settings_context", None)
                if swap is not None:
                    stack.enter_context(swap(prefect.context.get_settings_context()))
                try:
                    yield
                finally:
                    _drain_prefect_workers()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log, for error messages."""
        return processes.log_tail(self.log_path, lines)

    def start(self) -> PrefectServer:
        if self._proc is not None:
            raise RuntimeError("the Prefect server is already started")
        self.home.mkdir(parents=True, exist_ok=True)
        env = {
            **self.subprocess_env(),
            **_SERVER_ENV,
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_SERVER_UI_ENABLED": "true" if self.ui else "false",
            "PREFECT_SERVER_UI_API_URL": self.api_url,
            "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(self.home / "ui_build"),
            **self.extra_env,
        }
        prefect_cli = Path(sys.executable).with_name("prefect")
        cmd = [str(prefect_cli)] if prefect_cli.exists() else [sys.executable, "-m", "prefect"]
        cmd += ["server", "start", "--host", "127.0.0.1", "--port", str(self.port), "--analytics-off"]
        cmd += ["--ui"] if self.ui else ["--no-ui"]
        started = time.monotonic()
        # Its own process group: stop() ends uvicorn and everything it started. Orphan guard: the server
        # dies with the thread that started it (start servers from the main thread; pytest fixtures are).
        self._proc = processes.start_group(
            cmd, log=self.log_path, env=env, cwd=self.home, die_with_parent=True
        )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.startup_timeout
        last_error: str = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"prefect server (database {self.database}) exited with code {code} before answering "
                        f"{self.api_url}/health\n" + self.log_tail()
                    )
                try:
                    response = http.get(f"{self.api_url}/health")
                    if response.status_code == 200:
                        return
                    last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    last_error = repr(exc)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"prefect server (database {self.database}) did not answer {self.api_url}/health "
                        f"within {self.startup_timeout:.0f} s (last: {last_error})\n" + self.log_tail()
                    )
                time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group, and SIGKILL what is left of it after `timeout` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None:
            processes.stop_groups([proc], grace=timeout)

    def cleanup(self) -> None:
        self.stop()
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)
