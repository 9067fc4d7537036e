"""Calls to the job's actors with their timeouts, watching the static workers they depend on: a call to a
dead worker waits for Dask's connect timeout, so each wait looks at the scheduler's list meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import distributed
from distributed import Client, Future
from distributed.actor import Actor

from ..dask_failures import actor_lost
from ..errors import (
    DataServerLostError,
)
from .signals import CoordinatorLost, StartCancelled, StaticWorkerLeft

if TYPE_CHECKING:
    from ..job import ElasticJob
    from .role_table import RoleTable
    from .workers import Workers

log = logging.getLogger(__name__)

# How long a settled future's result may take to fetch from its worker.
GATHER_SECONDS = 30.0


def settled_result(future: Any, timeout: float) -> Any:
    """The result of the Dask future `future` (the start of an actor, a compute loop) within `timeout` s,
    raising `TimeoutError` if it has not finished, and `StartCancelled` for a future Dask cancelled.

    Not `future.result(timeout)` alone: when that timeout lands while the client gathers a result that has
    just finished, it cancels the client's shared gather task before the task ran, and every later result
    on that client fails (distributed 2026.8; an `UnboundLocalError` out of `distributed.utils.sync`; the
    chaos soak lost its job to it; `test_static_roles.py` shows it). So it first waits for the future to
    settle, a wait that shares nothing with other calls, and gathers only a settled future. (An actor's
    method call returns an `ActorFuture`, whose result waits on an event of its own: no such trap.)"""
    if not isinstance(future, Future):
        return future.result(timeout=timeout)
    try:
        with future.client.as_current():
            distributed.wait([future], timeout=timeout)
        # Settled: the gather fetches a value that exists, from a worker that may still die meanwhile.
        return future.result(timeout=max(timeout, GATHER_SECONDS))
    except TimeoutError:
        _unjam_gather(future.client)
        raise
    except Exception as exc:
        # A cancellation raises Dask's CancelledError, a BaseException that `sync` turns into an
        # UnboundLocalError.
        if future.cancelled():
            raise StartCancelled(str(future.key)) from exc
        raise


def _unjam_gather(client: Client) -> None:
    """Drops a gather task that a timeout cancelled before it ran: left in place, every later gather on
    this client waits on it and fails (see `settled_result`)."""
    pending = getattr(client, "_gather_future", None)
    if pending is not None and pending.cancelled():
        client._gather_future = None


# While a call to the coordinator waits (a survival check calls every shard), how often the controller looks
# for a static worker that died under it: a call to it would otherwise wait for Dask's 30 s connect timeout.
WATCH_WHILE_CALLING_SECONDS = 0.1

# How long the controller waits on a coordinator call between two looks at whether its worker is gone: a
# call to a worker that died waits for Dask's connect timeout, not for an answer that will never come.
CALL_SLICE_SECONDS = 0.05

# A call to a static worker that broke is given this long to turn out a loss of that worker before the error
# counts as the call's own: the broken connection to a killed worker can reach the controller before the
# scheduler has removed the worker.
LEAVING_GRACE_SECONDS = 2.0


class ControllerCoordinatorHandle(Actor):
    """The controller's handle on its coordinator: a Dask `Actor` whose calls raise `CoordinatorLost`
    when its worker is lost, where Dask raises a `RuntimeError`.

    Dask raises it at the attribute's lookup (`handle.progress`), before any call, once the actor's
    future is in error: outside `Calls.call`, which turns the same error from an answer into
    `CoordinatorLost`. A coordinator killed between two calls therefore ended the job instead of being
    rebuilt (the async chaos soak in CI), and a handler that tells `CoordinatorLost` from other errors
    (`Promotions.keep`) took it for a data server's failure. It pickles as a plain `Actor`
    (`Actor.__reduce__`), so the compute loops and the data servers get Dask's own handle."""

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except RuntimeError as exc:
            if not actor_lost(exc):
                raise
            raise CoordinatorLost(f"its static worker {self._address} was lost ({exc})") from exc


def controller_handle(coordinator: Actor) -> ControllerCoordinatorHandle:
    """`coordinator`, as the controller holds it (`ControllerCoordinatorHandle`): the same actor, bound
    to the same client as Dask binds the handle it gives back (`Actor.__reduce__`)."""
    return ControllerCoordinatorHandle(coordinator._cls, coordinator._address, coordinator.key)


