"""Dask's statistical profiler paused on a compute worker while any compute loop runs there
(`dask_profiler_paused`)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

# Set to 1 in the compute workers' environment to keep Dask's statistical profiler running while they
# train (`dask_profiler_paused`).
PROFILER_ENV = "PREFECT_ELASTIC_DASK_PROFILER"

# Compute loops running in each worker of this process (by `id`): Dask's profiler is paused while any is.
_LOOPS: dict[int, int] = {}
_LOOPS_LOCK = threading.Lock()
_PROFILER_CALLBACKS = ("profile", "profile-cycle")


@contextlib.contextmanager
def dask_profiler_paused(worker: Any) -> Iterator[None]:
    """Dask's statistical profiler stopped on `worker` while this loop, or another job's loop there, runs.

    Why: every 10 ms (`distributed.worker.profile.interval`) the worker's event loop walks the stack of
    every thread that runs a task, this loop's among them, twice, holding the GIL, which the loop's
    thread then waits for between torch's kernels. In profiles of the transformer's steady state (py-spy)
    the compute worker's event loop was busy 16% of the time with it, 2% without; the compute phase of a
    step took 13.37 ms against 13.71 in one A/B (4 alternating pairs on one cluster, 2026-11-27), and the
    same within the noise in another (two clusters). A profile of a task that runs for the whole job
    says little anyway. `PREFECT_ELASTIC_DASK_PROFILER=1` in the workers' environment keeps it running."""
    callbacks = [pc for name, pc in list(worker.periodic_callbacks.items()) if name in _PROFILER_CALLBACKS]
    if not callbacks or os.environ.get(PROFILER_ENV) == "1":
        yield
        return
    with _LOOPS_LOCK:
        _LOOPS[id(worker)] = _LOOPS.get(id(worker), 0) + 1
    _on_event_loop(worker, _sync_profiler, worker, callbacks)
    try:
        yield
    finally:
        with _LOOPS_LOCK:
            _LOOPS[id(worker)] -= 1
            if not _LOOPS[id(worker)]:
                del _LOOPS[id(worker)]
        _on_event_loop(worker, _sync_profiler, worker, callbacks)


def _on_event_loop(worker: Any, fn: Callable[..., None], *args: Any) -> None:
    # (A periodic callback is started and stopped on its event loop. After the event loop closed, tornado
    # drops the call; a worker closing has stopped every periodic callback itself.)
    with contextlib.suppress(RuntimeError):
        worker.loop.add_callback(fn, *args)


def _sync_profiler(worker: Any, callbacks: list[Any]) -> None:
    """The profiler paused while a loop runs in `worker`, running otherwise. It reads the count when it
    runs, not when it was queued: two loops' calls, queued from two threads, may arrive in either order."""
    with _LOOPS_LOCK:
        paused = _LOOPS.get(id(worker), 0) > 0
    for pc in callbacks:
        if paused:
            pc.stop()
        # (Not on a worker closing: `Worker.close` stopped them. One retiring may yet go back to running.)
        elif worker.status.name in ("running", "paused", "closing_gracefully") and not pc.is_running():
            pc.start()
