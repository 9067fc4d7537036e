"""Reports to the Prefect API that never hold up the job: a backlog in memory and a thread that sends it.

The controller's callbacks (`PrefectReporter` in flows.py) put what the UI should show here and return at
once; one daemon thread, `ReportSender`, sends it. While the API does not answer (the server restarted,
killed, behind a cut network) nothing is lost that can be kept: the progress artifact and each keyed
artifact (the membership table, the summary) keep only their latest value, which is all the UI shows, and
events wait in order, up to `MAX_EVENTS_KEPT` (the oldest are dropped beyond that, counted). The sender
tries again every `RETRY_SECONDS` and sends everything once the API answers. `close(timeout)` waits a
bounded time for the backlog to go out and says what did not (`Unsent`), so a job whose API stays away
still ends. Why this shape, and what else was considered: docs/design/prefect-reporting.md.

`Backlog` is the bookkeeping alone (no I/O, no thread), tested as such.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

import httpx
from prefect.events import Event

log = logging.getLogger(__name__)

# Events kept while the API does not answer; beyond this the oldest are dropped (and counted). An event is
# about a kilobyte, and a job emits a few per membership change and snapshot: hours of outage fit.
MAX_EVENTS_KEPT = 5000
# Events sent in one request (the API takes a list).
EVENTS_PER_REQUEST = 100
# One request to the API waits at most this long (a frozen server accepts connections and answers nothing;
# Prefect's default is 60 s, with 5 retries on top).
REQUEST_TIMEOUT_SECONDS = 10.0
# After a failed request the sender waits this long before the next try: the first is quick (a restarted
# server answers in seconds), then it settles.
RETRY_SECONDS = (0.5, 1.0, 2.0)

# HTTP statuses that say the API is away or overloaded for now, not that the report is wrong.
OUTAGE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_outage(exc: BaseException) -> bool:
    """Whether a failed request failed because the API is away (kept and sent again), not because of what
    it carried (dropped): no connection, no answer in time, a server error or its proxy's."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in OUTAGE_STATUSES
    return isinstance(exc, httpx.TransportError | OSError)


@dataclass(frozen=True)
class ArtifactReport:
    """The latest value of one keyed artifact: `kind` "table" (`data` the rows) or "markdown" (the text)."""

    key: str
    kind: Literal["table", "markdown"]
    data: Any
    description: str


@dataclass(frozen=True)
class ProgressReport:
    """The progress artifact's value, in percent; created with `key` and `description` on its first send."""

    percent: float
    key: str
    description: str


@dataclass(frozen=True)
class Unsent:
    """What did not reach the API: events still waiting and events dropped, the progress artifact's last
    value, the keys of the artifacts whose latest value was not sent."""

    events: int = 0
    dropped: int = 0
    progress: bool = False
    artifacts: tuple[str, ...] = ()

    @property
    def nothing(self) -> bool:
        return not (self.events or self.dropped or self.progress or self.artifacts)

    def describe(self) -> str:
        parts = []
        if self.events:
            parts.append(f"{self.events} events")
        if self.dropped:
            parts.append(f"{self.dropped} events dropped earlier (more than {MAX_EVENTS_KEPT} waited)")
        if self.progress:
            parts.append("the last progress update")
        if self.artifacts:
            parts.append("the latest " + ", ".join(self.artifacts))
        return "; ".join(parts) or "nothing"


# The last thing `close` asks for: whether the API answers now (`ReportSender.answering` after it).
HEALTH_CHECK: Literal["health"] = "health"

# One thing to send, taken out of the backlog until it is sent (`Backlog.sent`) or put back (`failed`).
Item = ProgressReport | ArtifactReport | list[Event] | Literal["health"]


