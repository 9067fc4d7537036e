"""A `cluster_class` given by import path, imported without letting the import install signal handlers.

`resolve_cluster_class("dask_jobqueue.SLURMCluster")` gives the class; every error of the import is a
`JobConfigError` naming the path. `import_keeping_signals` is what makes that import safe from a flow's
thread (see its docstring).
"""

from __future__ import annotations

import importlib
import logging
import signal
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..errors import JobConfigError

log = logging.getLogger(__name__)


# One cluster class import at a time: each swaps `signal.signal` while it runs (`import_keeping_signals`).
_SIGNALS_SWAPPED = threading.Lock()


def import_keeping_signals(module: str) -> ModuleType:
    """Import `module` (a cluster class's) without letting the import install signal handlers.

    `dask_jobqueue.SLURMCluster` imports `dask_jobqueue.runner`, which calls `signal.signal(SIGINT,
    lambda *_: sys.exit())` as it is imported: from any thread but the main one that raises ValueError
    ("signal only works in main thread of the main interpreter"), and a flow called from a thread could not
    import its cluster class; on the main thread it silently replaced the caller's Ctrl-C handler (a
    flow's, Prefect's, the user's) with `sys.exit`. While the module imports, `signal.signal` called from
    the importing thread changes nothing (it answers with the handler in place); from any other thread it
    goes through as always. (That handler serves dask-jobqueue's runners, which run as the batch script
    itself; a cluster class made here never uses it.)"""
    original = signal.signal
    importing = threading.get_ident()

    def keep(signalnum: int, handler: Callable[..., Any] | int | None) -> Any:
        if threading.get_ident() != importing:
            return original(signalnum, handler)
        log.debug("importing %s: left the handler of signal %s as it was", module, signalnum)
        return signal.getsignal(signalnum)

    with _SIGNALS_SWAPPED:
        signal.signal = keep
        try:
            return importlib.import_module(module)
        finally:
            signal.signal = original


def resolve_cluster_class(spec: str | type) -> type:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.replace(":", ".").rpartition(".")
    try:
        found: type = getattr(import_keeping_signals(module), name)
        return found
    except (ImportError, AttributeError, ValueError) as exc:
        raise JobConfigError(
            "cluster_class",
            spec,
            f"cannot be imported ({exc}); give an import path such as distributed.LocalCluster",
        ) from exc
