"""Hooks a data server calls at the points a rehearsal wants to slow it down or kill it there.

The engine only calls them; what they do lives with the harness (`prefect_elastic.local.slow`: Dask worker
plugins that sleep, or SIGKILL their worker). A data server looks its hooks up once, as it starts
(`hooks_of_this_worker`): the answer follows the worker's plugins from then on, since a rehearsal may
register one while the server runs (a hand-over held on a worker whose data server started long before).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ServerHooks(Protocol):
    """What a data server calls; a Dask worker plugin that has these methods is one (`NoHooks` is the
    base that does nothing, to override one method of)."""

    def on_start(self) -> None:
        """As a data server starts, before it loads anything (in the thread of the task that makes it)."""

    async def before_apply(self) -> None:
        """Before each async apply, once the apply has its turn (on the worker's event loop)."""

    async def on_hold(self) -> None:
        """When a hand-over asks the data server to hold at a step, before it does."""

    def on_fence(self) -> None:
        """When a data server is fenced into a newer generation, before it enters it."""


class NoHooks:
    """Hooks that do nothing: the default, and the base of a plugin that overrides one of them."""

    def on_start(self) -> None:
        return None

    async def before_apply(self) -> None:
        return None

    async def on_hold(self) -> None:
        return None

    def on_fence(self) -> None:
        return None


class PluginHooks:
    """Every hook of the worker plugins in `plugins` (a worker's live mapping, so that one registered
    later counts), called in turn."""

    def __init__(self, plugins: Mapping[str, Any]) -> None:
        self._plugins = plugins

    def _hooks(self) -> list[ServerHooks]:
        return [p for p in list(self._plugins.values()) if isinstance(p, ServerHooks)]

    def on_start(self) -> None:
        for hooks in self._hooks():
            hooks.on_start()

    async def before_apply(self) -> None:
        for hooks in self._hooks():
            await hooks.before_apply()

    async def on_hold(self) -> None:
        for hooks in self._hooks():
            await hooks.on_hold()

    def on_fence(self) -> None:
        for hooks in self._hooks():
            hooks.on_fence()


def hooks_of_this_worker() -> ServerHooks:
    """The hooks of the Dask worker this runs on; none outside a worker (a data server made in a test's
    own process)."""
    try:
        from distributed import get_worker

        return PluginHooks(get_worker().plugins)
    except ValueError:  # (what `get_worker` raises outside a worker's task or actor)
        return NoHooks()
