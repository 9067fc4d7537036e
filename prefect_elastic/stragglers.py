"""Stragglers in sync mode, as pure decisions: when a shard asks for a step's missing micro-batches to be
trained again by the members that pushed theirs (a backup), which member trains which, and where a loop
the shards went past goes on.

Why a backup gives the same result: a step's batch ids are fixed by the schedule, a micro-batch's gradient
is a function of the step's parameters and its batch alone (random ops seeded by the batch id), and a shard
sums the gradients in batch-id order whoever sent them. A shard keeps the first copy of a batch id's
gradient and drops a later one (once it asked for a backup of an id, the backup's, or the member's own
confirmed: `OpenStep.take`), and refuses a push of a step it applied already, so every batch id is
applied once. A member that stops answering (a pause, a cut link, a starved
process) then holds the step up for `backup_after` seconds, not until survival detection removes it.

The shard decides when (`backup_after`, `backup_due_in`: `data_server/apply.py`); each loop it asks
decides its own part (`backup_share`: `compute/sync_loop.py`), so no message goes between loops.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence

# A step stands open this long at least, its first push in, before its missing micro-batches are asked of
# the members that pushed: a loaded machine delays a live member's push by a few step times now and then,
# and a backup of it costs the others a share's compute.
BACKUP_FLOOR_SECONDS = 0.25
# ... and this many times the shard's recent step time (the median of `RECENT_STEPS`).
BACKUP_STEP_FACTOR = 4.0
RECENT_STEPS = 16
# Before the shard knows its pace (fewer than this many steps since it started): a first step may compile
# and allocate, and is slow without any straggler.
PACE_KNOWN_AFTER = 4
BACKUP_UNPACED_SECONDS = 1.0


def backup_after(step_seconds: Sequence[float]) -> float:
    """How long a step stands open with micro-batches missing before the shard asks for a backup, given the
    time its recent steps took from one apply to the next."""
    if len(step_seconds) < PACE_KNOWN_AFTER:
        return BACKUP_UNPACED_SECONDS
    recent = step_seconds[-RECENT_STEPS:]
    return max(BACKUP_FLOOR_SECONDS, BACKUP_STEP_FACTOR * statistics.median(recent))


def backup_due_in(
    now: float,
    opened: float,
    after: float,
    missing: Collection[int],
    behind: Collection[int],
    told: float | None = None,
) -> float:
    """Seconds until a step opened (its first push in) at `opened` asks a member for its `missing`
    positions (micro-batch `j` of the step) as a backup: 0 when it asks now.

    `behind`: the positions the step before got from a backup. A member whose share was trained for it
    is most likely still silent, so once every other position is in, the step asks at once instead of
    waiting again; one that comes back pushes its own and is no longer behind. `told`: when this member
    was asked already for this step; it is asked again only `after` seconds later (the ids may be on
    their way from another member, and two members asked at different moments may have left one out)."""
    if not missing:
        return float("inf")
    due = 0.0 if behind and set(missing) <= set(behind) else max(0.0, opened + after - now)
    return due if told is None else max(due, told + after - now)


def backup_share(missing: Sequence[int], batches: range, rank: int, size: int) -> tuple[int, ...]:
    """The missing batch ids of a step (`batches`: its batch ids) that the member of rank `rank` of `size`
    trains as a backup. The ranks whose shares hold a missing batch id are taken for silent; the others
    take the silent ranks' positions in the step in turn, in order of rank and of position. By position,
    not by the missing ids' order, so that members asked at different moments (a backup of some of them
    already in) still split them alike; where two shards named different ids, or a silent member's ids
    are all in by the time another asks, a member may train one that another trains too (the shard keeps
    the first copy) or none trains one (the shard asks again a wait later)."""
    first = batches.start
    silent = {(b - first) % size for b in missing}
    holders = range(min(size, len(batches)))  # (a rank beyond the step's micro-batches holds no share)
    live = [r for r in holders if r not in silent] or [rank]
    if rank not in live:
        return ()
    positions = [j for j in range(len(batches)) if j % size in silent]
    turn = {first + j: live[i % len(live)] for i, j in enumerate(positions)}
    return tuple(b for b in sorted(set(missing)) if turn.get(b, rank) == rank)


def catch_up(step: int, version: int, total_steps: int) -> int:
    """The step a loop at `step` goes on from when a shard says it stands at `version` (it applied every
    step before it): where it was, when the shard has not passed it (a backup's push came after the step
    it backed up was applied); else the step after the shard's open one. The members have computed the
    open step since it opened, so a loop that joined it would most likely push after the step was backed
    up; the next one it starts beside them, when the shard answers their pulls and its pull at once.

    Except the last step (`total_steps - 1`): no pull of a step after it asks the others for a backup of
    it, so a loop that went past it while its own share was missing would leave it open for ever. A loop
    the shards passed with the last step open trains that step; once every step is applied, it is done
    (`total_steps`)."""
    if version >= total_steps:
        return total_steps
    if version <= step:
        return step
    return min(version + 1, total_steps - 1)
