"""The job registry: roles of a job register under its job id in the scheduler's metadata.

`["prefect-elastic", "jobs", <job_id>]` holds the controller that runs the job (its client id, its run id,
when it claimed the job and when it last renewed its lease, both by the scheduler's clock) and, under
`"progress"`, the last progress it published. A second controller of a job id that a connected
controller holds is refused; an entry left by a controller that died is taken over. Check and set run as
one function on the scheduler, so two controllers started at once cannot both pass.

**The controller's lease.** A controller that dies without releasing its entry (SIGKILL, OOM, its node
gone) would leave its job "running" there for ever. So every read of the progress (`read_progress`) asks
on the scheduler whether the controller still holds the job (`controller_gone`, a pure function):

- its client is no longer connected to the scheduler: gone at once (a killed process's connection
  closes with it, and the scheduler drops the client within milliseconds);
- its lease ran out: the controller renews it with every progress it publishes (every
  `PUBLISH_SECONDS`, 0.2 s, in training/pacing.py) and, while it publishes nothing (starting, waiting for a
  standby, rebuilding the coordinator: seconds to minutes), from a thread of its own every
  `RENEW_SECONDS`; `LEASE_SECONDS` (5 s) without a renewal marks it gone. That catches a controller whose
  connection stays open while its process does nothing: frozen (SIGSTOP), or behind a cut network. 5 s
  is 5 renewals of that thread and 25 publishes: a pause of a second or two of the controller's process
  (a collection, a large pickle) or of the scheduler's event loop (which stamps both the renewal and the
  read) does not trip it, and it is still far below the minutes Dask takes to give up on such a client.

The job's progress is then marked, in the registry itself, state `CONTROLLER_LOST` ("controller-lost")
with `failure_kind` the same and a `failure` that says why and what to do; a controller that comes back
(its process resumed) publishes over it. A job that ended ("done", "failed") keeps its state. The claim
is unchanged: a job whose controller is still connected (a frozen one) is not taken over, since it would
train on if it resumed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from distributed import Client

if TYPE_CHECKING:
    # (Imported where used: the scheduler imports this module for `_claim`, and messages.py imports torch.)
    from .messages import Progress

# A published state that says the job's controller is gone (see the module's docstring).
CONTROLLER_LOST = "controller-lost"
# Without a renewal for this long, a connected controller's lease has run out.
LEASE_SECONDS = 5.0
# How often the controller's keep-alive thread renews the lease when no publish did.
RENEW_SECONDS = 1.0
# Published states of a job whose controller holds it: only these can turn into CONTROLLER_LOST.
HELD_STATES = ("running", "waiting")


def _key(job_id: str) -> list[str]:
    return ["prefect-elastic", "jobs", job_id]


@dataclass(frozen=True)
class ControllerSeen:
    """What the scheduler knows of a job's controller when asked."""

    connected: bool  # its client is among the scheduler's clients
    renewed_ago: float  # seconds since it last renewed its lease (the scheduler's clock)


def controller_gone(state: str, seen: ControllerSeen, lease_seconds: float = LEASE_SECONDS) -> str | None:
    """Why the controller of a job whose last published state is `state` no longer holds it, or None
    while it does (or the job ended: "done" and "failed" are final, a job marked lost stays so)."""
    if state not in HELD_STATES:
        return None
    if not seen.connected:
        return "its client is no longer connected to the scheduler"
    if seen.renewed_ago > lease_seconds:
        return (
            f"its lease was last renewed {seen.renewed_ago:.1f} s ago (it runs out after {lease_seconds:g} s "
            "without a renewal: the process is frozen or cut off)"
        )
    return None


