"""The engine's loads: per worker, the task that imports the engine there before it takes a role
(`cluster.workers.load_engine`). A worker is a member, or a data server's home, only once it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from distributed import Client, Future

from ..cluster import load_engine


class EngineLoads:
    """The loads in flight and the workers that loaded the engine."""

    def __init__(self, client: Client, key_prefix: str, on_loaded: Callable[[], None]) -> None:
        self.client = client
        self.key_prefix = key_prefix  # the job's and run's prefix of every task key
        # Called as a load ends: its end may make a member, so the controller looks at once.
        self.on_loaded = on_loaded
        self.in_flight: dict[str, Future] = {}
        self.loaded: set[str] = set()
        self._serial = 0  # numbers the loads' task keys

    def load(self, where: str) -> Future | None:
        """The task that imports the engine on `where`, started once; None once it has ended. (Its future
        is then dropped: a worker holding its result would have to hand it to another before it could
        retire, and would stay "closing_gracefully" meanwhile, a graceful leave taken for a loss.)"""
        if where in self.loaded:
            return None
        future = self.in_flight.get(where)
        if future is not None and future.done():
            del self.in_flight[where]
            self.loaded.add(where)
            return None
        if future is None:
            self._serial += 1
            future = self.in_flight[where] = self.client.submit(
                load_engine, workers=[where], allow_other_workers=False, pure=False,
                key=f"{self.key_prefix}-load-{where}-{self._serial}",
            )  # fmt: skip
            future.add_done_callback(lambda _: self.on_loaded())
        return future

    def loaded_on(self, workers: Iterable[str]) -> set[str]:
        """Of `workers`, those that imported the engine; it starts loading on the others. (A load that
        failed counts as loaded: the role it was for fails there, and says why, as it would have.)"""
        return {w for w in workers if self.load(w) is None}

    def forget_unlisted(self, listed: set[str]) -> None:
        """Workers the scheduler no longer lists load the engine again if they come back."""
        for gone in [w for w in self.in_flight if w not in listed]:
            del self.in_flight[gone]
        self.loaded &= listed

    def clear(self) -> None:
        self.in_flight.clear()
        self.loaded.clear()
