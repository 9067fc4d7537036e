"""How lost data servers come back, as a plan (pure, tested without a cluster:
tests/unit/test_membership.py): which are started on a standby from the peer's replica, which from the
state the run started from, which must be asked first (only silent, they keep their role), and whether
every shard must go back to the checkpoint. `Promotions.promote` carries it out, and makes it again
(`Again`: with which data servers, and whether to ask them) when a peer dies under it or some answer."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


def replica_peer(index: int, lost: Collection[int], shards: int, peer_replicas: bool) -> int | None:
    """The peer that may hold the replica of data server `index`'s shard (data server `index + 1`), unless
    there are none or it is lost too."""
    peer = (index + 1) % shards
    if not peer_replicas or peer in lost or peer == index:
        return None
    return peer


@dataclass(frozen=True)
class RecoveryPlan:
    lost: tuple[int, ...]
    from_replica: tuple[int, ...]  # started on a standby, then given the peer's copy of the snapshot
    from_start: tuple[int, ...]  # started on a standby from the state the run started from
    # Neither: their state since the start is gone with them, unless they were only silent.
    unrestorable: tuple[int, ...]
    ask_first: tuple[int, ...]  # asked whether they answer before anything moves
    why: str  # why the unrestorable cannot be restored

    @property
    def back_to_checkpoint(self) -> bool:
        """Every shard goes back to the checkpoint (once those asked did not answer)."""
        return bool(self.unrestorable)


def plan_recovery(
    lost: Collection[int],
    shards: int,
    targets: Mapping[int, int],
    start_versions: Mapping[int, int],
    replica_held: Mapping[int, bool],
    peer_replicas: bool,
    ask: bool,
) -> RecoveryPlan:
    """The plan for the lost data servers `lost`, of `shards`: each goes back to the snapshot of version
    `targets[i]`, which its peer holds if `replica_held[i]`, or which is the state the run started from if
    it is `start_versions[i]`. Where neither, the lost are asked first if `ask` (silent for a moment, not
    lost: they keep their roles), and if none answers every shard goes back to the checkpoint."""
    ordered = tuple(sorted(set(lost)))
    replica = tuple(i for i in ordered if replica_held.get(i, False))
    start = tuple(i for i in ordered if i not in replica and targets[i] == start_versions[i])
    unrestorable = tuple(i for i in ordered if i not in replica and i not in start)
    if not peer_replicas:
        why = "the job has peer_replicas=False, so no copy of a shard was kept"
    else:
        why = "; ".join(
            f"data server {i}'s replica was held by data server {(i + 1) % shards}, "
            + ("lost with it" if (i + 1) % shards in ordered else "whose own worker died since")
            for i in unrestorable
        )
    return RecoveryPlan(
        lost=ordered,
        from_replica=replica,
        from_start=start,
        unrestorable=unrestorable,
        ask_first=ordered if ask and unrestorable else (),
        why=why,
    )


@dataclass(frozen=True)
class Again:
    """The plan to make again (`Promotions.promote`'s next round): for `lost`, asking them first if `ask`."""

    lost: tuple[int, ...]
    ask: bool


def peer_gone_while_asked(lost: Collection[int], on_peer: Collection[int], ask: bool) -> Again:
    """A peer's worker died while it was asked whether it holds a replica (nothing moved yet): every data
    server it held is lost too; asking stays as it was."""
    return Again(tuple(sorted({*lost, *on_peer})), ask)


def peer_gone_during_start(lost: list[int], index: int, shards: int, asked: bool) -> Again:
    """The peer of data server `index` died while `index` was started from its replica: `index`, the ones
    after it in `lost` (those before are promoted already) and the peer are lost; they may be asked again
    unless this round `asked` them."""
    return Again(tuple(sorted({*lost[lost.index(index) :], (index + 1) % shards})), not asked)


def kept_answered(lost: Collection[int], kept: Collection[int]) -> Again:
    """Data servers `kept` answered and keep their roles: the rest are promoted without asking again."""
    return Again(tuple(i for i in lost if i not in kept), False)