class _KeepAlive:
    """The controller's renewals of its lease while it publishes nothing (a thread of its own)."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.renewed = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"prefect-elastic-lease-{job_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(RENEW_SECONDS / 4):
            if self.client.status in ("closing", "closed"):
                return
            if time.monotonic() - self.renewed < RENEW_SECONDS:
                continue  # a publish renewed it
            try:
                self.client.run_on_scheduler(_renew, key=_key(self.job_id), client_id=self.client.id)
                self.renewed = time.monotonic()
            except Exception:  # (the scheduler is away: the next turn tries again)
                time.sleep(RENEW_SECONDS)


# The lease of each job this process's controllers hold: job id -> its keep-alive.
_held: dict[str, _KeepAlive] = {}


def claim_job(client: Client, job_id: str, run_id: str) -> dict[str, Any] | None:
    """Register this run under `job_id` and start renewing its lease; returns the live holder instead
    when there is one."""
    holder: dict[str, Any] | None = client.run_on_scheduler(
        _claim, key=_key(job_id), claim={"client": client.id, "run": run_id}
    )
    if holder is None:
        old = _held.pop(job_id, None)
        if old is not None:
            old.stopped.set()
        _held[job_id] = _KeepAlive(client, job_id)
    return holder


def release_job(client: Client, job_id: str, run_id: str) -> None:
    """Unregister, unless another run took the job id over meanwhile."""
    kept = _held.pop(job_id, None)
    if kept is not None:
        kept.stopped.set()
    client.run_on_scheduler(_release, key=_key(job_id), run=run_id)


def publish_progress(client: Client, job_id: str, progress: Progress) -> None:
    """Publish the job's progress, which renews the controller's lease."""
    client.run_on_scheduler(_publish, key=_key(job_id), progress=asdict(progress), client_id=client.id)
    kept = _held.get(job_id)
    if kept is not None:
        kept.renewed = time.monotonic()


def read_progress(client: Client, job_id: str) -> Progress | None:
    """The latest progress the controller of `job_id` published on this cluster (None before it starts).
    State `CONTROLLER_LOST` when that controller is gone (see the module's docstring)."""
    found: dict[str, Any] | None = client.run_on_scheduler(_read, key=_key(job_id))
    if not found:
        return None
    from .messages import Progress

    for name in ("workers", "lost_shards", "data_servers", "standbys"):
        found[name] = tuple(found[name])
    found["holding"] = tuple(tuple(h) for h in found["holding"])
    return Progress(**found)


# -- on the scheduler ------------------------------------------------------------------------------


def _entry(dask_scheduler: Any, key: list[str]) -> dict[str, Any] | None:
    try:
        entry: dict[str, Any] | None = dask_scheduler.get_metadata(keys=key, default=None)
    except TypeError:  # (a level above it is None)
        return None
    return entry


def _claim(dask_scheduler: Any, key: list[str], claim: dict[str, str]) -> dict[str, str] | None:
    """Register `claim` under `key` unless a connected controller holds it already."""
    holder = _entry(dask_scheduler, key)
    if holder is not None and holder.get("client") in dask_scheduler.clients:
        return {k: v for k, v in holder.items() if k != "progress"}
    now = time.time()
    dask_scheduler.set_metadata(keys=key, value={**claim, "started": now, "renewed": now})
    return None


def _release(dask_scheduler: Any, key: list[str], run: str) -> None:
    holder = _entry(dask_scheduler, key)
    if holder is not None and holder.get("run") == run:
        dask_scheduler.set_metadata(keys=key, value=None)


def _renew(dask_scheduler: Any, key: list[str], client_id: str) -> None:
    holder = _entry(dask_scheduler, key)
    if holder is not None and holder.get("client") == client_id:
        holder["renewed"] = time.time()


def _publish(dask_scheduler: Any, key: list[str], progress: dict[str, Any], client_id: str) -> None:
    holder = _entry(dask_scheduler, key)
    if holder is None or holder.get("client") != client_id:
        return  # released, or taken over by another controller: not this one's to publish
    holder["renewed"] = time.time()
    holder["progress"] = progress


def _read(dask_scheduler: Any, key: list[str]) -> dict[str, Any] | None:
    """The job's progress, marked `CONTROLLER_LOST` (here, for every later reader) if its controller is
    gone."""
    holder = _entry(dask_scheduler, key)
    if not holder or not holder.get("progress"):
        return None
    progress: dict[str, Any] = holder["progress"]
    seen = ControllerSeen(
        connected=holder.get("client") in dask_scheduler.clients,
        renewed_ago=time.time() - holder.get("renewed", holder.get("started", 0.0)),
    )
    why = controller_gone(progress["state"], seen)
    if why is not None:
        job_id = key[-1]
        progress = holder["progress"] = {
            **progress,
            "state": CONTROLLER_LOST,
            "failure_kind": CONTROLLER_LOST,
            "failure": (
                f"the controller of job {job_id} (client {holder.get('client')}, run {holder.get('run')}) "
                f"is gone: {why}. Nothing trains the job any more; run it again with the same job_id "
                "(it resumes from its last checkpoint, if it writes them)"
            ),
        }
    return dict(progress)
