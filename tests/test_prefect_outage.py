"""The Prefect API going away does not hold up the job: a real `prefect server start` SIGKILLed in the middle
of a flow run (a process of its own, as under a deployment), then started again on the same port, or never.

The first tests are of the reports' backlog alone (`reporting.Backlog`: what waits, what is dropped and
counted), without a server, and of the sender against an address where nothing listens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch
from distributed import Client
from prefect.events import Event

from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.registry import read_progress
from prefect_elastic.reporting import (
    EVENTS_PER_REQUEST,
    HEALTH_CHECK,
    ArtifactReport,
    Backlog,
    ProgressReport,
    ReportSender,
    Unsent,
    is_outage,
    retry_after,
)

from .conftest import References, assert_same_state, held_training, top_up, wait_for
from .prefect_harness import KillablePrefectServer, PrefectServer, free_port
from .test_flow import FlowRun, flow_job


def _event(n: int) -> Event:
    return Event(event=f"test.{n}", resource={"prefect.resource.id": f"test.{n}"})  # type: ignore[arg-type]


def _table(key: str, rows: int) -> ArtifactReport:
    return ArtifactReport(key=key, kind="table", data=[{"row": i} for i in range(rows)], description="")


def test_backlog_keeps_the_latest_of_each_artifact_and_every_event_in_order() -> None:
    backlog = Backlog(max_events=1000)
    for percent in (10.0, 20.0, 30.0):
        backlog.set_progress(ProgressReport(percent, "p", ""))
    backlog.put_artifact(_table("membership", 1))
    backlog.put_artifact(ArtifactReport(key="summary", kind="markdown", data="# done", description=""))
    backlog.put_artifact(_table("membership", 2))
    for n in range(EVENTS_PER_REQUEST + 3):
        backlog.add_event(_event(n))
    backlog.check = True

    progress = backlog.take()
    assert isinstance(progress, ProgressReport) and progress.percent == 30.0, "only the latest progress"
    backlog.sent()
    first = backlog.take()
    # The membership table was queued first, and goes first, with its latest rows.
    assert isinstance(first, ArtifactReport) and first.key == "membership" and len(first.data) == 2
    backlog.sent()
    summary = backlog.take()
    assert isinstance(summary, ArtifactReport) and summary.key == "summary"
    backlog.sent()
    events = backlog.take()
    assert isinstance(events, list) and [e.event for e in events] == [
        f"test.{n}" for n in range(EVENTS_PER_REQUEST)
    ]
    backlog.sent()
    rest = backlog.take()
    assert isinstance(rest, list) and [e.event for e in rest] == [
        f"test.{n}" for n in range(EVENTS_PER_REQUEST, EVENTS_PER_REQUEST + 3)
    ]
    backlog.sent()
    assert backlog.take() == HEALTH_CHECK, "the health check comes after everything else"
    backlog.sent()
    assert backlog.empty() and backlog.take() is None
    backlog.sent()


def test_backlog_puts_back_what_failed_unless_a_newer_value_came() -> None:
    backlog = Backlog(max_events=1000)
    backlog.set_progress(ProgressReport(10.0, "p", ""))
    assert backlog.take() == ProgressReport(10.0, "p", "")
    backlog.set_progress(ProgressReport(20.0, "p", ""))  # came while the first was in flight
    backlog.failed()
    assert backlog.take() == ProgressReport(20.0, "p", ""), "the newer value, not the failed one"
    backlog.failed()
    assert backlog.take() == ProgressReport(20.0, "p", ""), "put back: still to send"
    backlog.sent()

    backlog.put_artifact(_table("a", 1))
    backlog.put_artifact(_table("b", 1))
    assert backlog.take() == _table("a", 1)
    assert backlog.unsent() == Unsent(artifacts=("a", "b")), "in flight counts as not sent"
    backlog.failed()
    assert list(backlog.artifacts) == ["a", "b"], "back at the front, where it was"

    for n in range(3):
        backlog.add_event(_event(n))
    backlog.artifacts.clear()
    taken = backlog.take()
    assert isinstance(taken, list) and len(taken) == 3
    backlog.add_event(_event(3))
    backlog.failed()
    assert [e.event for e in backlog.events] == ["test.0", "test.1", "test.2", "test.3"], "order kept"


def test_backlog_drops_the_oldest_events_beyond_its_bound_and_counts_them() -> None:
    backlog = Backlog(max_events=3)
    kept = [backlog.add_event(_event(n)) for n in range(5)]
    assert kept == [True, True, True, False, False]
    assert [e.event for e in backlog.events] == ["test.2", "test.3", "test.4"]
    taken = backlog.take()
    assert isinstance(taken, list)
    backlog.add_event(_event(5))
    backlog.add_event(_event(6))
    backlog.failed()  # 3 put back in front of 2 newer ones: the oldest go
    assert [e.event for e in backlog.events] == ["test.4", "test.5", "test.6"]
    unsent = backlog.unsent()
    assert unsent == Unsent(events=3, dropped=4)
    assert "3 events" in unsent.describe() and "4 events dropped" in unsent.describe()


def test_outages_are_told_from_refusals_and_retries_settle() -> None:
    import httpx

    request = httpx.Request("POST", "http://127.0.0.1/api/events")
    assert is_outage(httpx.ConnectError("refused", request=request))
    assert is_outage(httpx.ReadTimeout("no answer", request=request))
    for status, outage in ((503, True), (502, True), (429, True), (422, False), (404, False)):
        error = httpx.HTTPStatusError("", request=request, response=httpx.Response(status, request=request))
        assert is_outage(error) is outage, status
    assert not is_outage(ValueError("not an API error"))
    waits = [retry_after(n) for n in range(1, 8)]
    assert waits == sorted(waits) and waits[-1] == waits[-2], "grows, then settles"


def test_reports_to_an_api_that_does_not_answer_wait_and_what_is_lost_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):  # nobody there
        sender = ReportSender(flow_run_id=None, max_events=3)
    for n in range(5):
        sender.emit(_event(n))  # (returns at once: the sender's thread does the trying)
    sender.set_progress(ProgressReport(50.0, "p", ""))
    sender.put_artifact(_table("membership", 2))
    assert not sender.confirm(timeout=60), "the API does not answer"
    assert not sender.answering
    unsent = sender.close(timeout=0.5)
    assert unsent == Unsent(events=3, dropped=2, progress=True, artifacts=("membership",))
    assert "the oldest are dropped" in caplog.text and "does not answer" in caplog.text


# -- a real server, killed in the middle of a flow run ---------------------------------------------------


@pytest.fixture(scope="module")
def killable_server(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: PrefectServer
) -> Iterator[KillablePrefectServer]:
    # (It names the shared `prefect_server` so that conftest orders these tests with the other Prefect
    # tests, last; this module's server is its own, since its tests kill it.)
    # (A generous start bound: on a loaded machine a start, and each restart here, has taken over 2 minutes.)
    with KillablePrefectServer(
        tmp_path_factory.mktemp("prefect-home-outage"), ui=False, startup_timeout=300
    ) as server:
        yield server


@pytest.fixture
def outage_server(killable_server: KillablePrefectServer) -> KillablePrefectServer:
    """The module's server, running (a test before may have left it dead)."""
    if not killable_server.running:
        killable_server.start()
    return killable_server