@dataclass
class Backlog:
    """What waits to be sent, latest value per artifact and events in order (bounded). Not thread-safe:
    `ReportSender` holds its lock around every call."""

    max_events: int = MAX_EVENTS_KEPT
    progress: ProgressReport | None = None
    artifacts: dict[str, ArtifactReport] = field(default_factory=dict)
    events: deque[Event] = field(default_factory=deque)
    dropped: int = 0  # events dropped because more than `max_events` waited
    check: bool = False  # a health check is asked for, after everything else
    in_flight: Item | None = None

    def set_progress(self, report: ProgressReport) -> None:
        self.progress = report

    def put_artifact(self, report: ArtifactReport) -> None:
        self.artifacts[report.key] = report

    def add_event(self, event: Event) -> bool:
        """Queue `event`; False when the oldest waiting one was dropped to make room for it."""
        self.events.append(event)
        return self._bound()

    def _bound(self) -> bool:
        kept = True
        while len(self.events) > self.max_events:
            self.events.popleft()
            self.dropped += 1
            kept = False
        return kept

    def take(self) -> Item | None:
        """The next thing to send (the progress, then artifacts in the order first queued, then up to
        `EVENTS_PER_REQUEST` events, then the health check if asked), out of the backlog until `sent` or
        `failed`; None when empty."""
        assert self.in_flight is None, "one request at a time"
        item: Item | None = None
        if self.progress is not None:
            item, self.progress = self.progress, None
        elif self.artifacts:
            key = next(iter(self.artifacts))
            item = self.artifacts.pop(key)
        elif self.events:
            item = [self.events.popleft() for _ in range(min(EVENTS_PER_REQUEST, len(self.events)))]
        elif self.check:
            item, self.check = HEALTH_CHECK, False
        self.in_flight = item
        return item

    def sent(self) -> None:
        self.in_flight = None

    def failed(self) -> None:
        """Put the item in flight back where it was, unless a newer value of it came meanwhile."""
        item, self.in_flight = self.in_flight, None
        if isinstance(item, ProgressReport):
            if self.progress is None:
                self.progress = item
        elif isinstance(item, ArtifactReport):
            if item.key not in self.artifacts:
                # Back at the front: it was queued before the others.
                self.artifacts = {item.key: item, **self.artifacts}
        elif item == HEALTH_CHECK:
            self.check = True
        elif isinstance(item, list):
            self.events.extendleft(reversed(item))
            self._bound()

    def empty(self) -> bool:
        return (
            self.in_flight is None
            and self.progress is None
            and not self.artifacts
            and not self.events
            and not self.check
        )

    def unsent(self) -> Unsent:
        item = self.in_flight
        events = len(self.events) + (len(item) if isinstance(item, list) else 0)
        progress = self.progress is not None or isinstance(item, ProgressReport)
        keys = list(self.artifacts)
        if isinstance(item, ArtifactReport) and item.key not in keys:
            keys.insert(0, item.key)
        return Unsent(events=events, dropped=self.dropped, progress=progress, artifacts=tuple(keys))


def retry_after(failures: int) -> float:
    """Seconds to wait after `failures` failed tries in a row (at least 1)."""
    return RETRY_SECONDS[min(failures, len(RETRY_SECONDS)) - 1]


