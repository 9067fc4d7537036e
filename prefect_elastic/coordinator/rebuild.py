"""A coordinator rebuilt on another static worker, from the controller's copy of the record (`Journal`) and
what the live shards hold, fenced into a generation above any they have seen. Pure.

Here: the rebuild where every shard goes on from one version (sync commits; and, with `kind` RESTORED, the
shards of either bookkeeping all started afresh from a persistent checkpoint), and what a rebuilt
coordinator's fence asks the shards in async mode (`rebuild_applied_from`). The async rebuild, which keeps
each shard at its own version, belongs to the leases (`AsyncLeases.rebuild`).
"""

from __future__ import annotations

import math

from ..errors import DataServerLostError, FatalError
from ..ledger import Ledger
from ..messages import EventKind, Journal, MembershipEvent, ShardStatus, StepRecord
from .record import CoordinatorRecord


def rebuild_applied_from(journal: Journal) -> int:
    """Async mode: the lowest batch id a rebuilt coordinator's fence asks every shard about (the ids each
    applied from there on, recorded or not: `ShardStatus.applied`). The copy's lowest open id, or lower,
    the lowest id the copy committed after its snapshot: a shard promoted after the copy was taken holds
    its snapshot alone, and its promotion retracted those commits, a change the copy never saw
    (`AsyncLeases.rebuild` keeps only the ones every live shard holds)."""
    after = [e.batch_id for e in journal.entries if e.step >= journal.snapshot_step]
    return min([journal.first_open_batch(), *after])


def check_shards(state: CoordinatorRecord, fenced: list[ShardStatus], lost: set[int]) -> None:
    """Every shard is either fenced (live) or lost, never both."""
    live = {s.index for s in fenced}
    if live | lost != set(range(state.shards)) or live & lost:
        raise FatalError(f"rebuild: shards {sorted(live)} live and {sorted(lost)} lost: a bug")


def rebuild_at_one_version(
    state: CoordinatorRecord,
    journal: Journal,
    fenced: list[ShardStatus],
    lost: set[int],
    generation: int,
    where: str,
    reason: str,
    now: float,
    began: float,
    kind: EventKind,
) -> MembershipEvent:
    """The ledger is what every shard applied, as the old coordinator would have had it: the copy's steps
    up to that version, then the shards' records of the steps after (the batch ids of a step follow from
    the schedule, which fills in a record no live shard holds). The snapshot a rollback or a promotion
    goes back to is the newest that every live shard holds, and that each lost shard's peer holds a
    replica of; with a shard lost, the ledger stands there, for the promotion. Nothing is handed out until
    the next survival check admits the live workers (in a new generation, which brings the shards to one
    version if they are not)."""
    live = {s.index: s for s in fenced}
    if not live:
        raise DataServerLostError(
            f"the coordinator of job {state.job_id} died with every data server ({sorted(lost)}), and "
            "with them every replica"
        )
    applied = min(s.version for s in fenced)  # every live shard applied the steps before it
    held = set.intersection(*({i.version for i in s.snapshots} for s in fenced))
    for i in lost:
        peer = live.get((i + 1) % state.shards)
        held &= set(peer.replicas) if peer is not None else set()
    held = {v for v in held if v <= applied}
    consistent = not lost and len({s.version for s in fenced}) == 1
    if not held and not consistent:
        raise DataServerLostError(
            f"the coordinator of job {state.job_id} cannot be rebuilt: no snapshot is held by every live "
            "shard" + (f" and by the peers of data servers {sorted(lost)}, lost with it" if lost else "")
        )
    committed = max(held) if lost else applied
    keep = min(journal.committed_steps, committed)
    state.ledger = Ledger()
    state.ledger.restore([e for e in journal.entries if e.step < keep], keep)
    state.history = journal.history[:keep]
    state.commit_times = journal.commit_times[:keep]
    records: dict[int, StepRecord] = {}
    for status in fenced:
        for one in status.records:
            records.setdefault(one.step, one)
    for step in range(keep, committed):
        batch_ids = state.schedule.step_batches(step)
        record = records.get(step)
        if record is None:
            state.ledger.commit(batch_ids, step, -1)
            state.history.append(math.nan)
            state.commit_times.append(math.nan)
            continue
        if tuple(record.batch_ids) != tuple(batch_ids):
            raise FatalError(f"a shard applied step {step} from batch ids {record.batch_ids}: a bug")
        state.ledger.commit(batch_ids, step, record.generation, record.workers)
        state.history.append(sum(record.losses[b] for b in batch_ids) / len(batch_ids))
        state.commit_times.append(record.time)
    state.ledger.snapshot_step = max(held, default=committed)
    state.snapshot_wanted = None  # (asked of shards that were fenced since)
    state.take_over(journal, fenced, lost, generation)
    reached = max(journal.committed_steps, applied)
    if kind is EventKind.RESTORED:
        state.counters["checkpoint_restores"] += 1
        why = reason
    else:
        state.counters["coordinator_rebuilds"] += 1
        why = (
            f"the coordinator rebuilt on {where} ({reason}); the ledger rebuilt to step {committed} from "
            f"the controller's copy (to step {keep}) and the shards' records"
            + (f"; data servers {sorted(lost)} lost with it" if lost else "")
        )
    return state.record(
        kind,
        steps_lost=max(0, reached - committed),
        reason=why,
        now=now,
        seconds=now - began,
    )
