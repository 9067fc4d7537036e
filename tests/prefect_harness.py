"""The Prefect server fixtures: real `prefect server start` processes for the test session.

- `prefect_server`: one server on SQLite (UI on), shared by every Prefect test.
- `prefect_server_db`: the same tests' server on each database Prefect supports, `sqlite` (the shared
  server above) and `postgres` (a second server on a throwaway PostgreSQL, `LocalPostgres`).
- `KillablePrefectServer`: a server a test SIGKILLs and starts again on the same port and database
  (tests/test_prefect_outage.py); never the shared one, which other tests need alive.

Which tests take `prefect_server_db`, and why only those: a Prefect server on PostgreSQL is a second
server process (most of a core while it is up) plus migrations on a fresh database, and every test run on
it is one more training run, so doubling all the Prefect tests would cost minutes for little. What the
database changes is the server's own SQL: flow-run and task-run state orchestration, artifacts, events
(the event persister's bulk inserts), work pools, deployments and the scheduler's bulk DML (the part that
broke with SQLAlchemy 2.1). Two tests cover all of that, so they run on both databases:

- `test_flow.py::test_flow_run_with_a_worker_killed_and_one_added`: a whole flow run that trains a job
  through a membership change, then reads its task runs, artifacts (progress, membership table, summary)
  and events (joined, lost, rollback, each related to the flow run) back over the REST API;
- `test_deploy.py::test_deploy_creates_scheduled_deployment`: a work pool, `prefect deploy`, the
  deployment and its cron schedule read back, and flow runs the server's scheduler created.

Both PostgreSQL runs are heavy tests (`.ci/run`'s second stage, `bash scripts/test.sh -m heavy`): with
their server's start they took about 70 s of the main suite.

The other Prefect tests (cancellation, resume after a SIGKILL, retries, the UI, connect) exercise the
flow's and the engine's behaviour, which no database choice changes; they stay on SQLite.

`prefect_server_db` is function-scoped (the modules that use it import it): the PostgreSQL server and its
Prefect server are up only during the one test of each module that asks for them, instead of taking CPU
from every test after it, for the price of one start (about 15 s) per such test. A module that wants
more tests on PostgreSQL should make its own module-scoped fixture rather than pay that per test.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from prefect_elastic.local import processes
from prefect_elastic.local.forkserver import fork_server_wanted, shared_fork_server
from prefect_elastic.local.postgres import LocalPostgres
from prefect_elastic.local.prefect_server import PrefectServer, free_port

__all__ = [
    "KillablePrefectServer",
    "PrefectServer",
    "free_port",
    "prefect_server",
    "prefect_server_db",
    "rest_client",
]


def rest_client(base_url: str) -> httpx.Client:
    """A client for a Prefect server's REST API that opens a connection per request.

    The server (uvicorn) closes a connection that has been idle for 5 s. A pooled client that sends on such a
    connection just as the server closes it gets "Server disconnected without sending a response" (CI lost
    a cancellation test to it: the run's last read came after a long wait). A test's few requests on
    127.0.0.1 cost nothing to connect, so none is kept alive.
    """
    return httpx.Client(
        base_url=base_url, timeout=30, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
    )


class KillablePrefectServer(PrefectServer):
    """A `PrefectServer` that a test SIGKILLs (`kill`: the whole process group, uvicorn and its services,
    as a node's crash would) and starts again (`start`: the same port, PREFECT_HOME and database, so
    clients that knew it reach it again)."""

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            processes.signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=30)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    if fork_server_wanted(None):
        # The flows and commands that Prefect tests run in subprocesses fork their workers from this
        # process's fork server (they connect to it): started here, if no cluster has started it yet.
        shared_fork_server(dict(os.environ), os.getcwd())
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


# (PostgreSQL in .ci/run's heavy stage: its server's start and its training run are about 70 s of the main
# suite, which issue 9 keeps under 15 minutes; the SQLite runs of the same tests stay in the main suite.)
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.heavy)])
def prefect_server_db(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    prefect_server: PrefectServer,
) -> Iterator[PrefectServer]:
    """A Prefect server on SQLite (the shared `prefect_server`) or on a fresh PostgreSQL.

    It names `prefect_server` as an argument even for PostgreSQL so that conftest's ordering (Prefect
    tests last) sees these tests as Prefect tests; that server is up for the session anyway. The
    PostgreSQL one has no UI: no test looks at it there.
    """
    if request.param == "sqlite":
        yield prefect_server
        return
    with (
        LocalPostgres() as postgres,
        PrefectServer(
            tmp_path_factory.mktemp("prefect-home-postgres"), ui=False, database_url=postgres.url
        ) as server,
    ):
        yield server
