"""Dask's failures, recognised in this one module: the only one of the engine that reads Dask's error
text. (Its gather trap is worked around in `training/calls.py`, `settled_result`.)"""

from __future__ import annotations


def actor_lost(exc: BaseException) -> bool:
    """Whether `exc` is Dask saying that the worker holding an actor is gone (a `RuntimeError` raised at a
    call, or at the attribute's lookup once the actor's future is in error)."""
    return isinstance(exc, RuntimeError) and "Actor was lost" in str(exc)


def actor_unreachable(exc: BaseException) -> bool:
    """Whether `exc` is Dask failing to reach an actor's worker at all (a plain `OSError` with its text),
    as opposed to an error raised inside the actor's call."""
    return type(exc) is OSError and "Unable to contact Actor's worker" in str(exc)
