"""The role table: where each data server and the coordinator live, their actors and channels, the
standbys, and the promotions in flight. It owns that state alone; the others read it and change it through
its methods (`place`, `move`, `promoted`, `coordinator_moved`, `hand_over_begun`, ...), so that "data
server i is now on worker w" is written once. It makes no call: `StaticRoles`, `Promotions` and
`CheckpointFallback` act, then record here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from distributed import Future

from ..messages import Promotion, ShardHandle
from ..sharding import Piece
from ..wire import ChannelAddress
from .workers import standbys

# How many times a data server taken for lost may keep its role because it answered (`answering`): a
# worker that stays silent to the scheduler while it answers would otherwise be fenced over and over.
KEEP_TRIES = 3


class RoleTable:
    """Where the job's roles live, and the promotions in flight."""

    def __init__(self) -> None:
        self.coordinator: Any = None  # a ControllerCoordinatorHandle once started
        self.coordinator_at = ""
        self.coordinator_future: Future | None = None
        # The static worker of each data server, its actor's future, handle and channel, by shard index.
        self.placement: list[str] = []
        self.actor_futures: list[Future] = []
        self.shards: list[Any] = []  # ShardHandles: Dask actors (their `key` names the actor)
        self.channels: list[ChannelAddress] = []  # where each shard listens for compute loops
        self.plan: list[list[Piece]] = []
        # Static workers that hold none of the roles: a lost data server's role goes to one of them.
        self.standbys: tuple[str, ...] = ()
        self.warmed: dict[str, Future] = {}  # standbys made ready to take a role (`warm_standby`)
        self._leaving: set[str] = set()  # static workers whose roles are handed over: never a standby
        # The standby a data server is being started on: silent to the scheduler, it is asked for Dask's
        # handshake before it counts as gone (`Workers.view`), as a role's worker is.
        self._starting_on: set[str] = set()
        self._promoting: tuple[int, str, str] | None = None  # the shard, standby and key being promoted
        self.told_lost: set[int] = set()  # data servers the coordinator was told of during a long call
        self.kept: Counter[tuple[int, str]] = Counter()  # data servers (index, worker) kept: they answered
        self._promotions: list[Promotion] = []

    @property
    def leaving(self) -> frozenset[str]:
        """The static workers whose roles are handed over (`hand_over_begun`): never a standby."""
        return frozenset(self._leaving)

    @property
    def promoting(self) -> tuple[int, str, str] | None:
        """The shard, standby and actor key of the promotion in flight (`promoting_on`), if any."""
        return self._promoting

    @property
    def promotions(self) -> tuple[Promotion, ...]:
        """The promotions done, in order (`promoted`)."""
        return tuple(self._promotions)

    def holders(self) -> set[str]:
        """The static workers that hold a role, or are about to (a standby a data server starts on)."""
        return {*self.placement, self.coordinator_at, *self._starting_on} - {""}

    def hand_over_begun(self, worker: str) -> None:
        """The retiring static worker `worker` hands its roles over: from now on it is never a standby."""
        self._leaving.add(worker)

    def starting_on_standby(self, standby: str) -> None:
        """A data server is being started on `standby` (it counts as a role's worker meanwhile)."""
        self._starting_on = {standby}

    def start_ended(self) -> None:
        """The start on a standby failed, or its data server took its role (`move`)."""
        self._starting_on = set()

    def promoting_on(self, index: int, standby: str, key: str) -> None:
        """The coordinator is promoting data server `index`, just started on `standby` as actor `key`."""
        self._promoting = (index, standby, key)

    def promotion_ended(self) -> None:
        self._promoting = None

    def promoted(
        self, promotion: Promotion, future: Future, shard: ShardHandle, channel: ChannelAddress
    ) -> tuple[Future | None, ChannelAddress | None]:
        """Data server `promotion.index` was promoted on `promotion.standby`: recorded, and moved there
        (`move`); the old actor's future and channel, for the caller to release."""
        self._promotions.append(promotion)
        return self.move(promotion.index, promotion.standby, future, shard, channel)

    def place(self, static: list[str], shards: int) -> None:
        """The start's placement on the static workers `static`: data servers round the list, the
        coordinator beside data server 0."""
        self.placement = [static[i % len(static)] for i in range(shards)]
        self.coordinator_at = static[0]

    def submitted(self, future: Future, coordinator: bool = False) -> None:
        """The start submitted a data server's actor (in index order), or the coordinator's."""
        if coordinator:
            self.coordinator_future = future
        else:
            self.actor_futures.append(future)

    def started(
        self,
        coordinator: Any,
        shards: list[ShardHandle],
        channels: list[ChannelAddress],
        plan: list[list[Piece]],
    ) -> None:
        """The actors the start placed are up."""
        self.coordinator, self.shards, self.channels, self.plan = coordinator, shards, channels, plan

    def abandon(self) -> list[Future]:
        """Forget a start that lost a static worker; the actors' futures to cancel."""
        futures = [*self.actor_futures, *([self.coordinator_future] if self.coordinator_future else [])]
        self.actor_futures, self.coordinator_future = [], None
        self.placement, self.coordinator_at = [], ""
        return futures

    def move(
        self, index: int, worker: str, future: Future, shard: ShardHandle, channel: ChannelAddress
    ) -> tuple[Future | None, ChannelAddress | None]:
        """Data server `index` now lives on `worker` (a promotion, or every shard back to a checkpoint):
        the old actor's future and channel, for the caller to release."""
        old = self.actor_futures[index] if index < len(self.actor_futures) else None
        moved = self.channels[index] if index < len(self.channels) else None
        self.actor_futures[index], self.shards[index] = future, shard
        self.channels[index], self.placement[index] = channel, worker
        self.told_lost.discard(index)
        self._starting_on = set()
        self.standbys = tuple(w for w in self.standbys if w != worker)
        return old, moved

    def coordinator_moved(self, handle: Any, where: str, future: Future) -> Future | None:
        """The coordinator now lives on `where`; the old actor's future, for the caller to release."""
        old, self.coordinator_future = self.coordinator_future, future
        self.coordinator, self.coordinator_at = handle, where
        return old

    def seen_standbys(self, static: tuple[str, ...]) -> tuple[str, ...]:
        """The standbys among the live static workers `static` (none that is handing its roles over)."""
        self.standbys = standbys([w for w in static if w not in self._leaving], self.placement)
        return self.standbys

    def free(self, static: tuple[str, ...] | list[str], taken: list[str] | None = None) -> tuple[str, ...]:
        """The static workers of `static` a data server can go to: neither leaving nor holding one (nor one
        of `taken`)."""
        return standbys(
            [w for w in static if w not in self._leaving], self.placement if taken is None else taken
        )

    def lost(self, static: tuple[str, ...] | set[str]) -> list[int]:
        """The data servers whose worker is not among the live static workers `static`."""
        return [i for i, where in enumerate(self.placement) if where not in static]

    def on(self, worker: str) -> list[int]:
        """The data servers `worker` holds."""
        return [i for i, where in enumerate(self.placement) if where == worker]

    def may_ask(self, index: int) -> bool:
        """Whether data server `index`, taken for lost, may be asked whether it answers: not while its
        worker hands its roles over, nor once it was kept `KEEP_TRIES` times."""
        where = self.placement[index]
        return where not in self._leaving and self.kept[(index, where)] < KEEP_TRIES

    def keep(self, index: int) -> None:
        """Data server `index`, taken for lost, answered: it keeps its role where it is."""
        self.kept[(index, self.placement[index])] += 1
        self.told_lost.discard(index)

    def newly_lost(self, static: set[str]) -> list[int]:
        """The data servers whose worker left `static`, that the coordinator was not told of yet; from now
        on they count as told."""
        lost = [i for i in self.lost(static) if i not in self.told_lost]
        self.told_lost.update(lost)
        return lost

    def warming(self, worker: str, future: Future) -> None:
        self.warmed[worker] = future

    def warmth(self, standby: str) -> str:
        """Where `standby`'s warming (`warm_standby`) stands, for the promotion's log."""
        warmed = self.warmed.get(standby)
        if warmed is None:
            return "not warmed"
        return "warm" if warmed.done() else "still warming"

    def released(self) -> list[Future]:
        """Every actor's future, to cancel: the run is over."""
        futures = [*self.actor_futures, *([self.coordinator_future] if self.coordinator_future else [])]
        self.actor_futures, self.coordinator_future = [], None
        self.warmed.clear()
        return futures
