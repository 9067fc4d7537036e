"""Dask's failures, recognised and translated in this one module: the only one of the engine that reads
Dask's error text or works around its quirks."""

from __future__ import annotations

from typing import Any

import distributed
from distributed import Client, Future

from .signals import StartCancelled

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


def actor_lost(exc: BaseException) -> bool:
    """Whether `exc` is Dask saying that the worker holding an actor is gone (a `RuntimeError` raised at a
    call, or at the attribute's lookup once the actor's future is in error)."""
    return isinstance(exc, RuntimeError) and "Actor was lost" in str(exc)


def actor_unreachable(exc: BaseException) -> bool:
    """Whether `exc` is Dask failing to reach an actor's worker at all (a plain `OSError` with its text),
    as opposed to an error raised inside the actor's call."""
    return type(exc) is OSError and "Unable to contact Actor's worker" in str(exc)