@pytest.fixture
def watcher(cluster: LocalElasticCluster) -> Iterator[Client]:
    """A client of the test's own to the cluster, to follow the job there (`read_progress`) while the
    Prefect API is down."""
    with cluster.client() as client:
        yield client


@pytest.fixture
def flow_runs() -> Iterator[list[FlowRun]]:
    """The flow runs a test starts; a process still running when it ends (a failed test) is killed."""
    runs: list[FlowRun] = []
    yield runs
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(30)


def _occurred(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["occurred"]).replace("Z", "+00:00")).timestamp()


@pytest.mark.cluster
@pytest.mark.timeout(600)  # (a bound for a hang: on a loaded machine a Prefect server start took 2 minutes)
def test_worker_lost_while_the_prefect_server_is_down_is_handled_before_it_returns(
    outage_server: KillablePrefectServer,
    cluster: LocalElasticCluster,
    reference: References,
    digits_url: str,
    tmp_path: Path,
    flow_runs: list[FlowRun],
    watcher: Client,
) -> None:
    top_up(cluster, 2)
    job = flow_job(digits_url, model="tests.models:held_mlp", job_id=f"outage-{uuid.uuid4().hex[:6]}")
    with held_training():  # the job stands at a step until the server is back
        run = FlowRun(outage_server, job, cluster.scheduler_address, tmp_path)
        flow_runs.append(run)
        before = wait_for(
            "training to make progress",
            lambda: (p := read_progress(watcher, job.job_id)) is not None and p.committed_steps > 0 and p,
        )
        outage_server.kill()
        killed_at = time.time()
        victim = sorted(before.workers)[0]
        cluster.kill_worker(victim)
        # Supervision goes on without the API: the loss is handled (a new generation without the victim)
        # while the server is still dead.
        after = wait_for(
            "the loss to be handled with the Prefect server down",
            lambda: (
                (p := read_progress(watcher, job.job_id)) is not None
                and p.generation > before.generation
                and victim not in p.workers
                and p
            ),
        )
        assert not outage_server.running
        outage_server.start()
        back_at = time.time()
    out = run.finish()
    assert "STATE COMPLETED" in out, out[-3000:]
    assert run.state() == "COMPLETED", "the engine recorded the end once the API was back"
    result = FlowRun.result(out)
    assert result["exactly_once"]
    assert_same_state(torch.load(run.output, weights_only=True), reference(job).state_dict)

    # What happened during the outage reached Prefect once it was back, stamped with when it happened.
    events = run.events()
    lost = [
        e for e in events if e["event"] == "prefect-elastic.worker.lost" and e["payload"]["worker"] == victim
    ]
    rollbacks = [e for e in events if e["event"] == "prefect-elastic.rollback"]
    assert lost and rollbacks, [e["event"] for e in events]
    assert killed_at <= _occurred(lost[0]) < back_at, "the loss was handled while the server was down"
    assert any(killed_at <= _occurred(e) < back_at for e in rollbacks)
    assert any(e["payload"]["generation"] == after.generation for e in rollbacks)
    artifacts = run.artifacts()
    progress = next(a for k, a in artifacts.items() if k.endswith("-progress"))
    assert float(progress["data"]) == 100.0
    assert any(k.endswith("-summary") for k in artifacts)