class ReportSender:
    """Sends a `Backlog` to the Prefect API from a daemon thread; every method returns at once but
    `flush`, `confirm` and `close`, which wait at most the time they are given.

    Its requests go out with no retries of Prefect's client and a short timeout (`REQUEST_TIMEOUT_SECONDS`):
    a retry is its own loop's, which keeps taking new reports meanwhile and sends only the latest of each.
    `answering`: whether the last request got an answer (True before the first).
    """

    def __init__(self, flow_run_id: str | None, max_events: int = MAX_EVENTS_KEPT) -> None:
        self.flow_run_id = UUID(str(flow_run_id)) if flow_run_id else None
        self.backlog = Backlog(max_events=max_events)
        self.answering = True
        self.silent_since: float | None = None  # since when the API has not answered (monotonic)
        self.api_url = ""
        self._progress_id: UUID | None = None
        self._lock = threading.Condition()
        self._closing = False
        self._stopped = False
        self._told_drops = 0  # drops already warned of
        self._failed_requests = 0  # requests that failed for an outage, all told
        # The thread runs in a copy of the caller's context: the same Prefect settings (API URL, auth).
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="prefect-elastic-reports", daemon=True
        )
        self._thread.start()

    # -- what the controller calls: never blocks on the API ---------------------------------------

    def set_progress(self, report: ProgressReport) -> None:
        with self._lock:
            self.backlog.set_progress(report)
            self._lock.notify_all()

    def put_artifact(self, report: ArtifactReport) -> None:
        with self._lock:
            self.backlog.put_artifact(report)
            self._lock.notify_all()

    def emit(self, event: Event) -> None:
        with self._lock:
            kept = self.backlog.add_event(event)
            dropped = self.backlog.dropped
            self._lock.notify_all()
        if not kept and dropped > self._told_drops:
            if self._told_drops == 0:
                log.warning(
                    "the Prefect API at %s has not answered for %.0f s and more than %d events wait: the "
                    "oldest are dropped (the job goes on; counted in the warning at its end)",
                    self.api_url, self.silent_for(), self.backlog.max_events,
                )  # fmt: skip
            self._told_drops = dropped

    def silent_for(self) -> float:
        return 0.0 if self.silent_since is None else time.monotonic() - self.silent_since

    def flush(self, timeout: float) -> Unsent:
        """Wait until everything queued so far is sent, at most `timeout` seconds; what was not sent."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self.backlog.empty() and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return self.backlog.unsent()

    def confirm(self, timeout: float) -> bool:
        """Whether the API answers now: what waits is sent, then a health check, for at most `timeout`
        seconds; False as soon as one of those requests fails (or the thread stopped), True if none did."""
        deadline = time.monotonic() + timeout
        with self._lock:
            failures = self._failed_requests
            self.backlog.check = True
            self._lock.notify_all()
            while not self.backlog.empty() and self._failed_requests == failures and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return self._failed_requests == failures and not self._stopped and self.answering

    def close(self, timeout: float) -> Unsent:
        """Send what waits and ask the API whether it answers, for at most `timeout` seconds (so that
        `answering` says how it is now, not at the last report); then stop the thread (a request in flight
        ends with its own timeout). What was not sent."""
        with self._lock:
            self.backlog.check = True
            self._lock.notify_all()
        unsent = self.flush(timeout)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        return unsent

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        failures = 0
        try:
            with (
                # (Prefect's client retries an unanswered request 5 times over about a minute: here the
                # loop below retries, and takes newer reports meanwhile.)
                temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}),
                get_client(
                    httpx_settings={"timeout": httpx.Timeout(REQUEST_TIMEOUT_SECONDS)}, sync_client=True
                ) as client,
            ):
                self.api_url = str(PREFECT_API_URL.value() or "")
                while True:
                    with self._lock:
                        item = self.backlog.take()
                        while item is None and not self._closing:
                            self._lock.wait()
                            item = self.backlog.take()
                        if item is None:
                            return
                    try:
                        self._send(client, item)
                    except Exception as exc:
                        if not is_outage(exc):
                            # Refused for what it is, not for an outage: dropped, not retried.
                            log.warning("the Prefect API refused a report, which is dropped: %s", exc)
                        else:
                            self._silent(exc)
                            with self._lock:
                                self.backlog.failed()
                                self._failed_requests += 1
                                self._lock.notify_all()
                            failures += 1
                            with self._lock:
                                if self._closing:  # (close gave the backlog its time already)
                                    return
                                self._lock.wait(retry_after(failures))
                            continue
                    with self._lock:
                        self.backlog.sent()
                        self._lock.notify_all()
                    if failures:
                        failures = 0
                        self._answers_again()
        except Exception:
            log.exception("reports to the Prefect API stopped")
        finally:
            with self._lock:
                self._stopped = True
                self._lock.notify_all()

    def _send(self, client: Any, item: Item) -> None:
        from prefect.artifacts import TableArtifact
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        if isinstance(item, ProgressReport):
            if self._progress_id is None:
                created = client.create_artifact(
                    ArtifactCreate(
                        key=item.key,
                        type="progress",
                        data=item.percent,
                        description=item.description,
                        flow_run_id=self.flow_run_id,
                    )
                )
                self._progress_id = created.id
            else:
                client.update_artifact(self._progress_id, ArtifactUpdate(data=item.percent))
        elif isinstance(item, ArtifactReport):
            data = (
                TableArtifact(key=item.key, table=item.data).format() if item.kind == "table" else item.data
            )
            client.create_artifact(
                ArtifactCreate(
                    key=item.key,
                    type=item.kind,
                    data=data,
                    description=item.description,
                    flow_run_id=self.flow_run_id,
                )
            )
        elif item == HEALTH_CHECK:
            client.request("GET", "/health").raise_for_status()
        else:
            client.request(
                "POST", "/events", json=[e.model_dump(mode="json") for e in item]
            ).raise_for_status()

    def _silent(self, exc: Exception) -> None:
        if self.answering:
            self.answering = False
            self.silent_since = time.monotonic()
            log.warning(
                "the Prefect API at %s does not answer (%s: %s); progress, artifacts and events wait here "
                "and go out when it does (the job goes on)",
                self.api_url, type(exc).__name__, exc,
            )  # fmt: skip

    def _answers_again(self) -> None:
        silent = self.silent_for()
        self.answering = True
        self.silent_since = None
        log.warning(
            "the Prefect API at %s answers again after %.0f s; what waited is being sent",
            self.api_url,
            silent,
        )
