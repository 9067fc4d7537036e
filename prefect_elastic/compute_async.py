"""Moved to the package `prefect_elastic.compute` (`async_loop.py`, `async_session.py`); this module stays
only until the controller imports `MIN_LEASE` from there."""

from .compute import MIN_LEASE, AsyncSession

__all__ = ["MIN_LEASE", "AsyncSession"]