class Calls:
    """The controller's calls to its actors, each bounded, each given up as soon as the static worker it
    depends on is seen gone (`Workers`); it changes nothing in the role table but the losses it told the
    coordinator of (`RoleTable.newly_lost`)."""

    def __init__(self, job: ElasticJob, roles: RoleTable, workers: Workers, total_steps: int) -> None:
        self.job = job
        self.total_steps = total_steps
        self.roles = roles
        self.workers = workers

    def call(self, future: Any, timeout: float | None = None) -> Any:
        """The answer to a call to the coordinator. If its static worker leaves meanwhile, raises
        `CoordinatorLost` at once (the call itself would wait for Dask's connect timeout)."""
        deadline = time.monotonic() + (timeout or self.job.call_timeout)
        next_look = time.monotonic() + WATCH_WHILE_CALLING_SECONDS
        while True:
            try:
                return future.result(timeout=max(0.001, min(CALL_SLICE_SECONDS, deadline - time.monotonic())))
            except TimeoutError as exc:
                if self.workers.has_left(self.roles.coordinator_at):
                    raise CoordinatorLost(
                        f"its static worker {self.roles.coordinator_at} left the cluster"
                    ) from exc
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + WATCH_WHILE_CALLING_SECONDS
                    self.tell_lost_shards()
                if now < deadline:
                    continue
                raise DataServerLostError(
                    f"the coordinator of job {self.job.job_id} on {self.roles.coordinator_at} did not answer "
                    f"within {timeout or self.job.call_timeout:g} s; its static worker is probably frozen"
                ) from exc
            except (OSError, RuntimeError) as exc:
                if isinstance(exc, RuntimeError) and not actor_lost(exc):
                    raise
                # The connection to its worker broke, or the scheduler said the worker is gone.
                raise CoordinatorLost(
                    f"its static worker {self.roles.coordinator_at} was lost ({type(exc).__name__}: {exc})"
                ) from exc

    def wait_unless_left(
        self,
        future: Any,
        worker: str,
        timeout: float,
        elastic: bool = False,
        heard: bool = True,
        gone: Callable[[], bool] | None = None,
    ) -> Any:
        """`future`'s result, unless the static worker `worker` (an elastic one with `elastic`), which the
        call depends on, leaves first: a call to a dead worker waits for Dask's connect timeout. With
        `heard`, a static worker the scheduler has not heard from lately has left too (a promotion must not
        wait on a frozen standby); without, only one the scheduler no longer lists (at the start, a worker
        busy with its first import is silent for a moment). `gone`, if given, says instead whether it has
        left (`Promotions.standby_gone`)."""
        deadline = time.monotonic() + timeout
        next_look = time.monotonic() + WATCH_WHILE_CALLING_SECONDS
        while True:
            try:
                slice_s = max(0.001, min(CALL_SLICE_SECONDS, deadline - time.monotonic()))
                return settled_result(future, slice_s)
            except TimeoutError:
                now = time.monotonic()
                if self.workers.has_left(worker):
                    raise StaticWorkerLeft(worker) from None
                if now >= next_look:
                    next_look = now + WATCH_WHILE_CALLING_SECONDS
                    if gone() if gone is not None else not self.workers.listed(worker, elastic, heard):
                        raise StaticWorkerLeft(worker) from None
                if now >= deadline:
                    raise
            except StartCancelled:
                raise
            except Exception as exc:
                # The call broke: if `worker` is gone, that is why (the error itself may be any of
                # Dask's: a closed comm, an actor whose worker was lost, one from a worker in its death).
                if not elastic and self.workers.leaves_soon(worker, LEAVING_GRACE_SECONDS, heard):
                    raise StaticWorkerLeft(worker) from exc
                raise

    def answering(self, indices: Iterable[int]) -> set[int]:
        """Of the data servers `indices`, taken for lost, those that answer a call within `call_timeout`.

        A static worker the scheduler lists but has not heard from for a moment is taken for lost, so that
        a cut or frozen one's roles move within seconds. But a worker, or the scheduler itself, starved of
        CPU is silent for a moment too (CI's chaos soak on 2 cores: the coordinator's worker and both data
        servers' silent at once, and a job that had lost nothing failed for want of a live shard). So where
        silence would cost a shard its last copy (the job would go back to a checkpoint, or fail), the
        silent ones are asked first: one that answers is not lost, and its answer counts as a heartbeat
        (for one silence limit). A worker being handed over is not asked, nor one whose data server was kept
        `KEEP_TRIES` times (silent to the scheduler while it answers, it would be fenced over and over)."""
        view = self.workers.view()
        listed = {*view.static, *view.silent_static}  # (heard again, perhaps, since it was taken for lost)
        asked: dict[int, Any] = {}
        for i in sorted(set(indices)):
            if self.roles.placement[i] not in listed or not self.roles.may_ask(i):
                continue  # gone; handing its roles over; or kept too often already
            with contextlib.suppress(RuntimeError):  # Dask already knows its worker is gone
                asked[i] = self.roles.shards[i].status(self.total_steps)
        if asked:
            log.warning(
                "job %s: data servers %s, taken for lost, are still listed by the scheduler; asking them "
                "before they count as lost (up to %g s, call_timeout)",
                self.job.job_id, sorted(asked), self.job.call_timeout,
            )  # fmt: skip
        answered: set[int] = set()
        deadline = time.monotonic() + self.job.call_timeout
        while asked and time.monotonic() < deadline:
            for i, future in list(asked.items()):
                if self.workers.has_left(self.roles.placement[i]):
                    del asked[i]  # the scheduler removed its worker: lost after all
                    continue
                try:
                    future.result(timeout=CALL_SLICE_SECONDS)
                except TimeoutError:
                    continue
                except Exception:  # its worker died meanwhile
                    del asked[i]
                    continue
                del asked[i]
                answered.add(i)
                self.workers.heard(self.roles.placement[i])
        if answered:
            log.warning("job %s: data servers %s answered: not lost", self.job.job_id, sorted(answered))
        return answered

    def tell_lost_shards(self) -> None:
        """While a coordinator call waits (it may be calling every shard), look at the static workers: a
        call to a shard whose worker just died waits for Dask's connect timeout, so the coordinator is told
        of the loss at once (`shards_lost`, not waited for), which makes it give that call up."""
        static = set(self.workers.view().static)
        roles = self.roles
        if roles.coordinator_at not in static:
            raise CoordinatorLost(f"its static worker {roles.coordinator_at} left the cluster")
        if roles.promoting is not None and roles.promoting[1] not in static:
            # Told again at each look while the promotion lasts: a report that reaches the coordinator
            # before the promotion put the standby's data server in place does not match its key.
            index, standby, key = roles.promoting
            roles.coordinator.shards_lost([index], f"standby {standby} left during its promotion", [key])
        for i in roles.newly_lost(static):
            # Not waited for: the answer may come after the promotion, which the key fences out.
            where = roles.placement[i]
            roles.coordinator.shards_lost([i], f"static worker {where} left", [roles.shards[i].key])