@pytest.mark.cluster
@pytest.mark.timeout(600)  # (a bound for a hang: on a loaded machine a Prefect server start took 2 minutes)
def test_prefect_server_that_never_comes_back_leaves_the_result_written_and_the_process_exits(
    outage_server: KillablePrefectServer,
    cluster: LocalElasticCluster,
    reference: References,
    digits_url: str,
    tmp_path: Path,
    flow_runs: list[FlowRun],
    watcher: Client,
) -> None:
    top_up(cluster, 2)
    job = flow_job(digits_url, model="tests.models:held_mlp", job_id=f"gone-{uuid.uuid4().hex[:6]}")
    with held_training():  # the job stands at a step until the server is dead
        run = FlowRun(
            outage_server, job, cluster.scheduler_address, tmp_path, env={"END_REPORT_SECONDS": "2"}
        )
        flow_runs.append(run)
        wait_for(
            "training to make progress",
            lambda: (p := read_progress(watcher, job.job_id)) is not None and p.committed_steps > 0,
        )
        outage_server.kill()
    # The job trains to its end without an API; the process returns the result and exits (a hang, in
    # training or at exit, fails here).
    out = run.finish(timeout=240)
    assert "STATE COMPLETED" in out, out[-3000:]
    assert FlowRun.result(out)["exactly_once"]
    assert_same_state(torch.load(run.output, weights_only=True), reference(job).state_dict)
    # It says what it could not send, and that Prefect did not record the end.
    assert "not sent:" in out and "the last progress update" in out and "summary" in out, out[-3000:]
    assert "Prefect has not recorded how it ended" in out, out[-3000:]
